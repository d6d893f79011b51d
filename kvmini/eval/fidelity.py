"""Fidelity: how much of the full cache's behaviour does a compressed cache keep?

A prompt of N tokens of real text is prefilled (and compressed by the method), then the
next K tokens of the same text are teacher-forced on that cache. Against the full cache
on the same tokens we measure, over the K predictions:

    perplexity  exp(mean -log p(x_t | compressed cache))
    KL          mean_t KL(p_full(. | x_<t) || p_method(. | x_<t)), in nats
    top-1       fraction of t where argmax p_method == argmax p_full
    kept        cache entries per layer after the prompt (mean over layers), and its share of full

Decode-time methods (streaming_llm, h2o, tova, weightedkv, d2o) see the continuation one
token at a time, so they keep compressing as their decode loop does; for prefill-only methods
the continuation is one forward call, which equals K decode steps (nothing is compressed then).
A method may carry options, e.g. `d2o[allocation=uniform,nm=1:1]` (an ablation row).

    python -m kvmini.eval.fidelity                      # N=2048, K=256, budgets 0.2 and 128
    python -m kvmini.eval.fidelity --n 512 --k 64 --methods h2o snapkv --budgets 0.1
    python -m kvmini.eval.fidelity --methods d2o "d2o[allocation=uniform]" --budgets 0.2
"""
import json
import sys
import time
from pathlib import Path

from kvmini import cli

cli.exit_on_ctrl_c(__name__)  # before the imports below
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvmini.errors import KvminiError
from kvmini.generate import prefill
from kvmini.methods.registry import METHODS, as_run, chooses_budget, make_policy, parse_spec

LAZY_IMPORTS = ("kvmini.loading", "kvmini.tokenizer", "kvmini.weights")  # the tools' work imports these


def pydoc_text() -> str:
    """Python's own documentation (~110k tokens of English), present on every Python install."""
    import pydoc_data.topics

    return "\n".join(pydoc_data.topics.topics.values())


@torch.inference_mode()
def continuation_logits(model, ids: torch.Tensor, n: int, policy=None):
    """ids (1, N + K) -> (logits (K, V) predicting tokens N..N+K-1, the entries each layer keeps).

    The prompt ids[:, :n] fills (and the policy compresses) the cache, in chunks where the method asks
    for them (WeightedKV); the rest is teacher-forced. What a layer keeps is its length after the
    prompt for prefill-only methods, and after the continuation for those that compress while
    decoding (their steady size; D2O's official variant compresses only from the first step).
    """
    total = ids.shape[1]
    cache = model.new_cache(1, capacity=total)
    first = prefill(model, ids[:, :n], cache, policy, total_len=total - 1)  # (1, V); chunked if the method asks
    kept = cache.lengths()
    rest = ids[:, n : total - 1]  # (1, K - 1): the inputs whose outputs predict tokens N+1..N+K-1
    if policy is not None and policy.schedule != "prefill":  # decode-time methods compress at every step
        steps = [model(rest[:, t : t + 1], cache, policy)[:, -1] for t in range(rest.shape[1])]
        later = torch.cat(steps) if steps else first[:0]
        kept = cache.lengths()
    else:
        later = model(rest, cache, policy, all_logits=True)[0]  # (K - 1, V)
    return torch.cat([first, later]).float(), kept


def compare(logits: torch.Tensor, full: torch.Tensor, targets: torch.Tensor) -> dict:
    """Metrics of one method's (K, V) logits against the full cache's, for target tokens (K,)."""
    logp, logp_full = logits.log_softmax(-1), full.log_softmax(-1)
    nll = F.nll_loss(logp, targets)
    kl = (logp_full.exp() * (logp_full - logp)).sum(-1).mean()
    top1 = (logits.argmax(-1) == full.argmax(-1)).float().mean()
    return {"ppl": nll.exp().item(), "kl": kl.item(), "top1": top1.item()}


def run(model, ids: torch.Tensor, n: int, methods: list[str], budgets: list[float], log=print) -> list[dict]:
    """One row per (method spec, budget), the full cache first. ids (1, N + K)."""
    check_arguments(ids, n, methods, budgets)
    targets = ids[0, n:]  # (K,)
    t0 = time.perf_counter()
    full, kept_full = continuation_logits(model, ids, n)
    rows = [{"method": "full", "budget": None, **compare(full, full, targets), "kept": n, "kept_share": 1.0,
             "seconds": time.perf_counter() - t0}]
    specs = [(spec, *parse_spec(spec)) for spec in methods]
    total = 1 + sum(1 if chooses_budget(name) else len(budgets) for _, name, _ in specs)
    log(f"[1/{total}] full: ppl {rows[0]['ppl']:.3f} ({rows[0]['seconds']:.1f} s)")
    for method, name, options in specs:
        for budget in [None] if chooses_budget(name) else budgets:  # self-budgeted: one row
            t0 = time.perf_counter()
            policy = make_policy(name, budget, **options)
            logits, kept = continuation_logits(model, ids, n, policy)
            row = {"method": method, "budget": budget, **compare(logits, full, targets),
                   "kept": sum(kept) / len(kept), "kept_share": sum(kept) / (n * len(kept)), "kept_per_layer": kept,
                   "seconds": time.perf_counter() - t0}
            rows.append(row)
            shown = "self-chosen" if budget is None else f"{budget:g}"
            log(f"[{len(rows)}/{total}] {method} budget {shown}: ppl {row['ppl']:.3f}, "
                f"KL {row['kl']:.4f}, top-1 {row['top1']:.3f} ({row['seconds']:.1f} s)")
    return rows


