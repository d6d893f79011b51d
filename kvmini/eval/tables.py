"""The generated tables of README.md and docs/: each is a function of committed results files
(the reproduction table of the papers' claims is kvmini.eval.claims, built on the helpers here).

kvmini.eval.docs writes them into the documents' marked regions (its TABLES names each region's
function). A function reads what it needs with `need(results, experiment)`; when a file lacks the
experiment, the region says so and names the command that measures it. Verdicts are computed from the
numbers by the rule written beside them, so a re-run that changes a number changes its verdict too.
"""
import statistics

from kvmini.eval import provenance

NAMES = {"full": "full cache", "streaming_llm": "StreamingLLM", "h2o": "H2O", "vatp": "VATP", "tova": "TOVA",
         "snapkv": "SnapKV", "pyramidkv": "PyramidKV", "weightedkv": "WeightedKV", "d2o": "D2O (official)",
         "d2o[variant=paper]": "D2O (paper)", "dynamickv": "DynamicKV (paper)",
         "dynamickv[variant=official]": "DynamicKV (official)", "dbudgetkv": "DBudgetKV (paper)",
         "dbudgetkv[variant=official]": "DBudgetKV (official)", "cam": "CaM (official)", "cam[variant=paper]": "CaM (paper)",
         "roco": "RoCo (official)", "roco[variant=paper]": "RoCo (paper)", "scissorhands": "Scissorhands"}
QUICK, FULL, FULL_SPEED = "results/quick/results.json", "results/full/results.json", "results/full-speed/results.json"


class Missing(Exception):
    """A results file lacks an experiment a table needs."""


def need(results: dict, experiment: str):
    if experiment not in results:
        raise Missing(experiment)
    return results[experiment]


def name(spec: str) -> str:
    return NAMES.get(spec, f"`{spec}`")


def mean(xs) -> float:
    return statistics.fmean(xs)


def fidelity_by_spec(rows: list[dict]) -> dict:
    """(method, budget) -> means over prompts: kept share, KL (and its range), perplexity / full, top-1."""
    full = {r.get("prompt", 0): r["ppl"] for r in rows if r["method"] == "full"}
    out = {}
    for key in dict.fromkeys((r["method"], r["budget"]) for r in rows if r["method"] != "full"):
        mine = [r for r in rows if (r["method"], r["budget"]) == key]
        out[key] = {"kept": mean([r["kept_share"] for r in mine]), "kept_lo": min(r["kept_share"] for r in mine),
                    "kept_hi": max(r["kept_share"] for r in mine), "kl": mean([r["kl"] for r in mine]),
                    "kl_lo": min(r["kl"] for r in mine), "kl_hi": max(r["kl"] for r in mine),
                    "ppl": mean([r["ppl"] / full[r.get("prompt", 0)] for r in mine]),
                    "top1": mean([r["top1"] for r in mine])}
    return out


def budget_text(b) -> str:
    return "—" if b is None else f"{b:.0%}" if isinstance(b, float) and b <= 1 else f"{b:g} tokens"


# Paper and authors' code side by side (docs/methods.md), and --evict-every (docs/speed.md)

def ablations(quick: dict, prefix: str) -> str:
    """Every ablation spec of one method (or, prefix 'evict_every', every evict_every spec and its N = 1 row)."""
    rows = need(quick, "ablations")
    f = fidelity_by_spec(rows)
    size = quick["sizes"]["ablations"]
    if prefix == "evict_every":
        bases = dict.fromkeys(m.split("[")[0] for m, _ in f if "evict_every=" in m)
        specs = [s for base in bases for s in [base] + [m for m, _ in f if m.startswith(base + "[evict_every=")]]
    else:
        specs = [m for m, _ in f if m.split("[")[0] == prefix] + [m for m, _ in f if m == "h2o"]
    out = [f"One prompt of N = {size['n']:,} tokens, K = {size['k']} teacher-forced, "
           f"budget {budget_text(size['budgets'][0])} (DBudgetKV chooses its own); full cache perplexity "
           f"{next(r['ppl'] for r in rows if r['method'] == 'full'):.2f}:", "",
           "| spec | kept share | KL(full‖method) | perplexity / full | top-1 agree |", "|---|---|---|---|---|"]
    for spec in specs:
        for (m, b), x in f.items():
            if m == spec:
                out.append(f"| `{m}` | {x['kept']:.1%} | {x['kl']:.3f} | {x['ppl']:.3f} | {x['top1']:.3f} |")
    return "\n".join(out)


