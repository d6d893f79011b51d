"""kvmini command line: generate from a prompt file with an explicit (optionally compressed) KV cache.

Every failure ends in one line on stderr (`main`, through the boundary all entry points share,
`kvmini.cli.run`): exit code 2 for bad input and refusals from the operating system, 130 for
Ctrl-C. KVMINI_DEBUG=1 shows the traceback instead.
"""
import sys

try:  # Ctrl-C before kvmini.cli's handler is in place is one line and 130 too, never a traceback
    import argparse
    from pathlib import Path

    from kvmini import cli
except KeyboardInterrupt:
    if __name__ != "__main__":  # imported (a test, a notebook): the importer's Ctrl-C
        raise
    sys.stderr.write("\ninterrupted (Ctrl-C)\n")  # kvmini.cli.INTERRUPTED, which may not be imported yet
    raise SystemExit(130) from None
cli.exit_on_ctrl_c(__name__)  # before anything imports torch
import torch  # noqa: E402

from kvmini.chat import load_chat_format, stop_token_ids  # noqa: E402
from kvmini.compare import comparison  # noqa: E402
from kvmini.conversation import Session, line  # noqa: E402
from kvmini.errors import KvminiError  # noqa: E402
import kvmini.generate  # noqa: E402  (called as kvmini.generate.generate: a test replaces it)
from kvmini.loading import load_model  # noqa: E402
from kvmini.methods import options  # noqa: E402
from kvmini.methods.registry import (DEFAULT_BUDGET, METHODS, compress_every_call, declarations,  # noqa: E402
                                     every_option, make_policy, summary)
from kvmini.progress import Progress  # noqa: E402
from kvmini.report import run_report  # noqa: E402
from kvmini.threads import fit_threads  # noqa: E402
from kvmini.tokenizer import StreamDecoder, load_tokenizer  # noqa: E402
from kvmini.view import record_merges, write_comparison, write_turns  # noqa: E402
from kvmini.weights import DEFAULT_MODEL_DIR, ensure_default_model  # noqa: E402

EXAMPLES = """examples:
  python run.py --prompt prompt.txt                       # default model (prepared on first use)
  python run.py --prompt prompt.txt --max-new-tokens 64 --temperature 0.7 --top-p 0.9 --seed 1
  python run.py --prompt doc.txt --raw --chunk-size 512   # no chat template, chunked prefill
  python run.py --model path/to/hf-folder --prompt prompt.txt --device cuda --dtype bfloat16
  python run.py --prompt doc.txt --method snapkv --budget 128 --window 16 --pooling max
  python run.py --prompt doc.txt --method h2o --budget 0.1      # keep 10% of the prompt per layer
  python run.py --prompt doc.txt --method d2o --html kept.html  # a web page of what each layer and head kept
  python run.py --prompt doc.txt --method d2o --compare         # the full cache's answer beside d2o's, and what changed
  python run.py --chat --method snapkv < turns.txt              # a conversation: one turn per line, one cache
  python run.py --context doc.txt --question "Who?" --question "When?" --method snapkv
                                          # the context compressed once, each question answered from a copy

special tokens: strings such as <|im_end|> typed in the prompt are read as the control tokens they
name (as HF tokenizers do), so a prompt can end a chat turn itself; --raw skips the chat template.
"""
def seed(text):
    return cli.whole_number(text, low=0, high=2**64 - 1)  # what torch.Generator.manual_seed accepts


def non_negative_float(text):
    value = cli.real_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text):
    value = cli.real_number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def method_option(kind):
    """An argparse type for a method option of this declared type (kvmini.methods.options.read):
    the flag's text becomes a typed value; the method's own checks follow in make_policy."""
    def read(text):
        try:
            return options.read(kind, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"must {e}, got {text!r}") from None

    return read


