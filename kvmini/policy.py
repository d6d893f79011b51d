"""When a method compresses: its `schedule`, one of four. A method's own code says when in its `if`s;
the schedule names it for the tools that report it (run.py's report, the kept-token page, the
evaluation suite) and for the budget rules (a budget is a no-op if no call ever exceeds it)."""

PREFILL = "prefill"  # once, layer by layer, in the forward call that completes the prompt
AFTER_PROMPT = "after_prompt"  # in the call that completes the prompt, then after every later call
EVERY_CALL = "every_call"  # after every forward call (each prefill chunk, each decode step)
DECODE = "decode"  # after every call past the prompt: the first compression at the first decode step
