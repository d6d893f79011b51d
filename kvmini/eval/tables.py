"""The generated tables of README.md and docs/: each is a function of committed results files.

kvmini.eval.docs writes them into the documents' marked regions. A function reads what it needs with
`need(results, experiment)`; when a file lacks the experiment, the region says so and names the
command that measures it. Verdicts are computed from the numbers by the rule written beside them,
so a re-run that changes a number changes its verdict too.
"""
import statistics

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


def kl_text(f: dict) -> str:
    return f"KL {f['kl']:.3f}" + (f" ({f['kl_lo']:.3f}–{f['kl_hi']:.3f})" if f["kl_hi"] > f["kl_lo"] else "")


def streaming_ppl(results: dict) -> dict:
    """capacity -> {method: perplexity}."""
    out = {}
    for r in need(results, "streaming"):
        out.setdefault(r["capacity"], {})[r["method"]] = r["ppl"]
    return out


def passkey_correct(results: dict) -> tuple[dict, int]:
    """(method, budget) -> correct answers, and the number of cells each ran."""
    rows = need(results, "passkey")
    out = {}
    for r in rows:
        out[(r["method"], r["budget"])] = out.get((r["method"], r["budget"]), 0) + bool(r["correct"])
    return out, sum(1 for r in rows if r["method"] == "full")


def budget_text(b) -> str:
    return "—" if b is None else f"{b:.0%}" if isinstance(b, float) and b <= 1 else f"{b:g} tokens"


# The reproduction table (docs/evaluation.md)

def claim_streaming(quick, full, who: str, rivals: list[str]) -> tuple[str, str]:
    cells, verdicts = [], []
    for label, res in (("full profile", full), ("quick profile", quick)):
        if "streaming" not in res:
            continue
        size = res["sizes"]["streaming"]
        for capacity, ppl in sorted(streaming_ppl(res).items(), reverse=True):
            shown = [m for m in sorted(ppl, key=ppl.get) if m != "full" and (m in rivals or m.startswith(who))]
            cells.append(f"{label} ({size['n']:,} tokens, chunks of {size['chunk']}), capacity {capacity:,}: "
                         + ", ".join(f"{name(m)} {ppl[m]:.2f}" for m in shown) + f" (full cache {ppl['full']:.2f})")
            present = [r for r in rivals if r in ppl]
            for m in (m for m in shown if m.startswith(who) and present):  # no rival measured: no verdict
                below = [name(r) for r in present if ppl[m] < ppl[r]]
                verdicts.append(f"{name(m)} at {capacity:,} ({label.split()[0]}): "
                                + ("yes" if len(below) == len(present) else
                                   f"below {', '.join(below)} only" if below else "no"))
    return "; ".join(cells), "; ".join(verdicts)


def claim_passkey(quick) -> tuple[str, str]:
    correct, cells = passkey_correct(quick)
    size = quick["sizes"]["passkey"]
    budgets = sorted({b for _, b in correct if b is not None}, key=lambda b: (b <= 1, b))
    parts = [f"quick profile, lengths {', '.join(map(str, size['lengths']))} × {len(size['depths'])} depths: "
             f"full cache {correct[('full', None)]}/{cells}"]
    for b in budgets:
        at = sorted(((c, m) for (m, bb), c in correct.items() if bb == b), key=lambda x: -x[0])
        parts.append(f"at {budget_text(b)}: " + ", ".join(f"{name(m)} {c}/{cells}" for c, m in at))
    if ("dbudgetkv", None) in correct:
        parts.append(f"DBudgetKV (own budget) {correct[('dbudgetkv', None)]}/{cells}")
    ratio = [b for b in budgets if b <= 1]
    at = {m: c for (m, bb), c in correct.items() if ratio and bb == ratio[-1]}
    best = max(at.values()) if at else 0
    d2o = max((c for m, c in at.items() if m.startswith("d2o")), default=0)
    yes = lambda holds: "yes" if holds else "no"  # noqa: E731
    verdict = (f"DynamicKV keeps the most at {budget_text(ratio[-1])}: {yes(at.get('dynamickv') == best)}; "
               f"D2O keeps at least half of the full cache's answers: {yes(2 * d2o >= correct[('full', None)])}")
    return "; ".join(parts), verdict


