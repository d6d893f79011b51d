"""kvmini command line: generate from a prompt file with an explicit (optionally compressed) KV cache.

Every failure ends in one line on stderr (`main`, through the boundary all entry points share,
`kvmini.cli.run`): exit code 2 for bad input and refusals from the operating system, 130 for
Ctrl-C. KVMINI_DEBUG=1 shows the traceback instead.
"""
import argparse
import sys
from pathlib import Path

from kvmini import cli

cli.exit_on_ctrl_c(__name__)  # before anything imports torch

EXAMPLES = """examples:
  python run.py --prompt prompt.txt                       # default model (prepared on first use)
  python run.py --prompt prompt.txt --max-new-tokens 64 --temperature 0.7 --top-p 0.9 --seed 1
  python run.py --prompt doc.txt --raw --chunk-size 512   # no chat template, chunked prefill
  python run.py --model path/to/hf-folder --prompt prompt.txt --device cuda --dtype bfloat16
  python run.py --prompt doc.txt --method snapkv --budget 128 --window 16 --pooling max
  python run.py --prompt doc.txt --method h2o --budget 0.1      # keep 10% of the prompt per layer
  python run.py --prompt doc.txt --method d2o --html kept.html  # a web page of what each layer and head kept

special tokens: strings such as <|im_end|> typed in the prompt are read as the control tokens they
name (as HF tokenizers do), so a prompt can end a chat turn itself; --raw skips the chat template.
"""
ASCII_BLOCKS = " .:-=+*#"  # the report's bars where the terminal cannot print block characters
IMPORTS = ("torch", "kvmini.methods.registry", "kvmini.generate", "kvmini.loading", "kvmini.weights", "kvmini.chat",
           "kvmini.tokenizer", "kvmini.report", "kvmini.progress")  # imported before the work (see kvmini.cli)


def positive_int(text):
    return cli.whole_number(text, low=1)


def non_negative_int(text):
    return cli.whole_number(text, low=0)


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
    from kvmini.methods import options

    def read(text):
        try:
            return options.read(kind, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"must {e}, got {text!r}") from None

    return read


def methods_help() -> str:
    """The --help section listing every method, what it does and its options with defaults (read
    from each method's declaration; an option its variants set differently shows each variant's)."""
    from kvmini.methods.options import show
    from kvmini.methods.registry import METHODS, declarations, summary

    def default(d):
        if not d.by_variant:
            return show(d.default, d.kind)
        return ", ".join(f"{v}: {show(x, d.kind)}" for v, x in d.by_variant.items())

    lines = ["methods (--method NAME; options as flags, defaults in brackets):"]
    for name in METHODS:
        opts = ", ".join(f"--{d.name.replace('_', '-')} [{default(d)}]" for d in declarations(name))
        lines.append(f"  {name:<14} {summary(name)}" + (f"\n  {'':<14} options: {opts}" if opts else ""))
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    from kvmini.methods.options import metavar
    from kvmini.methods.registry import DEFAULT_BUDGET, METHODS, compress_every_call, every_option

    p = cli.OneLineParser(
        description="Generate text with kvmini and report speed and KV-cache size.",
        epilog=methods_help() + "\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompt", required=True, help="UTF-8 text file with the prompt (special-token strings count)")
    p.add_argument("--model", help="HF-layout checkpoint folder (default: SmolLM2-135M-Instruct, prepared under weights/)")
    p.add_argument("--method", default="full", choices=list(METHODS), metavar="NAME",
                   help="KV-cache method, listed below (default: full)")
    p.add_argument("--budget", type=cli.budget, default=None,
                   help=f"tokens kept per layer: a whole number (128, +128) counts tokens, a fraction up to 1.0 (0.2) "
                        f"is a ratio of the prompt (default for compressing methods: {DEFAULT_BUDGET})")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate (default: 128)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="sample from the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=seed, default=None, help="random seed for sampling (0 to 2**64-1)")
    p.add_argument("--chunk-size", type=positive_int, default=None,
                   help="prefill the prompt in chunks of this many tokens (methods that compress once the prompt is "
                        f"complete keep what one call keeps; {', '.join(compress_every_call())} compress after every "
                        "chunk by design, so the size changes what they keep)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--html", metavar="FILE", help="also write a web page of what each layer and KV head kept, "
                                                  "token by token (one self-contained file)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr (it shows only on a terminal, for long work)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)")
    group = p.add_argument_group("method options (which method takes which: see the list below)")
    flags = every_option()
    for name, (d, methods) in flags.items():
        group.add_argument("--" + name.replace("_", "-"), type=method_option(d.kind), default=None,
                           metavar=metavar(d.kind), help=f"{d.help} ({', '.join(methods)})")
    args = p.parse_args(argv)
    args.options = {name: getattr(args, name) for name in flags if getattr(args, name) is not None}
    return args