def methods_help() -> str:
    """The --help section listing every method, what it does and its options with defaults (read
    from each method's declaration; an option its variants set differently shows each variant's)."""
    def default(d):
        if not d.by_variant:
            return options.show(d.default, d.kind)
        return ", ".join(f"{v}: {options.show(x, d.kind)}" for v, x in d.by_variant.items())

    lines = ["methods (--method NAME; options as flags, defaults in brackets):"]
    for name in METHODS:
        opts = ", ".join(f"--{d.name.replace('_', '-')} [{default(d)}]" for d in declarations(name))
        lines.append(f"  {name:<14} {summary(name)}" + (f"\n  {'':<14} options: {opts}" if opts else ""))
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = cli.OneLineParser(
        description="Generate text with kvmini and report speed and KV-cache size.",
        epilog=methods_help() + "\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompt", type=cli.path, help="UTF-8 text file with the prompt (special-token strings count)")
    p.add_argument("--chat", action="store_true",
                   help="a conversation: turns from stdin, one per line (typed on a terminal: end with Ctrl-D), one "
                        "answer each, every turn continuing the same compressed cache")
    p.add_argument("--context", type=cli.path, metavar="FILE", help="UTF-8 text file compressed once, before any --question is known")
    p.add_argument("--question", action="append", metavar="TEXT",
                   help="a question about --context (repeat it), each answered from its own copy of the compressed cache")
    p.add_argument("--model", type=cli.path, help="HF-layout checkpoint folder (default: SmolLM2-135M-Instruct, prepared under weights/)")
    p.add_argument("--method", default="full", choices=list(METHODS), metavar="NAME",
                   help="KV-cache method, listed below (default: full)")
    p.add_argument("--budget", type=cli.budget, default=None,
                   help=f"tokens kept per layer: a whole number (128, +128) counts tokens, a fraction up to 1.0 (0.2) "
                        f"is a ratio of the prompt (default for compressing methods: {DEFAULT_BUDGET})")
    p.add_argument("--max-new-tokens", type=cli.at_least(1), default=128, help="tokens to generate (default: 128)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=cli.at_least(0), default=0, help="sample from the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=seed, default=None, help="random seed for sampling (0 to 2**64-1)")
    p.add_argument("--chunk-size", type=cli.at_least(1), default=None,
                   help="prefill the prompt in chunks of this many tokens (methods that compress once the prompt is "
                        f"complete keep what one call keeps; {', '.join(compress_every_call())} compress after every "
                        "chunk by design, so the size changes what they keep)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--compare", action="store_true",
                   help="also answer with the full cache, and show where the two answers part, the method's KL and "
                        "top-1 agreement with the full cache's answer fed in, and the K/V bytes it kept (--prompt, "
                        "or each --question)")
    p.add_argument("--html", type=cli.path, metavar="FILE", help="also write a web page of what each layer and KV head kept, "
                                                  "token by token (one self-contained file)")
    p.add_argument("--layer-by-layer", action="store_true", help=argparse.SUPPRESS)  # gone: refused with why
    p.add_argument("--per-query-head", action="store_true",
                   help="the cache holds one entry set per query head, as the authors' codes hold it after repeat_kv "
                        "(H/H_kv times the memory), so every method selects per query head; default: per KV head")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr (it shows only on a terminal, for long work)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)")
    group = p.add_argument_group("method options (which method takes which: see the list below)")
    flags = every_option()
    for name, (d, methods) in flags.items():
        group.add_argument("--" + name.replace("_", "-"), type=method_option(d.kind), default=None,
                           metavar=options.metavar(d.kind), help=f"{d.help} ({', '.join(methods)})")
    args = p.parse_args(argv)
    mode_errors(p, args)
    args.options = {name: getattr(args, name) for name in flags if getattr(args, name) is not None}
    return args


def mode_errors(p, args) -> None:
    """One of three ways to give prompts: --prompt FILE, --chat, or --context FILE with --question TEXT."""
    if args.chat and (args.prompt or args.context):
        p.error("--chat reads its turns from stdin; it takes no --prompt or --context")
    if args.context and args.prompt:
        p.error("--prompt and --context are two ways to give the prompt; use one (--context with --question)")
    if args.context and not args.question:
        p.error("--context needs at least one --question TEXT")
    if args.question and not args.context:
        p.error("--question asks about a --context FILE; give one")
    if not (args.prompt or args.chat or args.context):
        p.error("give the prompt: --prompt FILE, --chat (turns on stdin) or --context FILE --question TEXT")
    if args.compare and args.chat:
        p.error("--compare takes --prompt or --context/--question: a --chat turn continues the method's own answers, "
                "so the full cache's turn would answer a different conversation")
    if args.compare and args.method == "full":
        p.error("--compare puts a method beside the full cache; give a --method other than full")
    if args.compare and args.temperature > 0 and args.seed is None:
        p.error("--compare with --temperature above 0 needs --seed N, so that both runs draw the same random numbers")
    if args.temperature == 0:  # greedy decoding draws nothing: a sampling option would be silently ignored
        for flag, off in (("top_k", 0), ("top_p", 1.0), ("seed", None)):
            if getattr(args, flag) != off:
                p.error(f"--{flag.replace('_', '-')} sets sampling, and --temperature 0 (the default) decodes "
                        "greedily; give --temperature above 0 to sample")
    for q in args.question or ():
        if not q.strip():
            p.error("--question must not be empty")
        if any("\udc80" <= c <= "\udcff" for c in q):  # bytes that are not UTF-8 arrive as lone surrogates
            p.error("--question is not UTF-8 text")