def claim_dbudgetkv(quick) -> tuple[str, str]:
    f = fidelity_by_spec(need(quick, "fidelity"))
    size = quick["sizes"]["fidelity"]
    cells, verdicts = [f"quick profile, {size['prompts']} prompts, N = {size['n']:,}, K = {size['k']}"], []
    for spec in ("dbudgetkv", "dbudgetkv[variant=official]"):
        if (spec, None) in f:
            x = f[(spec, None)]
            cells.append(f"{name(spec)} keeps {x['kept']:.1%} ({x['kept_lo']:.1%}–{x['kept_hi']:.1%} per prompt), "
                         f"{kl_text(x)}, perplexity ×{x['ppl']:.3f}")
            verdicts.append(f"{name(spec)}: {'yes' if x['ppl'] <= 1.01 else 'no'}")
    if ("snapkv", 0.2) in f:
        cells.append(f"SnapKV at 20%: KL {f[('snapkv', 0.2)]['kl']:.3f}")
    return "; ".join(cells), "; ".join(verdicts) + " (near-lossless: perplexity within 1% of the full cache's)"


def claim_fidelity_pair(quick, full, spec: str, rival: str) -> tuple[str, str]:
    """`spec` against `rival` at each budget both profiles measured: KL and kept share; verdict: lower KL."""
    cells, verdicts = [], []
    for label, res in (("quick", quick), ("full", full)):
        if "fidelity" not in res:
            continue
        f = fidelity_by_spec(res["fidelity"])
        size = res["sizes"]["fidelity"]
        for (m, b), x in f.items():
            if m.startswith(spec) and (rival, b) in f:
                y = f[(rival, b)]
                cells.append(f"{name(m)} at {budget_text(b)} ({label}: N = {size['n']:,}, K = {size['k']}): "
                             f"{kl_text(x)}, {x['kept']:.1%} kept, vs {name(rival)} {kl_text(y)}, {y['kept']:.1%} kept")
                verdicts.append(f"{name(m)} at {budget_text(b)} ({label}): {'yes' if x['kl'] < y['kl'] else 'no'}")
    return "; ".join(cells), "; ".join(verdicts)


def claim_snapkv(quick, full) -> tuple[str, str]:
    cells, verdicts = [], []
    for label, res in (("quick", quick), ("full", full)):
        if "fidelity" not in res:
            continue
        f = fidelity_by_spec(res["fidelity"])
        for (m, b), x in f.items():
            if m == "snapkv":
                rivals = [y["kl"] for (mm, bb), y in f.items() if bb == b and mm != m]
                cells.append(f"{label} at {budget_text(b)}: perplexity ×{x['ppl']:.3f}, {kl_text(x)}, "
                             f"top-1 {x['top1']:.2f}")
                verdicts.append(f"closest to the full cache at {budget_text(b)} ({label}): "
                                f"{'yes' if all(x['kl'] < k for k in rivals) else 'no'}")
    return "; ".join(cells), "; ".join(verdicts)


def claim_passkey_pair(quick, spec: str, rival: str) -> tuple[str, str]:
    correct, cells = passkey_correct(quick)
    pairs = [(b, c, correct[(rival, b)]) for (m, b), c in correct.items() if m == spec and (rival, b) in correct]
    if not pairs:
        return "", ""
    return ("passkey: " + ", ".join(f"{name(spec)} {c}/{cells} vs {name(rival)} {r}/{cells} at {budget_text(b)}"
                                    for b, c, r in pairs),
            "passkey: " + ", ".join(f"{'yes' if c > r else 'no'} at {budget_text(b)}" for b, c, r in pairs))


def claim_layer_variance(res) -> tuple[str, str]:
    layers = need(res, "layers")
    stats = layers["statistics"]
    shallow, deep = stats[:3], stats[3:]
    top = max(s["variance"] for s in shallow)
    odd = [s for s in deep if s["variance"] <= top]
    rng = lambda xs, f: f"{f(min(xs))}–{f(max(xs))}"  # noqa: E731
    group = lambda g: (f"layers {g[0]['layer']}–{g[-1]['layer']}: "  # noqa: E731
                       f"F_v {rng([s['variance'] for s in g], '{:.3g}'.format)}, "
                       f"top 10% of keys get {rng([s['top10_share'] for s in g], '{:.0%}'.format)} of the attention")
    deep_usual = [s for s in deep if s not in odd]
    cell = f"{layers['n']:,}-token prompt: {group(shallow)}; {group(deep_usual)}"
    if odd:
        cell += "; except " + ", ".join(f"layer {s['layer']} (F_v {s['variance']:.3g}, {s['top10_share']:.0%})"
                                        for s in odd)
    return cell, "yes" if not odd else f"yes, except {len(odd)} layer{'s' * (len(odd) > 1)}"


