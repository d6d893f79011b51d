"""kvmini command line: generate from a prompt file with an explicit (optionally compressed) KV cache."""
import argparse
import sys
from pathlib import Path

EXAMPLES = """examples:
  python run.py --prompt prompt.txt                       # default model (prepared on first use)
  python run.py --prompt prompt.txt --max-new-tokens 64 --temperature 0.7 --top-p 0.9 --seed 1
  python run.py --prompt doc.txt --raw --chunk-size 512   # no chat template, chunked prefill
  python run.py --model path/to/hf-folder --prompt prompt.txt --device cuda --dtype bfloat16
  python run.py --prompt doc.txt --method snapkv --budget 128 --window 16 --pooling max
  python run.py --prompt doc.txt --method h2o --budget 0.1      # keep 10% of the prompt per layer
"""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit code 2)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text):
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text):
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def methods_help() -> str:
    """The --help section listing every method, what it does and its options with defaults."""
    from kvmini.methods.registry import METHODS, method_options, summary

    lines = ["methods (--method NAME; options as flags, defaults in brackets):"]
    for name in METHODS:
        opts = ", ".join(f"--{k.replace('_', '-')} [{v}]" for k, v in method_options(name).items())
        lines.append(f"  {name:<14} {summary(name)}" + (f"\n  {'':<14} options: {opts}" if opts else ""))
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    from kvmini.methods.registry import DEFAULT_BUDGET, METHODS, OPTIONS

    p = OneLineParser(
        description="Generate text with kvmini and report speed and KV-cache size.",
        epilog=methods_help() + "\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompt", required=True, help="UTF-8 text file with the prompt")
    p.add_argument("--model", help="HF-layout checkpoint folder (default: SmolLM2-135M-Instruct, prepared under weights/)")
    p.add_argument("--method", default="full", choices=list(METHODS), metavar="NAME",
                   help="KV-cache method, listed below (default: full)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"tokens kept per layer: a ratio of the prompt if <= 1, a token count if > 1 "
                        f"(default for compressing methods: {DEFAULT_BUDGET})")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate (default: 128)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--chunk-size", type=positive_int, default=None, help="prefill the prompt in chunks of this many tokens")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)")
    group = p.add_argument_group("method options (which method takes which: see the list below)")
    for name, opt in OPTIONS.items():
        group.add_argument("--" + name.replace("_", "-"), type=opt.type, default=None, help=opt.help)
    args = p.parse_args(argv)
    args.options = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    if args.top_k < 0:
        p.error(f"argument --top-k: must be >= 0, got {args.top_k}")
    return args


def read_prompt(path: str) -> str:
    from kvmini.errors import KvminiError

    file = Path(path)
    if not file.is_file():
        raise KvminiError(f"prompt file not found: {path}")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvminiError(f"prompt file {path} is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise KvminiError(f"prompt file {path} is empty")
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kvmini.chat import load_chat_format, stop_token_ids
    from kvmini.errors import KvminiError
    from kvmini.generate import Sampling, generate
    from kvmini.loading import load_model
    from kvmini.methods.registry import make_policy
    from kvmini.report import cache_report
    from kvmini.tokenizer import StreamDecoder, load_tokenizer
    from kvmini.weights import ensure_default_model

    try:
        policy = make_policy(args.method, args.budget, **args.options)
        text = read_prompt(args.prompt)
        folder = Path(args.model) if args.model else ensure_default_model(log=lambda m: print(m, file=sys.stderr))
        model = load_model(folder, args.device, args.dtype)
        tok = load_tokenizer(folder)
        chat = None if args.raw else load_chat_format(folder)
        if chat is not None:
            text = chat.render([{"role": "user", "content": text}])
        ids = tok.encode(text)
        if max(ids) >= model.config.vocab_size:
            raise KvminiError(
                f"the tokenizer produced id {max(ids)} but the model has only {model.config.vocab_size} "
                "embeddings: tokenizer and model do not match"
            )
        context = model.config.max_position_embeddings
        if len(ids) + args.max_new_tokens > context:
            raise KvminiError(
                f"prompt has {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} "
                f"that exceeds the model's context of {context} tokens"
            )
        stop = stop_token_ids(model.config.eos_token_ids, tok, chat)
        stream = StreamDecoder(tok)
        write = lambda i: (sys.stdout.write(stream.push(i)), sys.stdout.flush())  # noqa: E731
        result = generate(
            model, torch.tensor([ids]), args.max_new_tokens,
            Sampling(args.temperature, args.top_k, args.top_p, args.seed),
            stop, policy, chunk_size=args.chunk_size, on_token=write,
        )
        print(stream.flush())
    except KvminiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    c = model.config
    print("\n--- kvmini report ---")
    print(f"model     {folder.name} ({c.model_type}, {c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} q/kv heads)"
          f" on {model.device.type} {str(model.dtype).removeprefix('torch.')}")
    print(f"method    {describe(args, policy)}")
    print(f"prompt    {result.prompt_tokens} tokens ({type(chat).__name__ if chat else 'raw'} format)")
    print(f"prefill   {result.prefill_s:.3f} s, {result.prompt_tokens / result.prefill_s:.1f} tokens/s")
    rate = result.decode_steps / result.decode_s if result.decode_steps else float("nan")
    print(f"decode    {result.new_tokens} new tokens, {rate:.1f} tokens/s")
    print("\n".join(cache_report(result.cache, policy)))
    return 0


def describe(args, policy) -> str:
    """`h2o, budget 0.2 = 123 tokens per layer (window budget // 2, reduce mean)`."""
    from kvmini.methods.registry import method_options

    if policy is None:
        return args.method
    options = {**method_options(args.method), **args.options}
    shown = ", ".join(f"{k} {v}" for k, v in options.items())
    budgets = policy.budgets
    per_layer = f"{budgets[0]}" if len(set(budgets)) == 1 else f"{min(budgets)}-{max(budgets)} (mean {sum(budgets) / len(budgets):.1f})"
    if policy.budget is None:
        share = sum(budgets) / (len(budgets) * policy.prompt_len)
        return f"{args.method}, self-chosen budget {per_layer} tokens per layer = {share:.1%} of the prompt ({shown})"
    return f"{args.method}, budget {policy.budget:g} = {per_layer} tokens per layer ({shown})"


if __name__ == "__main__":
    sys.exit(main())