def generate_answer(args, set_threads: bool = False) -> int:
    """Check the input, load the model, generate (streaming the answer), report, write the page.
    set_threads: fit torch's threads to the cores free now (kvmini.threads; the command line does)."""
    policy = method_policy(args)  # bad options fail before the model loads
    text = cli.read_prompt(args.context or args.prompt) if not args.chat else None
    if args.html is not None:
        cli.writable_file(cli.not_an_input(args.html, "--html", args.prompt, args.context,
                                           args.model or DEFAULT_MODEL_DIR), "--html")
    args.threads = None
    if set_threads:
        n, why = fit_threads(torch.get_num_threads())
        torch.set_num_threads(n)
        args.threads = f"{n} thread{'s' * (n != 1)}: {why}"
    if args.chat or args.context:
        return several_prompts(args, policy, text)
    folder, model, tok, chat = load(args)
    ids = prompt_ids(args, text, model, tok, chat)
    trace = record_merges(policy) if args.html is not None else None
    result = answer(args, model, tok, chat, ids, policy)
    print("\n".join(run_report(folder.name, model, tok, chat, args.method, args.options, policy, result,
                                sys.stdout.encoding, args.threads)))
    runs, parts = [(result.cache, policy, trace, args.method, result.tokens[0])], None
    if args.compare:
        full, found = beside_full(args, model, tok, chat, ids, result, "the full cache, on the same prompt")
        runs, parts = [(full.cache, None, None, "full", full.tokens[0])] + runs, [found.parts] * 2
    if args.html is not None:
        page = write_comparison(args.html, runs, tok, ids, parts=parts)
        print(f"page      {page} ({page.stat().st_size / 2**20:.2f} MiB): what each layer and KV head kept")
    sys.stdout.flush()
    return 0


def method_policy(args):
    """A fresh policy of the method and its options (None: the full cache)."""
    if args.layer_by_layer:
        raise KvminiError("--layer-by-layer is gone: every decode step now runs the method's own code, one layer "
                          "at a time, the code a reader reads (docs/design.md, \"The method form\")")
    return make_policy(args.method, args.budget, **args.options)


def load(args):
    """-> (the checkpoint folder, the model, its tokenizer, its chat format or None for --raw)."""
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    folder = Path(args.model) if args.model else ensure_default_model(log=log)
    model = load_model(folder, args.device, args.dtype, per_query_head=args.per_query_head)
    tok = load_tokenizer(folder)
    if tok.vocab_size > model.config.vocab_size:
        raise KvminiError(f"the tokenizer has {tok.vocab_size} ids but the model only {model.config.vocab_size} "
                          "embeddings: tokenizer and model do not match")
    return folder, model, tok, None if args.raw else load_chat_format(folder)


def prompt_ids(args, text: str, model, tok, chat) -> list[int]:
    """The prompt's token ids (in the chat template unless --raw), checked against the model's context."""
    if chat is not None:
        text = chat.render([{"role": "user", "content": text}])
    return cli.prompt_fits(tok.encode(text), args.max_new_tokens, model.config.max_position_embeddings, args.prompt)


