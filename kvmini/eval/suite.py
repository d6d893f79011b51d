"""The evaluation suite: each paper's headline experiment at small scale, plus speed and memory.

    python -m kvmini.eval.suite                              # quick profile, all experiments -> results/
    python -m kvmini.eval.suite --profile full --out results-full
    python -m kvmini.eval.suite --only streaming passkey     # a subset
    python -m kvmini.eval.suite --profile smoke --out /tmp/x # every code path (56 s on a quiet 2-core machine before queryaware)

Experiments (sizes per profile in PROFILES):
    streaming  streaming perplexity at fixed cache capacities (WeightedKV Table I, D2O Fig. 6)
    passkey    passkey retrieval over context lengths and depths (D2O Table 3, DynamicKV Fig. 4)
    fidelity   prefill-compression fidelity over several prompts (DBudgetKV, SnapKV, PyramidKV, ...)
    layers     attention density, variance and per-layer retention (D2O Fig. 1/4, DynamicKV Fig. 2)
    speed      prefill overhead, decode speed, kept bytes and peak memory relative to the full cache
    parts_speed  D2O's decode step with its parts switched on in turn (PARTS): what each costs over SnapKV's
    ablations  fidelity of each difference between a paper and its authors' code, one prompt (docs/methods.md)
    why        each seed method with one part switched off, against its rivals at equal memory, paired over
               windows of the text (kvmini/eval/why.py; the reasons beside the claims' verdicts)
    queryaware passkey accuracy and answer fidelity with the question in the prompt and after it (issue 31)

Writes results.json (everything), summary.md (the tables) and PNG plots (with matplotlib). Experiments
that an earlier run of the same profile wrote to the folder and this run skips are kept. Each experiment
records its provenance: the command, date, commit and machine that made it and a fingerprint of the code it
measured (kvmini/eval/provenance.py; tests/test_results_current.py names what is stale).
"""
import json
import sys
import time
from pathlib import Path

from kvmini import cli

cli.exit_on_ctrl_c(__name__)  # before the imports below
import torch  # noqa: E402

from kvmini.errors import KvminiError  # noqa: E402
from kvmini.eval import fidelity, layers, passkey, plots, provenance, query_aware, speed, streaming, why  # noqa: E402
from kvmini.eval.summary import summary  # noqa: E402
from kvmini.methods import registry  # noqa: E402