# Speed (docs/speed.md)

def redesign_note(res: dict, experiment: str) -> str:
    """While a redesign defers re-measuring timed rows (provenance.REDESIGN), the commit they describe; else ""."""
    if not provenance.REDESIGN:
        return ""
    made = res.get("provenance", {}).get(experiment, {})
    return (f"*Measured at {made.get('commit') or 'an unknown commit'} ({made.get('date', 'date unknown')}): "
            f"{provenance.REDESIGN}, and these rows are measured again when it completes "
            "(docs/evaluation.md, \"When a result is stale\").*")


def with_note(res: dict, experiment: str, table: str) -> str:
    note = redesign_note(res, experiment)
    return f"{note}\n\n{table}" if note else table


def speed_table(fs: dict) -> str:
    """Compression against the full cache: prefill, decode, policy time, ops and peak memory."""
    return with_note(fs, "speed", _speed_table(fs))


def _speed_table(fs: dict) -> str:
    sp = need(fs, "speed")
    pre_full, dec_full = sp["prefill"]["full"], sp["decode"]["full"]
    out = [f"Prefill {sp['prefill_n']:,} tokens; decode after {sp['decode_n']:,} tokens, {sp['rounds']} rounds of "
           f"{sp['steps']} steps{', interleaved' if 'rounds_s' in sp['decode']['full'] else ''}; budget {sp['budget']:.0%}:", "",
           "| method | prefill / full | policy in prefill | decode / full | decode / SnapKV's (rounds' range) "
           "| K/V kept / full | policy per decode step (share) | policy ops per step | first decode step | peak memory / full |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for m, pre in sp["prefill"].items():
        dec, peak = sp["decode"][m], sp.get("peak", {}).get(m)
        if m == "full":
            cells = [f"1.00 ({pre_full['seconds']:.1f} s)", "—", f"1.00 ({dec_full['tokens_per_s']:.1f} tokens/s)",
                     "—", "1.000", "—", "—", "—"]
        else:
            cells = [f"{pre['ratio']:.2f}", f"{pre['policy_s']:.2f} s", f"{dec['ratio']:.2f}",
                     of_snapkv_cell(dec, sp['decode']['snapkv']), f"{pre['kept_bytes_ratio']:.3f}",
                     f"{dec['policy_ms_per_step']:.2f} ms ({dec['policy_share']:.1%})", f"{dec['ops_per_step']:,}",
                     f"{dec['first_step_s']:.2f} s"]
        if peak is None:
            cells.append("—")
        else:
            cells.append(f"{peak['ratio']:.2f}" + (f" ({peak['peak_growth_mib']:.0f} MiB)" if m == "full" else ""))
        out.append(f"| {name(m)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def paired(dec: dict, snapkv: dict) -> list[float]:
    """SnapKV's round time over the method's, round by round (each pair from the same interleaved round);
    rows of two runs (a method measured alone later: `run` differs) or without rounds: one value, the ratio
    of their ratios, each to its own run's full cache."""
    if "rounds_s" in dec and "rounds_s" in snapkv and dec.get("run") == snapkv.get("run"):
        return [s / m for s, m in zip(snapkv["rounds_s"], dec["rounds_s"])]
    return [dec["ratio"] / snapkv["ratio"]]


def of_snapkv(dec: dict, snapkv: dict) -> float:
    """A method's decode speed over SnapKV's: the median of the paired rounds (`paired`)."""
    return statistics.median(paired(dec, snapkv))


def of_snapkv_cell(dec: dict, snapkv: dict) -> str:
    """'0.93 (0.91–0.96)': the median of the paired rounds and, in brackets, the lowest and highest round
    (how far one round of the same run strays: a difference inside it is not one the run can tell)."""
    rounds, cell = paired(dec, snapkv), f"{of_snapkv(dec, snapkv):.2f}"
    return cell if len(rounds) < 2 else f"{cell} ({min(rounds):.2f}–{max(rounds):.2f})"


def together_table(fs: dict) -> str:
    """All layers at once against layer by layer, in the same interleaved rounds, where a results file
    measured kvmini.at_once's step (removed by issue 70: every step now runs a method's own code)."""
    if not any("joint_speedup" in d for d in need(fs, "speed")["decode"].values()):
        return "*No decode step runs all layers at once any more: every method's step is its own code, layer by layer.*"
    return with_note(fs, "speed", _together_table(fs))


def _together_table(fs: dict) -> str:
    sp = need(fs, "speed")
    out = [f"| after {sp['decode_n']:,} tokens | decode tokens/s: at once | layer by layer | at once / layer by layer "
           "| policy per step: at once | layer by layer | ops per step: at once | layer by layer |",
           "|---|---|---|---|---|---|---|---|"]
    for m, d in sp["decode"].items():
        if "joint_speedup" in d:
            out.append(f"| {name(m)} | {d['tokens_per_s']:.1f} | {d['layer_by_layer_tokens_per_s']:.1f} | "
                       f"{d['joint_speedup']:.2f} | {d['policy_ms_per_step']:.2f} ms | "
                       f"{d['layer_by_layer_policy_ms_per_step']:.2f} ms | {d['ops_per_step']:,} | "
                       f"{d['layer_by_layer_ops_per_step']:,} |")
    return "\n".join(out)


def parts_table(res: dict) -> str:
    """D2O's decode step built up one part at a time (kvmini.eval.suite.PARTS): each rung's decode speed over
    SnapKV's and its extra time per step, in the same interleaved rounds; a part costs the difference
    between its rung and the one above."""
    return with_note(res, "parts_speed", _parts_table(res))


def _parts_table(res: dict) -> str:
    ps = need(res, "parts_speed")
    dec, snap = ps["decode"], ps["decode"]["snapkv"]
    over = lambda d: statistics.median(m - s for m, s in zip(d["rounds_s"], snap["rounds_s"])) / ps["steps"] * 1e3  # noqa: E731
    out = [f"Decode after {ps['decode_n']:,} tokens, {ps['rounds']} interleaved rounds of {ps['steps']} steps, budget "
           f"{ps['budget']:.0%}; SnapKV decodes {snap['tokens_per_s']:.1f} tokens/s ({1e3 / snap['tokens_per_s']:.1f} ms "
           "per step). Extra time: the median over rounds of the rung's round time minus SnapKV's, per step.", "",
           "| variant | rung (each adds one part to the rung above) | decode / SnapKV's (rounds' range) | "
           "extra ms per step | the part's own ms per step | of the extra, in the policy's hooks | K/V kept / full |",
           "|---|---|---|---|---|---|---|"]
    for variant, rungs in ps["ladders"].items():
        before = None
        for label, spec in rungs:
            d, extra = dec[spec], over(dec[spec])
            own = "—" if before is None else f"{extra - before:+.2f}"
            out.append(f"| {name(variant) if before is None else ''} | {label} | {of_snapkv_cell(d, snap)} | "
                       f"{extra:+.2f} | {own} | {d['policy_ms_per_step'] - snap['policy_ms_per_step']:+.2f} | "
                       f"{ps['kept_bytes_ratio'][spec]:.3f} |")
            before = extra
    return "\n".join(out)


# Query-aware or not (README.md, docs/evaluation.md)

def queryaware_table(quick: dict) -> str:
    """Each method with the question in the prompt and after it; the question-dependent ones by the rule."""
    from kvmini.eval import query_aware as qa

    rows = need(quick, "queryaware")
    size = quick["sizes"]["queryaware"]
    m = qa.by_condition(rows)
    cells = sum(1 for r in rows if r["method"] == "full")
    ctx, q = mean([r["context_tokens"] for r in rows]), mean([r["question_tokens"] for r in rows])
    pct = lambda x: f"{x:.0%}"  # noqa: E731
    out = [f"Quick profile: passkey prompts of about {size['length']:,} tokens ({ctx:.0f} of context, {q:.0f} of "
           f"question and answer start), needle at depths {', '.join(f'{d:g}' for d in size['depths'])}; accuracy "
           f"over those {cells} cells (the full cache: {pct(m[('full', None)]['in prompt']['accuracy'])}); KL and "
           f"top-1 over the full cache's first {size['k']} answer tokens, teacher-forced. *in*: the question in the "
           "prompt; *after*: the context compressed first, the question its next prompt.", "",
           "| method | budget | accuracy in → after | KL(full‖method) in → after | top-1 in → after | depends on the question? |",
           "|---|---|---|---|---|---|"]
    order = list(dict.fromkeys(spec for spec, _ in m))
    for spec, b in sorted((k for k in m if k[0] != "full"), key=lambda k: (order.index(k[0]), k[1] or 0)):
        conds = m[(spec, b)]
        x, y = conds["in prompt"], conds["after"]
        out.append(f"| {name(spec)} | {budget_text(b) if b is not None else 'own'} | {pct(x['accuracy'])} → "
                   f"{pct(y['accuracy'])} | {x['kl']:.3f} → {y['kl']:.3f} | {x['top1']:.2f} → {y['top1']:.2f} | "
                   f"{'**yes**' if qa.depends(conds) else 'no'} |")
    return "\n".join(out + ["", queryaware_verdict(quick)])


def queryaware_verdict(quick: dict) -> str:
    """The rule and the methods it names, from the same results (the README shows this, the docs the table)."""
    from kvmini.eval import query_aware as qa

    m = qa.by_condition(need(quick, "queryaware"))
    dependent = qa.question_dependent(need(quick, "queryaware"))
    rest = [s for s in dict.fromkeys(spec for spec, _ in m) if s != "full" and s not in dependent]
    return (f"The rule: a method depends on seeing the question when, at some budget, the question arriving after "
            f"the compression costs it at least {qa.DROP:.0%} accuracy, or multiplies its answer KL by at least "
            f"{qa.KL_RATIO:g} and adds at least {qa.KL_FLOOR:g} nats. By it, **depending on the question**: "
            + (", ".join(name(s) for s in dependent) or "none") + "; **not**: " + (", ".join(name(s) for s in rest) or "none") + ".")


# Each experiment's sizes in each profile (docs/evaluation.md), from kvmini.eval.suite.PROFILES

PROFILE_CELLS = {  # experiment -> its sizes in words: every key of its entry in a profile is a field here
    "streaming": "{n} tokens, capacities {capacities}, chunks of {chunk}",
    "passkey": "{lengths} tokens × depths {depths}; budgets {budgets}",
    "fidelity": "N={n}, K={k}, {prompts} prompts, budgets {budgets}; {methods}",
    "layers": "{n}-token prompt, budget {budget}, {bins} bins",
    "speed": "prefill {prefill_n} tokens, {reps} round(s); decode after {decode_n} tokens, {rounds} rounds of {steps} "
             "steps; peak memory of a prefill of {peak_n}; budget {budget}; GPU batch: {batch_n} tokens under {cap_gib} GiB",
    "parts_speed": "decode after {decode_n} tokens, {rounds} rounds of {steps} steps, budget {budget}",
    "ablations": "one prompt, N={n}, K={k}, budgets {budgets}; {methods}",
    "queryaware": "{length} tokens × depths {depths}; budgets {budgets}; K={k}",
    "why": "{windows} windows, N={n}, K={k}, budget {budget}; seeds {seeds} with their parts and rivals",
}


def size_text(key: str, value) -> str:
    """One size of a profile in words: budgets as budget_text, depths as fractions, a list of method specs as its count."""
    if key == "methods":
        return f"{len(value)} method specs"
    if isinstance(value, str):
        return name(value)
    if isinstance(value, list):
        return ", ".join(size_text(key, v) for v in value)
    if key.startswith("budget"):
        return budget_text(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def profile_cell(experiment: str, sizes: dict) -> str:
    return PROFILE_CELLS[experiment].format(**{k: size_text(k, v) for k, v in sizes.items()})


def profiles_table(profiles: dict, shown=("quick", "full")) -> str:
    out = ["| experiment | " + " | ".join(f"{p} profile" for p in shown) + " |", "|---|" + "---|" * len(shown)]
    for experiment in PROFILE_CELLS:
        out.append(f"| {experiment} | " + " | ".join(profile_cell(experiment, profiles[p][experiment]) for p in shown) + " |")
    return "\n".join(out)



def not_run(*results: dict) -> str:
    """The experiments that none of these results files (one profile's) holds, named in a sentence."""
    missing = [e for e in PROFILE_CELLS if not any(e in r for r in results)]
    return "Not measured in the full profile (no results file holds them): " + (", ".join(missing) or "none") + "."

# Where the numbers came from (docs/evaluation.md)

def provenance_table(*files: tuple[str, dict]) -> str:
    out = ["| results file | experiment | command | commit | date | machine | wall time |", "|---|---|---|---|---|---|---|"]
    for path, res in files:
        for experiment, p in res.get("provenance", {}).items():
            commit = p.get("commit") or "unknown (backfilled from git)"
            seconds = res.get("seconds", {}).get(experiment)
            took = "—" if seconds is None else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
            out.append(f"| `{path}` | {experiment} | `{p['command']}` | {commit} | {p['date']} | {p.get('machine', '—')} "
                       f"| {took} |")
    return "\n".join(out)
