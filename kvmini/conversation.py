"""run.py's runs of several prompts over one cache (docs/design.md, "A cache that lives on"):

    --chat                              turns read from stdin, one answer each; every turn is the run's
                                        next prompt (policy.next_prompt), so the cache lives on
    --context FILE --question TEXT ...  the context is compressed once, before any question is known; each
                                        question is the next prompt of its own copy (kvmini.generate.fork),
                                        as kvpress's pipeline answers several questions about one context

What a prompt's text is: the chat template's rendering of the conversation so far, minus what the cache
has already seen (the text before the answer, and the answer's tokens themselves).
"""
import time
from dataclasses import dataclass, field

import torch

from kvmini.cache import KVCache
from kvmini.errors import KvminiError
from kvmini.generate import GenerationResult, fork, prefill


@dataclass
class Turn:
    """One prompt of the run and its answer."""

    label: str  # "turn 2", "question 1"
    ids: list[int]  # the tokens fed for it (the template's text around it included)
    result: GenerationResult
    seen: int  # tokens the cache had seen when the answer was done
    held: float  # entries per layer (mean) the cache held then
    snapshot: tuple = field(default=None, repr=False)  # (cache, policy) copies then, for the page
    note: str | None = None  # the policy's note on this prompt's budget (raised to fit, not compressed)


def line(turn: Turn) -> str:
    r = turn.result
    return (f"{turn.label:<11} {len(turn.ids)} tokens in, {max(map(len, r.tokens))} out; "
            f"the cache holds {turn.held:.0f} entries per layer (mean) of the {turn.seen} it has seen"
            + (f"; {turn.note}" if turn.note else ""))


def split_at_context(chat, context: str, question: str) -> tuple[str, str]:
    """The prompt text of a question about a context, cut where the context ends: (context part, question part).
    Both parts are the one-message rendering `chat.render([user: context + blank line + question])`."""
    if chat is None:
        return context, f"\n\n{question}\n"
    whole = chat.render([{"role": "user", "content": f"{context}\n\n{question}"}])
    at = whole.find(context)
    if at < 0:
        raise KvminiError("the chat template changes the context's text, so it cannot be cut where the context ends; "
                          "try --raw")
    return whole[: at + len(context)], whole[at + len(context) :]


def next_turn_text(chat, history: list[dict], fed: str, answer: str, said: str) -> str:
    """The text of the next turn: the rendering of the conversation with the answer and the new turn,
    after what the cache has seen (`fed`, the rendering up to the answer, then the answer itself)."""
    if chat is None:
        return f"\n{said}\n"
    whole = chat.render(history + [{"role": "assistant", "content": answer}, {"role": "user", "content": said}])
    if not whole.startswith(fed):
        raise KvminiError(f"the chat template ({type(chat).__name__}) renders an earlier turn differently once the "
                          "conversation goes on, so a turn cannot continue the cache; try --raw")
    rest = whole[len(fed) :]
    if rest.startswith(answer):
        return rest[len(answer) :]
    if rest.lstrip().startswith(answer.strip()):  # a template that strips the answer (Llama 2 and 3)
        return rest.lstrip()[len(answer.strip()) :]
    raise KvminiError(f"the chat template ({type(chat).__name__}) changes the answer's text in the conversation; try --raw")