EVERY = registry.specs()  # every registered method and variant: a method added to METHODS is measured everywhere
BUDGETED = [s for s in EVERY if not registry.chooses_budget(registry.parse_spec(s)[0])]
SELF_BUDGETED = [s for s in EVERY if s not in BUDGETED]  # DBudgetKV: its own budget
# Each difference between a paper and its authors' code switched on its own (docs/methods.md), and
# evicting every N decode steps (docs/speed.md): one prompt, budget 0.2.
ABLATIONS = [
    "h2o", "d2o", "d2o[variant=paper]", "d2o[protected_layers=]", "d2o[allocation=paper]", "d2o[allocation=zscore]",
    "d2o[allocation=uniform]", "d2o[nm=3:1]", "d2o[split=paper]", "d2o[merge=paper]", "d2o[merge=off]",
    "d2o[tau=per_head]", "d2o[beta=0.7]", "d2o[start=prompt]", "d2o[clamp_budgets=false]",
    "d2o[variant=paper,allocation=zscore]", "d2o[variant=paper,allocation=official]",
    "d2o[variant=paper,allocation=uniform]", "d2o[variant=paper,allocation=uniform,merge=off]",
    "dbudgetkv", "dbudgetkv[variant=official]", "dbudgetkv[norm_excludes_kept=true]",
    "dbudgetkv[variant=official,norm_excludes_kept=false]", "dbudgetkv[ranking=window_attention]",
    "dbudgetkv[variant=official,ranking=position]", "dbudgetkv[ranking=cumulative]",
    "dbudgetkv[variant=official,ranking=cumulative]", "dbudgetkv[threshold=0.05]",
    "dbudgetkv[variant=official,threshold=0.01]", "dbudgetkv[protected_layers=]",
    "dynamickv", "dynamickv[tail_reallocation=true]", "dynamickv[rounding=floor]", "dynamickv[variant=official]",
    "streaming_llm", "tova", "weightedkv",
] + [f"{m}[evict_every={n}]" for m in ("streaming_llm", "h2o", "tova", "weightedkv", "d2o") for n in (8, 32)]
# D2O's decode step built up one part at a time, each row adding one part to the row before: the cost of
# each part is the difference between its row and the row before (docs/speed.md, "Where D2O's decode
# step goes"). The same interleaved rounds as `speed`, with SnapKV as the reference.
H2O_RUNG = ("H2O: accumulated attention, one eviction per decode step, the same budget in every layer", "h2o")
PARTS = {
    "d2o": [H2O_RUNG, ("+ D2O's layer budgets (layers 0, 1 and the last kept whole), merging off", "d2o[merge=off]"),
            ("+ merging (Eq. 9-12): D2O", "d2o")],
    "d2o[variant=paper]": [H2O_RUNG, ("+ D2O's layer budgets (Eq. 5), merging off", "d2o[variant=paper,merge=off]"),
                           ("+ merging (Eq. 9-12): D2O", "d2o[variant=paper]")],
}
# The smoke profile's methods: one for each path the experiments' code takes (evicting while decoding,
# compressing at the first decode step, at the prompt only, heads of their own counts, a budget of its own)
SMOKE = ["h2o", "d2o", "snapkv", "adakv", "dbudgetkv"]
SWEEP = [0.1, 0.2, 0.3, 0.5]  # the budgets of the quick profile's frontier (fidelity and passkey)
PROFILES = {
    "smoke": {  # every code path, a method for each, about a minute on a quiet machine; the numbers mean nothing
        "streaming": dict(n=160, capacities=[32], chunk=16, methods=SMOKE),
        "passkey": dict(lengths=[256], depths=[0.5], budgets=[64], methods=SMOKE),
        "fidelity": dict(n=128, k=16, prompts=2, budgets=[0.5], methods=["h2o", "dbudgetkv"]),
        "layers": dict(n=128, budget=0.5, bins=16),
        "speed": dict(prefill_n=256, reps=1, decode_n=256, steps=2, rounds=1, peak_n=256, budget=0.5, batch_n=256,
                      cap_gib=2, peak_methods=["h2o"], methods=SMOKE),  # peak: one child per code path (full, a policy)
        "parts_speed": dict(decode_n=256, steps=2, rounds=1, budget=0.5, ladders=["d2o"]),
        "ablations": dict(n=128, k=16, budgets=[0.5], methods=["h2o", "d2o[merge=off]", "h2o[evict_every=8]"]),
        "queryaware": dict(length=256, depths=[0.5], budgets=[0.5], k=2, methods=SMOKE),
        "why": dict(n=128, k=8, windows=2, budget=0.5, seeds=["dbudgetkv"]),  # a share-matched rival and ablation
    },
    "quick": {
        "streaming": dict(n=2048, capacities=[256], chunk=16),
        "passkey": dict(lengths=[512, 1024], depths=[0.1, 0.3, 0.5, 0.7, 0.9], budgets=SWEEP),
        "fidelity": dict(n=1024, k=32, prompts=2, budgets=SWEEP, methods=EVERY),  # 2 prompts, K=32: the sweep's time
        "layers": dict(n=1024, budget=0.2, bins=32),
        "speed": dict(prefill_n=2048, reps=1, decode_n=2048, steps=16, rounds=8, peak_n=2048, budget=0.2, batch_n=2048,
                      cap_gib=8),
        "parts_speed": dict(decode_n=2048, steps=16, rounds=8, budget=0.2),
        "ablations": dict(n=1024, k=128, budgets=[0.2], methods=ABLATIONS),
        "queryaware": dict(length=512, depths=[0.25, 0.75], budgets=[0.1, 0.3], k=4),
        "why": dict(n=1024, k=32, windows=12, budget=0.2, seeds=list(why.SEEDS)),  # 12: 10 of 12 settles (p 0.04)
    },
    "full": {
        "streaming": dict(n=4096, capacities=[256, 1024], chunk=16),
        "passkey": dict(lengths=[1024, 2048, 4096, 8000], depths=[0.0, 0.25, 0.5, 0.75, 1.0], budgets=[64, 128, 0.2]),
        "fidelity": dict(n=2048, k=256, prompts=3, budgets=[0.2], methods=EVERY),
        "layers": dict(n=2048, budget=0.2, bins=64),
        "speed": dict(prefill_n=4096, reps=1, decode_n=8128, steps=8, rounds=7, peak_n=8192, budget=0.2, batch_n=4096,
                      cap_gib=16),
        "parts_speed": dict(decode_n=8128, steps=8, rounds=7, budget=0.2),
        "ablations": dict(n=2048, k=256, budgets=[0.2], methods=ABLATIONS),
        "queryaware": dict(length=2048, depths=[0.1, 0.5, 0.9], budgets=[0.1, 0.2, 0.3], k=8),
        "why": dict(n=2048, k=64, windows=12, budget=0.2, seeds=list(why.SEEDS)),
    },
}
EXPERIMENTS = list(PROFILES["quick"])
BY_METHOD = ("passkey", "fidelity", "speed", "ablations", "queryaware")  # rows per method: `--methods` merges them


