"""The authors' code run beside kvmini: the same model, windows and budget; their kept sets and logits against kvmini's.

    pip install --target DEPS --no-deps transformers==4.44.2 tokenizers==0.19.1 huggingface_hub==0.24.6
    python -m kvmini.eval.authors dynamickv --code CHECKOUT --deps DEPS    # -> results/authors/dynamickv.json

CHECKOUT is your clone of the authors' repository (nothing of it enters kvmini), DEPS the transformers their
code needs (the adapter's PACKAGES), put first on sys.path before transformers is imported; kvmini itself
never imports transformers. An adapter (kvmini/eval/authors_<method>.py) names every change it makes to
their code at run time (ADAPTATIONS) and runs it in two modes, each beside the kvmini run that selects
the same way: per query head (as most authors' codes do, their cache holding every query head after
`repeat_kv`) beside kvmini loaded `per_query_head`, and per KV head (`kv_head`: their scores averaged
over a KV head's query heads, or their code as released where it does that, RELEASED) beside kvmini's
default. Each pair should agree; between the two pairs is the measured effect of kvmini's default.

Per window and mode: each layer's kept length (mean over heads), the overlap
of the kept sets (Jaccard of kvmini's set for a query head's KV head with that query head's set), the
number of identical (layer, query head) sets, KL(full ‖ kvmini), KL(full ‖ authors), KL(authors ‖ kvmini).
"""
import importlib
import json
import subprocess
import sys
from pathlib import Path

from kvmini import cli

cli.exit_on_ctrl_c(__name__)  # before the imports below
from kvmini.errors import KvminiError  # noqa: E402

N, K, BUDGET, WINDOWS = 1024, 32, 0.2, 12  # the `why` experiment's windows (kvmini.eval.why.windows)
ADAPTERS = {"d2o": "kvmini.eval.authors_d2o", "dynamickv": "kvmini.eval.authors_dynamickv",
            "dbudgetkv": "kvmini.eval.authors_dbudgetkv", "roco": "kvmini.eval.authors_roco",
            "cam": "kvmini.eval.authors_cam"}
# methods whose authors' code cannot run beside kvmini: (repository, commit, why, citing their file:line)
CANNOT_RUN = {
    "scissorhands": ("lzcemma/Scissorhands", "d0bf444b7f78127b2052fe8edfd4d386efd33455", [
        "Only OPT carries the method: Decentralized_FM_alpha/modules/hf_opt_dropkv.py (its OPTAttention, :176); "
        "no Llama module of the repository does.",
        "It holds no bounded cache: inside one teacher-forced pass over a text it masks each query row's attention "
        "to the earlier tokens it drops (:319-350), and only in a call of more than one token (:303, "
        "`tgt_len != 1`): a decode step runs with every entry.",
        "What it drops has no budget: a token stays if it passed each row's 90% quantile, taken over the row of "
        "the whole text (:314-316), which a generation does not know in advance, so each head keeps a count of "
        "its own (:321-336). kvmini's scissorhands is its paper's Alg. 1 and 2 (docs/methods.md).",
    ]),
}
OUT = Path(__file__).resolve().parents[2] / "results" / "authors"
# the committed cross-checks: each method at its adapter's budget; D2O also at 25%, where kvmini's budget in
# tokens over n is the ratio itself (at 20%, 205 / 1,024: docs/methods.md, "D2O")
RESULTS = {**{m: (m, None) for m in ADAPTERS}, "d2o-0.25": ("d2o", 0.25)}


def command(stem: str) -> str:
    """The command that makes results/authors/<stem>.json."""
    method, budget = RESULTS[stem]
    return f"python -m kvmini.eval.authors {method} --code CHECKOUT --deps DEPS" + (f" --budget {budget:g}" if budget else "")


def use_deps(deps: Path) -> None:
    """Put the authors' transformers first on sys.path; refused once another transformers is imported."""
    if "transformers" in sys.modules and not sys.modules["transformers"].__file__.startswith(str(deps)):
        raise KvminiError(f"transformers was imported before --deps {deps} was put first on sys.path")
    sys.path.insert(0, str(deps))