def claim_layer_budgets(quick) -> tuple[str, str]:
    layers = need(quick, "layers")
    n, b = layers["n"], layers["budget"]
    parts = []
    for spec, kept in layers["retention"].items():
        whole = [l for l, k in enumerate(kept) if k >= n]
        text = f"{name(spec)} {min(kept)}–{max(kept)}"
        if whole:
            text += f" (layers {', '.join(map(str, whole))} keep the whole prompt)"
        parts.append(text)
    dyn = layers["retention"].get("dynamickv", [1])
    return (f"at {b:.0%} of {n:,} tokens (a mean of {round(b * n)} per layer), entries kept per layer (layers counted "
            f"from 0): " + "; ".join(parts),
            f"{'yes' if max(dyn) >= 2 * min(dyn) else 'no'} "
            f"(DynamicKV's largest layer budget is ×{max(dyn) / min(dyn):.1f} its smallest)")


def claim_speed(fs) -> tuple[str, str]:
    sp = need(fs, "speed")
    dec = {m: d["ratio"] for m, d in sp["decode"].items() if m != "full"}
    pre = {m: p["ratio"] for m, p in sp["prefill"].items() if m != "full"}
    peak = {m: p["ratio"] for m, p in sp.get("peak", {}).items() if m != "full"}
    cell = (f"decode after {sp['decode_n']:,} tokens at {sp['budget']:.0%}, tokens/s / full: "
            + ", ".join(f"{name(m)} ×{dec[m]:.2f}" for m in sorted(dec, key=dec.get, reverse=True))
            + f". Prefill of {sp['prefill_n']:,} tokens / full: "
            + ", ".join(f"{name(m)} ×{pre[m]:.2f}" for m in sorted(pre, key=pre.get, reverse=True)))
    if peak:
        cell += (f". Peak memory growth while prefilling {sp['peak_n']:,} tokens / full "
                 f"({sp['peak']['full']['peak_growth_mib']:.0f} MiB): "
                 + ", ".join(f"{name(m)} ×{peak[m]:.2f}" for m in sorted(peak, key=peak.get)))
    slow = [name(m) for m, r in dec.items() if r <= 1]
    costly = [name(m) for m, r in pre.items() if r > 1.1]
    verdict = ("decodes faster than the full cache: " + (f"all but {', '.join(slow)}" if slow else "every method")
               + "; prefill within ×1.10 of the full cache's: "
               + (f"all but {', '.join(costly)}" if costly else "every method"))
    return cell, verdict


def claims(quick: dict, full: dict, fs: dict) -> str:
    """docs/evaluation.md: the papers' headline claims, measured; each row's numbers and verdict from the files."""
    rows = [
        ("WeightedKV (Table I): at equal capacity its streaming perplexity is below StreamingLLM's, H2O's and TOVA's",
         lambda: claim_streaming(quick, full, "weightedkv", ["streaming_llm", "h2o", "tova"]), "streaming"),
        ("WeightedKV (Table I): its deterministic, importance-weighted value merge beats CaM's probabilistic "
         "merge into the next tokens: streaming perplexity below CaM's",
         lambda: claim_streaming(quick, full, "weightedkv", ["cam", "cam[variant=paper]"]), "streaming"),
        ("D2O (Fig. 6): its streaming perplexity stays below H2O's and StreamingLLM's",
         lambda: claim_streaming(quick, full, "d2o", ["h2o", "streaming_llm"]), "streaming"),
        ("D2O (Tables 1-3: LongBench, needle retrieval): at equal budget it beats RoCo (eviction) and CaM (merging)",
         lambda: join(join(claim_streaming(quick, full, "d2o", ["roco", "cam"]),
                           join(claim_fidelity_pair(quick, full, "d2o", "roco"),
                                claim_fidelity_pair(quick, full, "d2o", "cam"))),
                      join(claim_passkey_pair(quick, "d2o", "roco"), claim_passkey_pair(quick, "d2o", "cam"))),
         "streaming, fidelity, passkey"),
        ("D2O (Table 3), DynamicKV (Fig. 4): compressed caches keep most of the passkey accuracy; DynamicKV keeps "
         "the most at small budgets", lambda: claim_passkey(quick), "passkey"),
        ("DBudgetKV: with t = 1% its self-chosen budget is near-lossless", lambda: claim_dbudgetkv(quick), "fidelity"),
        ("SnapKV: compressing the prompt by its observation window keeps the output",
         lambda: claim_snapkv(quick, full), "fidelity"),
        ("PyramidKV: a pyramid of layer budgets beats SnapKV's uniform budgets at equal total",
         lambda: claim_fidelity_pair(quick, full, "pyramidkv", "snapkv"), "fidelity"),
        ("DynamicKV: per-task layer budgets beat fixed patterns",
         lambda: join(claim_fidelity_pair(quick, full, "dynamickv", "snapkv"),
                      claim_passkey_pair(quick, "dynamickv", "snapkv")), "fidelity, passkey"),
        ("D2O (Fig. 1, 4): shallow layers attend densely, deep layers sparsely (higher variance of attention)",
         lambda: claim_layer_variance(full if "layers" in full else quick), "layers"),
        ("DynamicKV (Fig. 2): layers need very different budgets", lambda: claim_layer_budgets(quick), "layers"),
        ("D2O (Table 5) and the efficiency claims of all: a 20% cache decodes faster and needs less memory, and "
         "compressing costs little prefill time", lambda: claim_speed(fs), "speed"),
    ]
    out = ["| paper, claim | measured on SmolLM2-135M | holds? | experiment |", "|---|---|---|---|"]
    for claim, measure, experiment in rows:
        try:
            cell, verdict = measure()
        except Missing as e:
            cell, verdict = f"not measured yet (no {e} in the results files)", "—"
        out.append(f"| {claim} | {cell} | {verdict} | {experiment} |")
    return "\n".join(out)