def answer(args, model, tok, chat, ids: list[int], policy, cache=None):
    """Generate, printing the answer as it comes; -> kvmini.generate's result. With `cache` (--chat,
    --question), ids are the next prompt of that run, and a next one may follow."""
    stop = stop_token_ids(model.config.eos_token_ids, tok, chat)
    stream = StreamDecoder(tok)
    write = lambda i: (sys.stdout.write(stream.push(i)), sys.stdout.flush())  # noqa: E731
    sampling = kvmini.generate.Sampling(args.temperature, args.top_k, args.top_p, args.seed,
                        vocab=min(tok.vocab_size, model.config.vocab_size))
    progress = Progress("prefill", len(ids), enabled=False if args.quiet else None)  # on a terminal only
    result = kvmini.generate.generate(model, torch.tensor([ids]), args.max_new_tokens, sampling, stop, policy,
                                      chunk_size=args.chunk_size, on_token=write, on_progress=progress.update,
                                      cache=cache, more_prompts=bool(args.chat))
    print(stream.flush())
    return result


def beside_full(args, model, tok, chat, ids: list[int], result, title: str, context=None):
    """--compare: answer `ids` with the full cache (after context[0], a --question's context), then print what
    the method changed (kvmini.compare); -> (the full cache's result, the Comparison)."""
    print(f"\n--- {title} ---")
    before = [] if context is None else context[0]
    full = answer(args, model, tok, chat, before + ids, None)
    fresh = method_policy(args) if context is None else None  # a question's pass forks the context's policy
    found = comparison(args.method, model, ids, full.tokens[0], result, fresh, context, args.chunk_size)
    print("\n".join(found.lines(tok.decode)))
    return full, found


def several_prompts(args, policy, context: str | None) -> int:
    """--chat or --context/--question: prompts over one cache (kvmini.conversation), a line after each
    answer, the report at the end."""
    if args.chat and sys.stdin is None:  # started with stdin closed (`<&-`): before the model loads
        raise KvminiError("--chat reads its turns from stdin, which is closed")
    folder, model, tok, chat = load(args)
    session = Session(model, tok, chat, policy, lambda ids, cache, p: answer(args, model, tok, chat, ids, p, cache),
                      args.max_new_tokens, keep_snapshots=args.html is not None)
    trace = record_merges(policy) if args.html is not None else None
    if args.chat:
        if sys.stdin.isatty():
            print("type a turn per line; Ctrl-D ends the conversation", file=sys.stderr)
        turns = session.chat_turns(stdin_lines())
        last = turns[-1].result
    else:
        progress = lambda n: Progress("context", n, enabled=False if args.quiet else None).update  # noqa: E731
        last, turns = session.questions(context, args.question, progress)
    lines = run_report(folder.name, model, tok, chat, args.method, args.options, policy, last, sys.stdout.encoding,
                       args.threads)
    lines[3:3] = [f"{'' if i else 'prompts':<9} {line(t)}" for i, t in enumerate(turns)]
    print("\n".join(lines))
    parts = None
    if args.compare:  # (--context: --chat is refused)
        parts = []
        for t in turns:
            parts.append(beside_full(args, model, tok, chat, t.ids, t.result, f"{t.label}, the full cache (the "
                                     "context uncompressed)", (session.context_ids, last.cache, policy))[1].parts)
    if args.html is not None:
        page = write_turns(args.html, turns, tok, trace, args.method,
                           (session.context_ids, last.cache, policy) if args.context else None, parts)
        print(f"page      {page} ({page.stat().st_size / 2**20:.2f} MiB): what each layer and KV head kept, "
              f"after each {'question' if args.context else 'turn'}")
    sys.stdout.flush()
    return 0


def stdin_lines():
    """The lines of stdin as UTF-8 text, as they come (a terminal's turn by turn)."""
    stream = getattr(sys.stdin, "buffer", None)
    for number, raw in enumerate(stream if stream is not None else sys.stdin, 1):
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            yield text.removeprefix("\ufeff") if number == 1 else text  # a byte order mark, as --prompt drops it
        except UnicodeDecodeError as e:
            raise KvminiError(f"--chat: line {number} of stdin is not UTF-8 text (byte {e.start})") from None


def main(argv=None, set_threads: bool = False) -> int:
    """The entry point; `kvmini.cli.run` is the error boundary (one line on stderr, exit code 2 or 130).
    set_threads: the command line's (a caller in Python keeps its own thread count)."""
    return cli.run(lambda: generate_answer(parse_args(argv), set_threads))


if __name__ == "__main__":
    sys.exit(main(set_threads=True))