def full_keys(full, prompt) -> list:
    """Each layer's keys after RoPE, (1, H_kv, n, D), from a full-cache pass of an HF model."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    full(prompt, past_key_values=cache, use_cache=True)
    return [k.clone() for k in cache.key_cache]


def match(cached, keys, groups: int) -> list[list[int]]:
    """The prompt positions an authors' cache holds: cached (1, H_q, S, D) keys, found by exact match in the
    layer's full keys (1, H_kv, n, D), a position held twice listed twice; a key that matches none (a merged
    one) is refused by name."""
    out = []
    for h in range(cached.shape[1]):
        where = {row.numpy().tobytes(): j for j, row in enumerate(keys[0, h // groups])}
        found = [where.get(row.numpy().tobytes()) for row in cached[0, h]]
        if None in found:
            raise ValueError(f"query head {h}: {found.count(None)} held keys match no prompt key exactly")
        out.append(sorted(found))
    return out


def kvmini_run(model, ids, n: int, policy, chunk_size: int | None = None):
    """kvmini.eval.fidelity.continuation_logits (the same steps; the prompt in chunks of `chunk_size` if given),
    also returning each layer's held positions per KV head after the continuation: (logits (K, V), [layer][KV
    head] sorted positions)."""
    import torch

    from kvmini.generate import prefill

    total = ids.shape[1]
    cache = model.new_cache(1, capacity=total)
    with torch.inference_mode():
        first = prefill(model, ids[:, :n], cache, policy, chunk_size, total_len=total - 1)
        rest = ids[:, n : total - 1]
        if policy.schedule != "prefill":
            later = [model(rest[:, t : t + 1], cache, policy)[:, -1] for t in range(rest.shape[1])]
            later = torch.cat(later) if later else first[:0]
        else:
            later = model(rest, cache, policy, all_logits=True)[0]
    held = [[sorted(p[p < n].tolist()) for p in lc.positions[0]] for lc in cache.layers]
    return torch.cat([first, later]).float(), held


def kl(p_logits, q_logits) -> float:
    """Mean over positions of KL(p ‖ q), logits (K, V)."""
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return max((lp.exp() * (lp - lq)).sum(-1).mean().item(), 0.0)  # equal logits can round below 0


def compare(kvmini_held, authors_kept, groups: int) -> dict:
    """Per layer: the authors' mean held length, the Jaccard of kvmini's KV-head set with each query head's
    set (mean over query heads); how many (layer, query head) sets are identical, and how many entries the
    authors' cache holds a second time (a position twice)."""
    lengths, jaccard, same, twice = [], [], 0, 0
    for mine, theirs in zip(kvmini_held, authors_kept):
        lengths.append(sum(map(len, theirs)) / len(theirs))
        pairs = [(set(mine[h // groups]), set(s)) for h, s in enumerate(theirs)]
        jaccard.append(sum(len(a & b) / len(a | b) for a, b in pairs) / len(pairs))
        same += sum(a == b for a, b in pairs)
        twice += sum(len(s) - len(set(s)) for s in theirs)
    return {"lengths": lengths, "jaccard": jaccard, "identical": same, "held_twice": twice,
            "sets": sum(len(t) for t in authors_kept)}


def versions(deps: Path, names) -> dict[str, str]:
    """Package -> version as installed in DEPS (its *.dist-info folders)."""
    found = {}
    for info in deps.glob("*.dist-info"):
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        if name.lower().replace("_", "-") in names:
            found[name.lower().replace("_", "-")] = version
    return found


def checkout_commit(code: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(code), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def cross_check(args) -> int:
    use_deps(args.deps)  # before anything imports transformers
    import torch

    from kvmini.eval import fidelity, provenance, why
    from kvmini.loading import load_model
    from kvmini.methods.registry import make_policy, parse_spec
    from kvmini.tokenizer import load_tokenizer
    from kvmini.weights import ensure_default_model

    adapter = importlib.import_module(ADAPTERS[args.method])
    budget = adapter.BUDGET if args.budget is None else args.budget
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    out = cli.writable_folder(args.out, "--out")
    folder = Path(args.model) if args.model else ensure_default_model(log=log)
    model = load_model(folder, "cpu", "float32")
    wide = load_model(folder, "cpu", "float32", per_query_head=True)  # one KV head per query head
    ids = load_tokenizer(folder).encode(fidelity.pydoc_text())
    starts = why.windows(len(ids), N + K, WINDOWS)[: args.windows]
    groups = model.config.num_heads // model.config.num_kv_heads
    runner = adapter.load(args.code, folder)
    name, options = parse_spec(adapter.SPEC)
    rows = []
    for w, start in enumerate(starts):
        x = torch.tensor([ids[start : start + N + K]])
        full, _ = fidelity.continuation_logits(model, x, N)
        row = {"window": w, "start": start}
        for mode, kvmini, g in (("per_query_head", wide, 1), ("per_kv_head", model, groups)):
            mine, held = kvmini_run(kvmini, x, N, make_policy(name, budget, **options), getattr(adapter, "PROMPT_CHUNK", None))
            row[f"kvmini_{mode}"] = {"kl_full": kl(full, mine), "lengths": [sum(map(len, h)) / len(h) for h in held]}
            theirs, kept = adapter.run(runner, x, N, g > 1, budget)
            row[mode] = {"kl_full": kl(full, theirs), "kl_to_kvmini": kl(theirs, mine),
                         "max_logit_diff": (theirs - mine).abs().max().item(), **compare(held, kept, g)}
            log(f"window {w + 1}/{len(starts)} {mode}: KL(full‖kvmini) {row[f'kvmini_{mode}']['kl_full']:.4f}, "
                f"KL(full‖authors) {row[mode]['kl_full']:.4f}, identical kept sets {row[mode]['identical']}/"
                f"{row[mode]['sets']}")
        rows.append(row)
    found = checkout_commit(args.code)
    result = {"method": args.method, "spec": adapter.SPEC, "budget": budget, "n": N, "k": K, "groups": groups,
              "released": getattr(adapter, "RELEASED", "per_query_head"),
              "authors": {"repo": adapter.REPO, "commit": found or adapter.COMMIT, "git_checkout": found is not None},
              "packages": {**versions(args.deps, adapter.PACKAGES), "torch": torch.__version__},
              "adaptations": adapter.ADAPTATIONS, "windows": rows,
              "provenance": {"command": " ".join(["python -m kvmini.eval.authors", *args.argv]), "date": provenance.now(),
                             "commit": provenance.commit(), "machine": provenance.machine(),
                             "behaviour": provenance.recorded_behaviour([name])[name]}}
    path = out / (f"{args.method}.json" if budget == adapter.BUDGET else f"{args.method}-{budget:g}.json")
    path.write_text(json.dumps(result, indent=1))
    print(table(result), flush=True)
    log(f"wrote {path}")
    return 0


def table(result: dict) -> str:
    """Markdown: kvmini's official variant beside the authors' code, as released and per KV head."""
    from kvmini.eval.tables import mean, name

    rows, W = result["windows"], len(result["windows"])
    spread = lambda xs: f"{mean(xs):.4f} ({min(xs):.4f}–{max(xs):.4f})"  # noqa: E731
    where = "" if result["authors"]["git_checkout"] else " (not a git checkout: the commit the adapter names)"
    out = [f"{name(result['spec'])} beside {result['authors']['repo']} @ {result['authors']['commit'][:7]}{where}, "
           f"{W} window{'s' * (W > 1)} of N={result['n']:,}, K={result['k']}" + (f", budget {result['budget'] * 100:g}%" if result["budget"]
                                                                   else "") + " (mean, and range over windows):", "",
           "| authors' code | kvmini | KL(full‖kvmini) | KL(full‖authors) | KL(authors‖kvmini) | largest logit difference | "
           "identical kept sets | kept-set Jaccard per layer (lowest) | kept per layer, authors − kvmini (mean of \\|·\\|) |",
           "|---|---|---|---|---|---|---|---|---|"]
    def twice(mode: str) -> str:  # entries their cache holds twice, in which windows
        found = [(r["window"], r[mode].get("held_twice", 0)) for r in rows if r[mode].get("held_twice", 0)]
        return "".join(f"; {n} entries held twice in window {w}" for w, n in found)

    for mode, label, ours in (("per_query_head", "per query head", "`per_query_head`"),
                              ("per_kv_head", "per KV head", "default (per KV head)")):
        label += " (as released)" if mode == result["released"] else " (adapted)"
        diff = [abs(a - b) for r in rows for a, b in zip(r[mode]["lengths"], r[f"kvmini_{mode}"]["lengths"])]
        out.append(f"| {label} | {ours} | {spread([r[f'kvmini_{mode}']['kl_full'] for r in rows])} | "
                   f"{spread([r[mode]['kl_full'] for r in rows])} | "
                   f"{spread([r[mode]['kl_to_kvmini'] for r in rows])} | {max(r[mode]['max_logit_diff'] for r in rows):.2g} | "
                   f"{sum(r[mode]['identical'] for r in rows):,} of {sum(r[mode]['sets'] for r in rows):,}{twice(mode)} | "
                   f"{min(min(r[mode]['jaccard']) for r in rows):.3f} | {mean(diff):.1f} |")
    default, per_query = ([r[f"kvmini_{m}"]["kl_full"] for r in rows] for m in ("per_kv_head", "per_query_head"))
    out += ["", f"The measured effect of kvmini's default: selecting per KV head, KL(full‖kvmini) is {mean(default):.4f}, "
            f"against {mean(per_query):.4f} selecting per query head (`per_query_head`, {result['groups']}× the entries); "
            f"lower in {sum(a < b for a, b in zip(default, per_query))} of {W} windows."]
    packages = ", ".join(f"{k} {v}" for k, v in result["packages"].items())
    out += ["", f"Run with {packages}; `{result['provenance']['command']}`. Adaptations made at run time:", ""]
    out += [f"{i}. {a}" for i, a in enumerate(result["adaptations"], 1)]
    return "\n".join(out)


def cannot_run() -> str:
    """Markdown: the methods whose authors' code cannot run beside kvmini, and why."""
    out = ["| method | authors' code | why it cannot run beside kvmini |", "|---|---|---|"]
    for method, (repo, commit, why) in CANNOT_RUN.items():
        out.append(f"| {method} | {repo} @ {commit[:7]} | " + " ".join(why).replace("|", "\\|") + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = cli.OneLineParser(prog="python -m kvmini.eval.authors",
                          description="Run a method's authors' code beside kvmini's official variant on the same windows.")
    p.add_argument("method", choices=[*ADAPTERS, *CANNOT_RUN])
    p.add_argument("--code", type=cli.path, required=True, help="your checkout of the authors' repository")
    p.add_argument("--deps", type=cli.path, required=True,
                   help="a folder holding the transformers their code needs (pip install --target DEPS --no-deps ...)")
    p.add_argument("--budget", type=cli.real_number, help="a ratio of the prompt in (0, 1) (default: the adapter's)")
    p.add_argument("--windows", type=cli.at_least(1), default=4, help=f"how many of the {WINDOWS} windows (default 4)")
    p.add_argument("--out", type=cli.path, default=str(OUT), help="output folder (default results/authors)")
    p.add_argument("--model", type=cli.path, help="HF-layout folder (default: SmolLM2-135M-Instruct)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.argv = argv
    if args.method in CANNOT_RUN:
        repo, commit, why = CANNOT_RUN[args.method]
        p.error(f"{args.method}: {repo} @ {commit[:7]} cannot run beside kvmini: {why[1]}")
    for flag in ("code", "deps"):
        if not Path(getattr(args, flag)).is_dir():
            p.error(f"--{flag} {getattr(args, flag)} is not a folder")
    adapter = importlib.import_module(ADAPTERS[args.method])
    if args.budget is not None and not 0 < args.budget < 1:
        p.error(f"--budget {args.budget:g} is not a ratio in (0, 1)")
    if args.budget is not None and adapter.BUDGET is None:
        p.error(f"--budget: {args.method} chooses its own budget")
    if missing := [f for f in adapter.FILES if not (Path(args.code) / f).exists()]:  # before the models load
        p.error(f"--code {args.code} is not a checkout of {adapter.REPO} @ {adapter.COMMIT[:7]}: it has no {missing[0]}")
    args.code, args.deps = Path(args.code), Path(args.deps)
    return cli.run(lambda: cross_check(args))


if __name__ == "__main__":
    sys.exit(main())