def join(a: tuple[str, str], b: tuple[str, str]) -> tuple[str, str]:
    return "; ".join(x for x in (a[0], b[0]) if x), "; ".join(x for x in (a[1], b[1]) if x)


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

def speed_table(fs: dict) -> str:
    """Compression against the full cache: prefill, decode, policy time, ops and peak memory."""
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
    older results without rounds: one value, the ratio of the ratios to the full cache."""
    if "rounds_s" in dec and "rounds_s" in snapkv:
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
    """All layers at once against layer by layer, in the same interleaved rounds."""
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


# Where the numbers came from (docs/evaluation.md)

def provenance_table(*files: tuple[str, dict]) -> str:
    out = ["| results file | experiment | command | commit | date | wall time |", "|---|---|---|---|---|---|"]
    for path, res in files:
        for experiment, p in res.get("provenance", {}).items():
            commit = p.get("commit") or "unknown (backfilled from git)"
            seconds = res.get("seconds", {}).get(experiment)
            took = "—" if seconds is None else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
            out.append(f"| `{path}` | {experiment} | `{p['command']}` | {commit} | {p['date']} | {took} |")
    return "\n".join(out)


# name -> (the results files it reads, the function of their contents)
TABLES = {
    "claims": ((QUICK, FULL, FULL_SPEED), claims),
    "provenance": ((QUICK, FULL, FULL_SPEED),
                   lambda q, f, s: provenance_table((QUICK, q), (FULL, f), (FULL_SPEED, s))),
    "d2o-ablations": ((QUICK,), lambda q: ablations(q, "d2o")),
    "dbudgetkv-ablations": ((QUICK,), lambda q: ablations(q, "dbudgetkv")),
    "dynamickv-ablations": ((QUICK,), lambda q: ablations(q, "dynamickv")),
    "evict-every": ((QUICK,), lambda q: ablations(q, "evict_every")),
    "speed-8k": ((FULL_SPEED,), speed_table),
    "together-8k": ((FULL_SPEED,), together_table),
    "speed-2k": ((QUICK,), speed_table),
    "together-2k": ((QUICK,), together_table),
    "parts-8k": ((FULL_SPEED,), parts_table),
    "parts-2k": ((QUICK,), parts_table),
    "queryaware": ((QUICK,), queryaware_table),
    "queryaware-verdict": ((QUICK,), queryaware_verdict),
}
# the command that measures an experiment into each file, for a table that finds it missing
MEASURE = {QUICK: "python -m kvmini.eval.suite --only {experiment} --out results/quick",
           FULL: "python -m kvmini.eval.suite --profile full --only {experiment} --out results/full",
           FULL_SPEED: "python -m kvmini.eval.suite --profile full --only {experiment} --out results/full-speed"}