class Session:
    """The model, its tokenizer and chat format, and how to answer: `answer(ids, cache)` generates for
    prompt ids (continuing `cache` if given) and streams the answer; `check(n)` refuses a run that
    would outgrow the model's context."""

    def __init__(self, model, tok, chat, policy, answer, max_new_tokens: int, keep_snapshots: bool):
        self.model, self.tok, self.chat, self.policy, self.answer = model, tok, chat, policy, answer
        self.max_new_tokens, self.keep_snapshots = max_new_tokens, keep_snapshots

    def encode(self, text: str, what: str) -> list[int]:
        ids = self.tok.encode(text)
        if not ids:
            raise KvminiError(f"{what} encodes to zero tokens")
        return ids

    def check(self, seen: int, n: int, what: str) -> None:
        context = self.model.config.max_position_embeddings
        if seen + n + self.max_new_tokens > context:
            raise KvminiError(f"{what}: {seen} tokens seen + {n} new + --max-new-tokens {self.max_new_tokens} exceeds "
                              f"the model's context of {context} tokens")

    def turn(self, label: str, ids: list[int], cache: KVCache | None, policy) -> Turn:
        before = 0 if cache is None else cache.seen_tokens
        self.check(before, len(ids), label)
        result = self.answer(ids, cache, policy)
        kept = result.cache.lengths()
        snapshot = fork(result.cache, policy) if self.keep_snapshots else None
        return Turn(label, ids, result, result.cache.seen_tokens, sum(kept) / len(kept), snapshot,
                    None if policy is None else policy.run.note)

    def chat_turns(self, lines) -> list[Turn]:
        """Every non-empty line of `lines` is a turn of one conversation, continuing one cache."""
        turns, history, fed, cache = [], [], "", None
        for said in (s.strip() for s in lines):
            if not said:
                continue
            if cache is None:
                fed = self.chat.render([{"role": "user", "content": said}]) if self.chat else said + "\n"
                ids = self.encode(fed, "the first turn")
            else:
                answer = self.tok.decode(turns[-1].result.tokens[0])
                text = next_turn_text(self.chat, history, fed, answer, said)
                history.append({"role": "assistant", "content": answer})
                fed = (self.chat.render(history + [{"role": "user", "content": said}]) if self.chat
                       else fed + answer + text)
                last = turns[-1].result.tokens[0]
                ids = last[len(last) - self.unfed(turns[-1]) :] + self.encode(text, f"turn {len(turns) + 1}")
            history.append({"role": "user", "content": said})
            turns.append(self.turn(f"turn {len(turns) + 1}", ids, cache, self.policy))
            cache = turns[-1].result.cache
            print(line(turns[-1]), flush=True)
        if not turns:
            raise KvminiError("--chat read no turn: give one turn per line on stdin (or type them on a terminal)")
        return turns

    @staticmethod
    def unfed(turn: Turn) -> int:
        """Answer tokens the cache has not seen: the last one when --max-new-tokens cut the answer (generate
        samples it but never feeds it), none when a stop token ended it (each decode step feeds one)."""
        return len(turn.result.tokens[0]) - turn.result.decode_steps

    def questions(self, context: str, questions: list[str], progress=None) -> tuple[GenerationResult, list[Turn]]:
        """Compress the context once (before any question is known), then answer each question from a copy.
        progress(n): the prefill's on_progress for the context's n tokens (e.g. a kvmini.progress.Progress's
        update), or None."""
        parts = [split_at_context(self.chat, context, q) for q in questions]
        ctx_ids = self.context_ids = self.encode(parts[0][0], "the context")
        self.check(0, len(ctx_ids), "the context")
        asked = [self.encode(rest, f"question {i}") for i, (_, rest) in enumerate(parts, 1)]
        for i, ids in enumerate(asked, 1):  # every question fits after the context, known before its prefill
            self.check(len(ctx_ids), len(ids), f"question {i}")
        cache = self.model.new_cache(1, capacity=len(ctx_ids) + 64)
        t0 = time.perf_counter()
        prefill(self.model, torch.tensor([ctx_ids]), cache, self.policy,  # no total_len: the run goes on
                on_progress=None if progress is None else progress(len(ctx_ids)))
        compressed = GenerationResult([[]], len(ctx_ids), time.perf_counter() - t0, 0.0, 0, cache)
        print(f"context     {len(ctx_ids)} tokens, compressed to {sum(cache.lengths()) / len(cache):.0f} entries per "
              f"layer (mean) before any question", flush=True)
        turns = []
        for i, (question, ids) in enumerate(zip(questions, asked), 1):
            print(f"\nquestion {i}: {question}", flush=True)
            copy, policy = fork(cache, self.policy)
            turns.append(self.turn(f"question {i}", ids, copy, policy))
            print(line(turns[-1]), flush=True)
        return compressed, turns