def check_arguments(ids, n, methods, budgets) -> None:
    """What `run` needs, refused with the argument's name before any work."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise KvminiError(f"ids must be a tensor (1, N + K) of token ids with N, K >= 1, got "
                          f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < ids.shape[1]:
        raise KvminiError(f"n (the prompt's tokens) must be a whole number in [1, {ids.shape[1] - 1}], got {n!r}")
    if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
        raise KvminiError(f"methods must be a list of method specs such as ['h2o'], got {methods!r}")
    if isinstance(budgets, (str, int, float)):
        raise KvminiError(f"budgets must be a list of budgets such as [0.2, 128], got {budgets!r}")
    check_lists(n, methods, budgets)


def check_lists(n: int, methods: list[str], budgets: list[float]) -> None:
    """One row per method spec and budget: none named twice, no budget that keeps the whole prompt."""
    specs = [as_run(spec) for spec in methods]  # by value: `adakv` and `adakv[alpha=0.2]` are one row
    twice = next((i for i in range(len(specs)) if specs[i] in specs[:i]), None)
    if twice is not None:
        first = methods[specs.index(specs[twice])]
        raise KvminiError(f"the methods name one method twice ({first}, {methods[twice]}); "
                          "give each method spec once (each is one row)")
    if len(set(budgets)) < len(budgets):
        raise KvminiError(f"the budgets name one budget twice ({' '.join(f'{b:g}' for b in budgets)}); give each once")
    over = next((b for b in budgets if isinstance(b, (int, float)) and b > max(1, n)), None)
    if over is not None:  # (1 or less: a ratio; a kept share above 100% would be read as compression)
        raise KvminiError(f"budget {over:g} is more tokens than the {n}-token prompt, which it would keep whole; "
                          f"give a budget of at most {n} tokens or a ratio in (0, 1]")


def table(rows: list[dict], n: int, k: int) -> str:
    """A markdown table of the rows."""
    lines = [f"Fidelity on pydoc text: prompt N={n}, teacher-forced continuation K={k}", "",
             "| method | budget | kept/layer | kept share | perplexity | KL(full‖method) | top-1 agree |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        budget = "—" if r["method"] == "full" else "self-chosen" if r["budget"] is None else f"{r['budget']:g}"
        lines.append(f"| {r['method']} | {budget} | {r['kept']:.1f} | {r['kept_share']:.1%} | {r['ppl']:.3f} | "
                     f"{r['kl']:.4f} | {r['top1']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = cli.OneLineParser(description="Compare compressed caches with the full cache on real text.")
    p.add_argument("--n", type=cli.at_least(1), default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--k", type=cli.at_least(1), default=256,
                   help="continuation tokens teacher-forced and scored (default 256)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.2, 128], help="budgets (default: 0.2 128)")
    p.add_argument("--methods", nargs="+", default=[m for m in METHODS if m != "full"],
                   help="methods, optionally with options: name[key=value,...] (default: all)")
    p.add_argument("--offset", type=cli.at_least(0), default=0, help="first token of the text to use (default 0)")
    p.add_argument("--model", type=cli.path, help="HF-layout folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=cli.path, help="also write the rows to this JSON file (checked before the work)")
    return cli.run(lambda: compare_methods(p.parse_args(argv)), imports=LAZY_IMPORTS)


def compare_methods(args) -> int:
    from kvmini.loading import load_model
    from kvmini.tokenizer import load_tokenizer
    from kvmini.weights import ensure_default_model

    check_lists(args.n, args.methods, args.budgets)  # bad methods, options and budgets are refused before the work
    for spec in args.methods:
        name, options = parse_spec(spec)
        for budget in [None] if chooses_budget(name) else args.budgets:
            make_policy(name, budget, **options)
    json_file = cli.writable_file(args.json) if args.json else None
    folder = Path(args.model) if args.model else ensure_default_model(log=lambda m: print(m, file=sys.stderr))
    model = load_model(folder, args.device, "float32")
    ids = load_tokenizer(folder).encode(pydoc_text())[args.offset : args.offset + args.n + args.k]
    if len(ids) < args.n + args.k:
        raise KvminiError(f"the text has only {len(ids)} tokens after --offset {args.offset}")
    if args.n + args.k > model.config.max_position_embeddings:
        raise KvminiError(f"N + K = {args.n + args.k} exceeds the model's context")
    rows = run(model, torch.tensor([ids], device=model.device), args.n, args.methods, args.budgets,
               log=lambda m: print(m, file=sys.stderr))
    print(table(rows, args.n, args.k), flush=True)  # on the screen before the file is written
    if json_file:
        json_file.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