def read_prompt(path: str) -> str:
    from kvmini.errors import KvminiError

    file = Path(path)
    if not file.exists():
        raise KvminiError(f"prompt file not found: {path}")
    if file.is_dir():
        raise KvminiError(f"prompt {path} is a directory, not a text file")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvminiError(f"prompt file {path} is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise KvminiError(f"prompt file {path} is empty")
    return text


def generate_answer(args) -> int:
    import torch

    from kvmini.chat import load_chat_format, stop_token_ids
    from kvmini.errors import KvminiError
    from kvmini.generate import Sampling, generate
    from kvmini.loading import load_model
    from kvmini.methods.registry import make_policy
    from kvmini.progress import Progress
    from kvmini.report import BLOCKS, cache_report
    from kvmini.tokenizer import StreamDecoder, load_tokenizer
    from kvmini.view import record_merges, write_html
    from kvmini.weights import ensure_default_model

    policy = make_policy(args.method, args.budget, **args.options)
    text = read_prompt(args.prompt)
    if args.html is not None:
        cli.writable_file(args.html, "--html")
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    folder = Path(args.model) if args.model else ensure_default_model(log=log)
    model = load_model(folder, args.device, args.dtype)
    tok = load_tokenizer(folder)
    vocab = model.config.vocab_size
    if tok.vocab_size > vocab:
        raise KvminiError(f"the tokenizer has {tok.vocab_size} ids but the model only {vocab} embeddings: "
                          "tokenizer and model do not match")
    chat = None if args.raw else load_chat_format(folder)
    if chat is not None:
        text = chat.render([{"role": "user", "content": text}])
    ids = tok.encode(text)
    if not ids:
        raise KvminiError(f"the prompt encodes to zero tokens: none of its characters is in the tokenizer's "
                          f"vocabulary ({args.prompt})")
    context = model.config.max_position_embeddings
    if len(ids) + args.max_new_tokens > context:
        raise KvminiError(
            f"prompt has {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} "
            f"that exceeds the model's context of {context} tokens"
        )
    stop = stop_token_ids(model.config.eos_token_ids, tok, chat)
    stream = StreamDecoder(tok)
    write = lambda i: (sys.stdout.write(stream.push(i)), sys.stdout.flush())  # noqa: E731
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed, vocab=min(tok.vocab_size, vocab))
    progress = Progress("prefill", len(ids), enabled=False if args.quiet else None)  # on a terminal only
    trace = record_merges(policy) if args.html is not None else None
    result = generate(model, torch.tensor([ids]), args.max_new_tokens, sampling, stop, policy,
                      chunk_size=args.chunk_size, on_token=write, progress=progress)
    print(stream.flush())
    c = model.config
    print("\n--- kvmini report ---")
    print(f"model     {folder.name} ({c.model_type}, {c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} q/kv heads)"
          f" on {model.device.type} {str(model.dtype).removeprefix('torch.')}")
    if tok.vocab_size < vocab:
        print(f"vocab     the model has {vocab} output ids, the tokenizer {tok.vocab_size}: "
              f"the {vocab - tok.vocab_size} ids without text are never sampled")
    print(f"method    {describe(args, policy)}")
    if policy is not None and policy.note:
        print(f"note      {policy.note}")
    print(f"prompt    {result.prompt_tokens} tokens ({type(chat).__name__ if chat else 'raw'} format)")
    print(f"prefill   {result.prefill_s:.3f} s, {result.prompt_tokens / result.prefill_s:.1f} tokens/s")
    rate = result.decode_steps / result.decode_s if result.decode_steps else float("nan")
    print(f"decode    {result.new_tokens} new tokens, {rate:.1f} tokens/s")
    blocks = BLOCKS if can_print(BLOCKS) else ASCII_BLOCKS
    print("\n".join(cache_report(result.cache, policy, blocks)))
    if args.html is not None:
        page = write_html(args.html, result.cache, tok, ids, result.tokens[0], policy, trace, args.method)
        print(f"page      {page} ({page.stat().st_size / 2**20:.2f} MiB): what each layer and KV head kept")
    sys.stdout.flush()
    return 0


def describe(args, policy) -> str:
    """`h2o, budget 0.2 = 123 tokens per layer (window budget // 2, reduce mean)`."""
    from kvmini.methods.options import show
    from kvmini.methods.registry import declarations, resolved_options

    if policy is None:
        return args.method
    options, kinds = resolved_options(args.method, args.options), {d.name: d.kind for d in declarations(args.method)}
    shown = f" ({', '.join(f'{k} {show(v, kinds[k])}' for k, v in options.items())})" if options else ""
    budgets = policy.budgets
    per_layer = f"{budgets[0]}" if len(set(budgets)) == 1 else f"{min(budgets)}-{max(budgets)} (mean {sum(budgets) / len(budgets):.1f})"
    if policy.budget is None:
        share = sum(budgets) / (len(budgets) * policy.prompt_len)
        return f"{args.method}, self-chosen budget {per_layer} tokens per layer = {share:.1%} of the prompt{shown}"
    every = policy.evict_every
    amortised = (f"; evicting {every} entries every {every} decode steps, so a layer holds up to {every - 1} "
                 "more than its budget between evictions") if every > 1 else ""
    return f"{args.method}, budget {policy.budget:g} = {per_layer} tokens per layer{budget_note(policy)}{amortised}{shown}"


def budget_note(policy) -> str:
    """Why the cache holds more than the budget asks (D2O's official protected layers, DynamicKV's
    last L % m layers), when it does."""
    if policy.unchanged is not None:  # a prompt too short to compress: the note says so
        return ""
    budgeter = policy.parts[1]
    asked, budgets, why = getattr(budgeter, "b", None), policy.budgets, budgeter.holds_more_because()
    mean = sum(budgets) / len(budgets)
    if not why or asked is None or mean <= asked:
        return ""
    return f"; the cache holds a mean of {mean:.1f} tokens per layer, not {asked}: {why}"


def can_print(text: str) -> bool:
    try:
        text.encode(sys.stdout.encoding or "ascii")
        return True
    except (UnicodeEncodeError, LookupError):
        return False


def main(argv=None) -> int:
    """The entry point; `kvmini.cli.run` is the error boundary (one line on stderr, exit code 2 or 130)."""
    return cli.run(lambda: generate_answer(parse_args(argv)), imports=IMPORTS)


if __name__ == "__main__":
    sys.exit(main())