def run_streaming(model, text_ids, p, specs, log):
    ids = torch.tensor([text_ids[: p["n"]]], device=model.device)
    return streaming.run(model, ids, p["capacities"], ["full", *specs], chunk=p["chunk"], log=log)


def budgeted_runs(specs: list[str], budgets: list) -> list[tuple]:
    """(spec, budget) for each budget of the methods that take one; (spec, None) for those that choose their own."""
    return [(m, b) for b in budgets for m in specs if m in BUDGETED] + [(m, None) for m in specs if m in SELF_BUDGETED]


def run_passkey(model, tok, chat, stop_ids, p, specs, log):
    runs = [("full", None)] + budgeted_runs(specs, p["budgets"])
    return passkey.run(model, tok, chat, runs, p["lengths"], p["depths"], stop_ids, log=log)


def run_queryaware(model, tok, chat, stop_ids, p, specs, log):
    return query_aware.run(model, tok, chat, budgeted_runs(specs, p["budgets"]), p["length"], p["depths"], p["k"],
                           stop_ids, log=log)


def run_fidelity(model, text_ids, p, specs, log):
    """fidelity.run on `prompts` windows spread over the text; rows carry their prompt index."""
    span = p["n"] + p["k"]
    step = (len(text_ids) - span) // max(p["prompts"] - 1, 1)
    rows = []
    for i in range(p["prompts"]):
        ids = torch.tensor([text_ids[i * step : i * step + span]], device=model.device)
        log(f"fidelity prompt {i + 1}/{p['prompts']} (tokens {i * step}..{i * step + span})")
        rows += [{"prompt": i, **r} for r in fidelity.run(model, ids, p["n"], specs, p["budgets"], log=log)]
    return rows


def run_why(model, text_ids, p, log):
    return why.run(model, text_ids, p["n"], p["k"], p["windows"], p["budget"], p["seeds"], log=log)


def run_ablations(model, text_ids, p, specs, log):
    ids = torch.tensor([text_ids[: p["n"] + p["k"]]], device=model.device)
    return fidelity.run(model, ids, p["n"], specs, p["budgets"], log=log)


def measured(name: str, p: dict) -> list[str]:
    """The method specs experiment `name` runs with sizes `p` (the full cache first)."""
    every = lambda specs: [s for s in specs if s in p.get("methods", specs)]  # noqa: E731  (smoke: SMOKE's)
    return {"streaming": ["full", *every(streaming.METHODS[1:])], "passkey": ["full", *every(BUDGETED + SELF_BUDGETED)],
            "fidelity": ["full", *p.get("methods", [])], "layers": ["full", *layers.ADAPTIVE],
            "speed": ["full", *every(EVERY)], "parts_speed": ["full", "snapkv", *dict.fromkeys(
                spec for rungs in ladders(p).values() for _, spec in rungs)], "ablations": ["full", *p.get("methods", [])],
            "queryaware": ["full", *every(BUDGETED + SELF_BUDGETED)], "why": ["full", *why.specs(p.get("seeds", []))]}[name]


def today(profile: str) -> dict[str, dict]:
    """Experiment -> the methods and sizes the suite runs today in `profile` (what a results file is checked against)."""
    return {name: {"methods": measured(name, p), "sizes": json.loads(json.dumps(p))}
            for name, p in PROFILES[profile].items()}


def run_layers(model, text_ids, p, log):
    ids = torch.tensor([text_ids[: p["n"]]], device=model.device)
    L = model.config.num_layers
    log(f"layers: statistics, density maps and retention on a {p['n']}-token prompt")
    return {"n": p["n"], "budget": p["budget"], "statistics": layers.layer_statistics(model, ids),
            "density_maps": {l: layers.density_map(model, ids, l, p["bins"]) for l in (0, 1, L // 2, L - 1)},
            "retention": layers.retention(model, ids, p["budget"])}


def run_speed(model, text_ids, p, model_folder, methods, log):
    ids = lambda n: torch.tensor([text_ids[:n]], device=model.device)  # noqa: E731
    out = {"budget": p["budget"], "prefill_n": p["prefill_n"], "decode_n": p["decode_n"], "peak_n": p["peak_n"],
           "steps": p["steps"], "rounds": p["rounds"],
           "prefill": speed.prefill_times(model, ids(p["prefill_n"]), methods, p["budget"], p["reps"], log),
           "decode": speed.decode_speed(model, ids(p["decode_n"]), methods, p["budget"], p["steps"], p["rounds"], log)}
    if model.device.type == "cpu" and sys.platform.startswith("linux"):
        peaked = [m for m in methods if m in p.get("peak_methods", methods)]  # a child process each
        out["peak"] = speed.peak_memory(peaked, p["peak_n"], p["budget"], model_folder, log)
    else:
        out["peak_skipped"] = "peak process memory is measured on Linux CPU runs only"
    if model.device.type == "cuda":
        out["batch"] = speed.batch_under_cap(model, ids(p["batch_n"]), methods, p["budget"], p["cap_gib"], log=log)
        out["cap_gib"], out["batch_n"] = p["cap_gib"], p["batch_n"]
    return out


def ladders(p: dict) -> dict:
    """The ladders of PARTS that sizes `p` climb (smoke: one)."""
    return {name: PARTS[name] for name in p.get("ladders", PARTS)}


def run_parts_speed(model, text_ids, p, log):
    """`speed.decode_speed` of SnapKV and every rung of PARTS, in the same interleaved rounds, and each
    one's kept bytes (`speed.prefill_times`: after the prompt, or after the first decode step)."""
    methods = measured("parts_speed", p)[1:]
    ids = torch.tensor([text_ids[: p["decode_n"]]], device=model.device)
    kept = speed.prefill_times(model, ids, methods, p["budget"], log=log)
    return {"budget": p["budget"], "decode_n": p["decode_n"], "steps": p["steps"], "rounds": p["rounds"],
            "ladders": ladders(p), "kept_bytes_ratio": {m: r["kept_bytes_ratio"] for m, r in kept.items()},
            "decode": speed.decode_speed(model, ids, methods, p["budget"], p["steps"], p["rounds"], log)}


def main(argv=None) -> int:
    p = cli.OneLineParser(prog="python -m kvmini.eval.suite",
                          description="Run the evaluation suite; write JSON, markdown and plots.")
    p.add_argument("--profile", choices=list(PROFILES), default="quick", help="sizes (default: quick: about an hour on 2 quiet CPU cores for every experiment; smoke: a minute)")
    p.add_argument("--only", nargs="+", choices=EXPERIMENTS, help="experiments to run (default: all; with --methods, "
                   "those --out's results.json holds)")
    p.add_argument("--out", type=cli.path, default="results", help="output folder (default: results/; checked before the work)")
    p.add_argument("--model", type=cli.path, help="HF-layout folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--methods", nargs="+", choices=[m for m in registry.METHODS if m != "full"], metavar="NAME",
                   help="measure only these methods (every variant) and merge their rows into --out's results.json "
                        "(a method added or changed: tests/test_results_current.py prints the command); an "
                        "experiment not in BY_METHOD (streaming, layers) is re-run whole, every method")
    argv = sys.argv[1:] if argv is None else list(argv)
    p.set_defaults(argv=argv)  # recorded in each experiment's provenance
    return cli.run(lambda: evaluate(p.parse_args(argv)), imports=(*fidelity.LAZY_IMPORTS, "kvmini.chat"))


def evaluate(args) -> int:
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if twice := sorted({e for i, e in enumerate(args.only or []) if e in args.only[:i]}):
        raise KvminiError(f"--only names {', '.join(twice)} twice; each experiment runs once")
    from kvmini.loading import resolve_device

    resolve_device(args.device)  # a bad device is refused before the output folder is made
    out = cli.writable_folder(args.out, "--out")
    if args.methods:
        old = mergeable(out / "results.json", args.profile, args.only)
        args.only = args.only or [e for e in EXPERIMENTS if e in old]
    args.only = args.only or EXPERIMENTS
    results = run_suite(args.profile, args.only, args.model, args.device, log, argv=args.argv, methods=args.methods)
    if args.methods:
        results = merged_into(old, results, args.methods, args.profile, args.argv)
    results = kept_from(out / "results.json", results, log)
    try:
        results["plots"] = plots.write_plots(results, out)
    except (plots.PlotsUnavailable, OSError) as e:
        results["plots_skipped"] = cli.one_line(e)
        log(f"plots skipped: {results['plots_skipped']}")
    print(summary(results), flush=True)  # on the screen before the files are written
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.md").write_text(summary(results))
    log(f"wrote {out / 'results.json'}, {out / 'summary.md'} and {len(results.get('plots', []))} plots")
    return 0


def mergeable(path: Path, profile: str, only: list[str]) -> dict:
    """The results file single methods are measured into: refused, before any work, if it is missing or
    of another profile, or if an experiment of `only` that keeps rows per method is stale as a whole
    (its shared code or sizes changed: merging one method into it would mix two codes)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        raise KvminiError(f"--methods merges into {path}, which is missing or not JSON: run the suite without "
                          "--methods first") from None
    if old.get("profile") != profile:
        raise KvminiError(f"{path} holds the {old.get('profile')} profile, not {profile}: give --profile "
                          f"{old.get('profile')}")
    for line in provenance.stale(path, {e: t for e, t in today(profile).items() if e in BY_METHOD and e in (only or old)}):
        if "measure alone:" not in line:
            raise KvminiError(f"{line.split(' is stale')[0]} must be re-run whole first: {line}")
    return old


def merged_into(old: dict, new: dict, names: list[str], profile: str, argv: list[str]) -> dict:
    """`old` results with the rows of methods `names` replaced by `new`'s, in the suite's order (experiments
    of BY_METHOD; an experiment that keeps no rows per method was run whole and replaces its old self)."""
    out = {**old, "seconds": dict(old.get("seconds", {})), "provenance": dict(old.get("provenance", {}))}
    ours = lambda spec: provenance.method_of(spec) in names  # noqa: E731
    for e in (e for e in EXPERIMENTS if e in new):
        if e not in BY_METHOD or e not in old:
            out[e], out["seconds"][e], out["provenance"][e] = new[e], new["seconds"][e], new["provenance"][e]
            continue
        order = today(profile)[e]["methods"]
        if isinstance(old[e], list):
            out[e] = merged_rows(old[e], new[e], ours)
        else:  # speed: {"decode": {spec: row}, "prefill": ..., "peak": ..., "budget": ...}
            out[e] = {k: merged_by_spec(v, new[e][k], ours, order) if isinstance(v, dict) and "full" in v else v
                      for k, v in old[e].items()}
        out["provenance"][e] = provenance.merge_stamp(old["provenance"][e], e, new["provenance"][e]["methods"],
                                                      order, argv)
    return out


def merged_rows(old: list[dict], new: list[dict], ours) -> list[dict]:
    """Rows of `old` with ours replaced by `new`'s in their places (the same runs measured again), or,
    when their number differs (a method or variant new to the file), the old rows and then the new."""
    mine, places = [r for r in new if ours(r["method"])], [i for i, r in enumerate(old) if ours(r["method"])]
    if len(mine) != len(places):
        return [r for r in old if not ours(r["method"])] + mine
    out = list(old)
    for i, r in zip(places, mine):
        out[i] = r
    return out


def merged_by_spec(old: dict, new: dict, ours, order: list[str]) -> dict:
    rows = {s: r for s, r in old.items() if not ours(s)} | {s: r for s, r in new.items() if ours(s)}
    return {s: rows[s] for s in order if s in rows}


def kept_from(path: Path, results: dict, log=print) -> dict:
    """`results` plus the experiments an earlier run of the same profile and device wrote to `path`
    and this one did not re-run (so `--only speed` updates one section, not the whole folder)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return results
    if not isinstance(old, dict) or (old.get("profile"), old.get("device")) != (results["profile"], results["device"]):
        return results
    kept = [name for name in EXPERIMENTS if name in old and name not in results]
    if kept:
        log(f"kept from the earlier {path}: {', '.join(kept)}")
    merged = {**results, **{name: old[name] for name in kept}}
    for key in ("sizes", "seconds", "provenance"):
        merged[key] = {**{name: old[key][name] for name in kept if name in old.get(key, {})}, **results.get(key, {})}
    return merged


def tokens_needed(name: str, p: dict) -> int:
    """The longest sequence (prompt and generated tokens) experiment `name` runs with sizes `p`."""
    if name == "passkey":
        return max(p["lengths"]) + 10  # prompts of about `length` tokens, answers of up to 10
    if name == "queryaware":
        return p["length"] + max(p["k"], query_aware.ANSWER_TOKENS)
    if name in ("fidelity", "ablations", "why"):
        return p["n"] + p["k"]
    if name == "speed":
        return max(p["prefill_n"], speed.decode_length(p["decode_n"], p["steps"], p["rounds"]), p["peak_n"], p["batch_n"])
    if name == "parts_speed":
        return speed.decode_length(p["decode_n"], p["steps"], p["rounds"])
    return p["n"]  # streaming, layers


def check_context(P: dict, only: list[str], context: int) -> None:
    """Refuse, before any work, an experiment whose sequences the model's context cannot hold."""
    for name in only:
        if tokens_needed(name, P[name]) > context:
            raise KvminiError(f"experiment {name} needs {tokens_needed(name, P[name])} tokens, more than the model's "
                              f"context of {context}; choose a smaller --profile or leave it out of --only")


def run_suite(profile: str, only: list[str], model_folder: str | None, device: str, log=print, argv=(),
              methods=None) -> dict:
    """Run experiments `only` of `profile`; with `methods` (names), only those methods' specs, and only the
    experiments that measure them (the full cache runs beside them as the reference)."""
    from kvmini.chat import load_chat_format, stop_token_ids
    from kvmini.loading import load_model
    from kvmini.tokenizer import load_tokenizer
    from kvmini.weights import ensure_default_model

    folder = Path(model_folder) if model_folder else ensure_default_model(log=log)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KvminiError(f"--device {device}: no CUDA GPU is available here")
    model = load_model(folder, device, "float32")
    tok = load_tokenizer(folder)
    text_ids = tok.encode(fidelity.pydoc_text())
    chat = load_chat_format(folder)
    stop_ids = stop_token_ids(model.config.eos_token_ids, tok, chat)
    P = PROFILES[profile]
    check_context(P, only, model.config.max_position_embeddings)
    results = {"profile": profile, "device": str(model.device), "sizes": {k: P[k] for k in only}}
    runners = {
        "streaming": lambda specs: run_streaming(model, text_ids, P["streaming"], specs, log),
        "passkey": lambda specs: run_passkey(model, tok, chat, stop_ids, P["passkey"], specs, log),
        "fidelity": lambda specs: run_fidelity(model, text_ids, P["fidelity"], specs, log),
        "layers": lambda specs: run_layers(model, text_ids, P["layers"], log),
        "speed": lambda specs: run_speed(model, text_ids, P["speed"], model_folder, specs, log),
        "parts_speed": lambda specs: run_parts_speed(model, text_ids, P["parts_speed"], log),
        "ablations": lambda specs: run_ablations(model, text_ids, P["ablations"], specs, log),
        "queryaware": lambda specs: run_queryaware(model, tok, chat, stop_ids, P["queryaware"], specs, log),
        "why": lambda specs: run_why(model, text_ids, P["why"], log),
    }
    for name in only:
        specs = measured(name, P[name])[1:]
        if methods and name in BY_METHOD:
            specs = [s for s in specs if provenance.method_of(s) in methods]
        if methods and not any(provenance.method_of(s) in methods for s in measured(name, P[name])):
            log(f"== {name}: does not measure {', '.join(methods)}; skipped")
            continue
        t0 = time.perf_counter()
        log(f"== {name} ({profile} profile{': ' + ', '.join(specs) if methods else ''})")
        results[name] = runners[name](specs)
        results.setdefault("seconds", {})[name] = time.perf_counter() - t0
        results.setdefault("provenance", {})[name] = provenance.stamp(name, ["full", *specs], list(argv))
        log(f"== {name} done in {time.perf_counter() - t0:.0f} s")
    return results


if __name__ == "__main__":
    sys.exit(main())
