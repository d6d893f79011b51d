"""The papers' headline claims beside what the committed results measure on SmolLM2-135M (docs/evaluation.md,
README.md), each verdict computed from the numbers by the rule written beside it.

One row per (claim, experiment): a short cell (the two or three numbers the verdict rests on), the
verdict, and a detail table below with every number. A claim that compares methods compares them at
equal memory, measured: a method that holds more than its nominal budget (D2O's official variant keeps
layers 0, 1 and the last whole) is set against its rival read off the rival's frontier at the same
measured share (`at_share`), not against the rival's point at the same nominal budget.

    verdict(checks) = "holds" if every check is yes, "does not hold here" if none is, else "holds in part"

A seed paper's claim rows also carry a row of the `why` experiment (kvmini.eval.why, kvmini.eval.paired): the seed against the
rivals that row names, paired over windows, and the part whose switching off moves its KL most. That row's
verdict is the sign test's ("not settled at this size" where it cannot tell), and so is the README's.
"""
import math

from kvmini.eval import paired
from kvmini.eval.tables import Missing, budget_text, fidelity_by_spec, name, need, redesign_note

SAME = 0.005  # two measured shares within half a percentage point are equal memory


def at_share(points: list[tuple[float, float]], x: float, log: bool = False, same: float = SAME) -> float | None:
    """A method's value at measured share x, read off its frontier: `points` are (share, value) of its
    budgets; a point within `same` of x is taken as it is; else linear between the two nearest shares
    (in log value if `log`); None outside them."""
    pts = sorted(points)
    for s, v in pts:
        if abs(s - x) <= same:
            return v
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 < x < x1:
            t = (x - x0) / (x1 - x0)
            return math.exp((1 - t) * math.log(y0) + t * math.log(y1)) if log else (1 - t) * y0 + t * y1
    return None


def verdict(checks: list[tuple[str, bool | None]]) -> str:
    known = [ok for _, ok in checks if ok is not None]
    if not known:
        return "no verdict"
    return "holds" if all(known) else "does not hold here" if not any(known) else "holds in part"


def verdict_cell(checks) -> str:
    """'**holds in part** (yes: A; no: B, C)', or with many checks their counts ('3 of 8 yes'); checks
    that could not compare at equal memory are counted as not comparable."""
    v = verdict(checks)
    yes = [label for label, ok in checks if ok]
    no = [label for label, ok in checks if ok is False]
    open_ = [label for label, ok in checks if ok is None]
    if len(checks) > 4:
        parts = [f"{len(yes)} of {len(yes) + len(no)} yes"] if yes and no else []
        parts += [f"{len(open_)} not comparable at equal memory"] if open_ else []
    else:
        parts = [f"yes: {', '.join(yes)}", f"no: {', '.join(no)}"] if yes and no else []
        parts += [f"not comparable at equal memory: {', '.join(open_)}"] if open_ else []
    return f"**{v}**" + (f" ({'; '.join(parts)})" if parts else "")


# --- streaming ---------------------------------------------------------------------------------

def streaming_rows(results: dict) -> dict:
    """capacity -> {method: (held per layer, perplexity)}; rows made before `held` was recorded: None."""
    out = {}
    for r in need(results, "streaming"):
        out.setdefault(r["capacity"], {})[r["method"]] = (r.get("held"), r["ppl"])
    return out


def streaming_at(results: dict, method: str, held: float) -> float | None:
    """`method`'s perplexity at `held` entries per layer, off its points over capacities (log-log)."""
    pts = [(math.log(h), p) for rows in streaming_rows(results).values() for m, (h, p) in rows.items()
           if m == method and h is not None]
    return at_share(pts, math.log(held), log=True) if pts else None


def claim_streaming(profiles: list[tuple[str, dict]], who: str, rivals: list[str]):
    """`who` (each variant) against every rival at each capacity, at equal measured entries held."""
    cells, checks, detail = [], [], ["| profile | capacity | method | entries held per layer | perplexity | "
                                     "best rival at the same held | below it? |", "|---|---|---|---|---|---|---|"]
    for label, res in profiles:
        if "streaming" not in res:
            continue
        for capacity, rows in sorted(streaming_rows(res).items(), reverse=True):
            present = [r for r in rivals if r in rows]
            for m in (m for m in rows if m.split("[")[0] == who and present):
                held, ppl = rows[m]
                if held is None:  # a run before `held` was recorded: no comparison at equal memory
                    checks.append((f"{label} {capacity:,}", None))
                    detail.append(f"| {label} | {capacity:,} | {name(m)} | not recorded | {ppl:.2f} | — | — |")
                    continue
                rival = {r: streaming_at(res, r, held) for r in present}
                known = {r: v for r, v in rival.items() if v is not None}
                best = min(known, key=known.get) if known else None
                ok = None if len(known) < len(present) else ppl < known[best]
                short = f"{label} {capacity:,}" + (f" ({name(m)})" if "[" in m else "")
                checks.append((short, ok))
                shown = "—" if best is None else f"{name(best)} {known[best]:.2f}"
                detail.append(f"| {label} | {capacity:,} | {name(m)} | {held:,.0f} | {ppl:.2f} | {shown} | "
                              f"{'—' if ok is None else 'yes' if ok else 'no'} |")
                if m == who:
                    cells.append(f"{short}: {ppl:.2f} holding {held:,.0f} vs " +
                                 (f"{name(best)} {known[best]:.2f}" if best else "— (no rival held as much)"))
            for r in present:
                held, ppl = rows[r]
                detail.append(f"| {label} | {capacity:,} | {name(r)} | {'—' if held is None else f'{held:,.0f}'} | "
                              f"{ppl:.2f} | | |")
    if not cells:  # every run predates `held`
        return "these streaming runs did not record the entries each method held", checks, "\n".join(detail)
    return f"{name(who)}, perplexity and entries held per layer: " + "; ".join(cells), checks, "\n".join(detail)


# --- fidelity ----------------------------------------------------------------------------------

def frontier(f: dict, method: str) -> list[tuple[float, float]]:
    """(kept share, KL) of `method` at each budget it was measured at."""
    return [(x["kept"], x["kl"]) for (m, b), x in f.items() if m == method and b is not None]


def claim_fidelity_pair(profiles: list[tuple[str, dict]], spec: str, rival: str, variants: bool = True):
    """`spec` (and its variants) against `rival`, KL at equal measured share: the rival read off its frontier."""
    cells, checks = [], []
    detail = [f"| profile | method | budget | kept | KL | {name(rival)}'s KL at that share | lower? |",
              "|---|---|---|---|---|---|---|"]
    for label, res in profiles:
        if "fidelity" not in res:
            continue
        f = fidelity_by_spec(res["fidelity"])
        line = frontier(f, rival)
        for (m, b), x in f.items():
            if b is None or not (m == spec or variants and m.split("[")[0] == spec):
                continue
            y = at_share(line, x["kept"], log=True)
            ok = None if y is None else x["kl"] < y
            short = f"{label} {budget_text(b)}" + (f" ({name(m)})" if m != spec else "")
            checks.append((short, ok))
            detail.append(f"| {label} | {name(m)} | {budget_text(b)} | {x['kept']:.1%} | {x['kl']:.3f} | "
                          f"{'outside its measured shares' if y is None else f'{y:.3f}'} | "
                          f"{'—' if ok is None else 'yes' if ok else 'no'} |")
            if m == spec and b == 0.2:
                cells.append(f"{label} 20%: KL {x['kl']:.3f} keeping {x['kept']:.1%} vs "
                             + (f"{y:.3f}" if y is not None else "— (outside its range)"))
    return f"{name(spec)} against {name(rival)} at that share: " + "; ".join(cells), checks, "\n".join(detail)


def claim_dbudgetkv(quick: dict):
    f = fidelity_by_spec(need(quick, "fidelity"))
    cells, checks = [], []
    detail = ["| variant | kept (per prompt) | perplexity / full | KL | SnapKV's KL at that share |", "|---|---|---|---|---|"]
    for spec in ("dbudgetkv", "dbudgetkv[variant=official]"):
        if (spec, None) not in f:
            continue
        x = f[(spec, None)]
        checks.append((name(spec), x["ppl"] <= 1.01))
        cells.append(f"{name(spec)} keeps {x['kept']:.1%}, perplexity ×{x['ppl']:.3f}")
        snap = at_share(frontier(f, "snapkv"), x["kept"], log=True)
        detail.append(f"| {name(spec)} | {x['kept']:.1%} ({x['kept_lo']:.1%}–{x['kept_hi']:.1%}) | ×{x['ppl']:.3f} | "
                      f"{x['kl']:.3f} | {'outside its measured shares' if snap is None else f'{snap:.3f}'} |")
    return "; ".join(cells) + " (rule: within 1% of the full cache's)", checks, "\n".join(detail)


def claim_snapkv(profiles):
    cells, checks, detail = [], [], ["| profile | budget | perplexity / full | KL | top-1 | lowest KL of all |",
                                     "|---|---|---|---|---|---|"]
    for label, res in profiles:
        if "fidelity" not in res:
            continue
        f = fidelity_by_spec(res["fidelity"])
        for (m, b), x in f.items():
            if m != "snapkv":
                continue
            rivals = {r: at_share(frontier(f, r) or [(y["kept"], y["kl"])], x["kept"], log=True)
                      for (r, bb), y in f.items() if r != m and (bb is not None or (r, 0.2) not in f)}
            rivals = {r: v for r, v in rivals.items() if v is not None}  # each read off at SnapKV's share
            best = min(rivals, key=rivals.get) if rivals else None
            ok = best is None or x["kl"] < rivals[best]
            checks.append((f"{label} {budget_text(b)}", ok))
            detail.append(f"| {label} | {budget_text(b)} | ×{x['ppl']:.3f} | {x['kl']:.3f} | {x['top1']:.2f} | "
                          f"{'SnapKV' if ok else f'{name(best)} {rivals[best]:.3f}'} |")
            if b == 0.2:
                cells.append(f"{label} 20%: perplexity ×{x['ppl']:.3f}, top-1 {x['top1']:.2f}")
    return "; ".join(cells) + " (rule: lowest KL of all at the share it keeps)", checks, "\n".join(detail)


# --- passkey -----------------------------------------------------------------------------------

def passkey_points(results: dict) -> tuple[dict, int]:
    """(method, budget) -> (mean share of the prompt kept per layer, correct answers); and the cells each ran."""
    rows = need(results, "passkey")
    out = {}
    for r in rows:
        kept, right, n = out.get((r["method"], r["budget"]), (0.0, 0, 0))
        out[(r["method"], r["budget"])] = (kept + r["kept"] / r["prompt_tokens"], right + bool(r["correct"]), n + 1)
    cells = sum(1 for r in rows if r["method"] == "full")
    return {k: (kept / n, right) for k, (kept, right, n) in out.items()}, cells


def claim_passkey_pair(quick: dict, spec: str, rival: str):
    """Answers of `spec` at each budget against `rival`'s at the same share kept (off its frontier)."""
    pts, cells = passkey_points(quick)
    line = [(k, c) for (m, b), (k, c) in pts.items() if m == rival and b is not None]
    out, checks = [], []
    detail = [f"| budget | {name(spec)}: share kept, right | {name(rival)} at that share | more? |", "|---|---|---|---|"]
    for (m, b), (kept, right) in pts.items():
        if m != spec or b is None:
            continue
        y = at_share(line, kept)
        ok = None if y is None else right > y + 1e-9  # a tie read off the frontier is not more
        checks.append((f"passkey {budget_text(b)}", ok))
        detail.append(f"| {budget_text(b)} | {kept:.1%}, {right}/{cells} | "
                      f"{'outside its measured shares' if y is None else f'{y:.1f}/{cells}'} | "
                      f"{'—' if ok is None else 'yes' if ok else 'no'} |")
        out.append(f"{budget_text(b)} {right} vs {'—' if y is None else f'{y:.1f}'}")
    return (f"answers of {cells}, {name(spec)} vs {name(rival)} at the share it kept: " + "; ".join(out),
            checks, "\n".join(detail))


def claim_passkey(quick: dict):
    pts, cells = passkey_points(quick)
    budgets = sorted({b for _, b in pts if b is not None})
    full = pts[("full", None)][1]
    size = quick["sizes"]["passkey"]
    detail = ["| method | " + " | ".join(budget_text(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for m in dict.fromkeys(m for m, b in pts if b is not None):
        detail.append(f"| {name(m)} | " + " | ".join(f"{pts[(m, b)][1]}/{cells}" if (m, b) in pts else "—"
                                                   for b in budgets) + " |")
    for m in (m for m, b in pts if b is None and m != "full"):
        detail.append(f"| {name(m)} (own budget) | {pts[(m, None)][1]}/{cells} |" + " |" * (len(budgets) - 1))
    checks, cell = [], [f"{', '.join(f'{n:,}' for n in size['lengths'])} tokens, {cells} cells: full cache {full}/{cells}"]
    lines = {m: [(k, c) for (mm, bb), (k, c) in pts.items() if mm == m and bb is not None]
             for m in dict.fromkeys(m for m, b in pts if b is not None)}
    for b in budgets:
        at = {m: pts[(m, bb)][1] for m, bb in pts if bb == b}
        d2o = max(c for m, c in at.items() if m.split("[")[0] == "d2o")
        checks.append((f"D2O keeps half at {budget_text(b)}", 2 * d2o >= full))
        if ("dynamickv", b) in pts:  # the most answers of all, the others read off at the share it kept
            share, right = pts[("dynamickv", b)]
            others = [at_share(line, share) for m, line in lines.items() if m.split("[")[0] != "dynamickv"]
            best = max((v for v in others if v is not None), default=None)
            checks.append((f"DynamicKV best at {budget_text(b)}", None if best is None else right >= best - 1e-9))
            if b in (budgets[0], budgets[-1]):
                cell.append(f"{budget_text(b)}: D2O {d2o}, DynamicKV {right}, best other at its share "
                            + ("—" if best is None else f"{best:.1f}"))
    return "; ".join(cell), checks, "\n".join(detail)


# --- why: the seed papers' claims paired over windows, with their cause ---------------------------

WHY = {  # claim row -> (the seed method, the rivals the row's claim names)
    "d2o-streaming": ("d2o", ["h2o", "streaming_llm"]), "d2o-roco-cam": ("d2o", ["roco", "cam"]),
    "weightedkv-baselines": ("weightedkv", ["streaming_llm", "h2o", "tova"]), "weightedkv-cam": ("weightedkv", ["cam"]),
    "dynamickv": ("dynamickv", ["snapkv"]), "dbudgetkv": ("dbudgetkv", []),
}


def why_verdict(rows: list[dict], seed: str, rivals: list[str]) -> str:
    """The sign test's verdict: against the rivals at equal memory, or (no rivals: DBudgetKV) perplexity
    within 1% of the full cache's window by window."""
    if rivals:
        return paired.verdict(paired.comparisons(rows), seed, rivals)
    x = paired.near_lossless(rows, seed)
    if x["p"] >= paired.ALPHA:
        return "not settled at this size"
    return "holds" if 2 * x["within"] > x["windows"] else "does not hold"


def why_cell(rows: list[dict], seed: str, rivals: list[str]) -> str:
    cell = paired.reason(paired.comparisons(rows), seed, rivals, name)
    if rivals:
        return cell
    x = paired.near_lossless(rows, seed)
    return (f"perplexity within 1% of the full cache's in {x['within']} of {x['windows']} windows (worst ×{x['worst']:.3f},"
            f" p {x['p']:.1g}); " + cell)


def claim_why(quick: dict, anchor: str):
    """(cell, checks, detail, verdict) of a seed claim's `why` row."""
    seed, rivals = WHY[anchor]
    rows = need(quick, "why")
    comp = paired.comparisons(rows)
    if seed not in comp:
        raise Missing("why")
    checks = [(name(r), {"lower": True, "higher": False}.get(paired.settled(comp[seed]["rivals"][r]))) for r in rivals]
    return why_cell(rows, seed, rivals), checks, paired.table(rows, name, [seed]), why_verdict(rows, seed, rivals)


# --- layers and speed --------------------------------------------------------------------------

def claim_layer_variance(res):
    stats = need(res, "layers")["statistics"]
    shallow, deep = stats[:3], stats[3:]
    top = max(s["variance"] for s in shallow)
    odd = [s["layer"] for s in deep if s["variance"] <= top]
    detail = ["| layer | F_v | top-10% share |", "|---|---|---|"] + [
        f"| {s['layer']} | {s['variance']:.3g} | {s['top10_share']:.0%} |" for s in stats]
    cell = (f"F_v of layers 0–2 at most {top:.3g}; of layers 3–{stats[-1]['layer']} from "
            f"{min(s['variance'] for s in deep):.3g} to {max(s['variance'] for s in deep):.3g}"
            + (f" (layer{'s' * (len(odd) > 1)} {', '.join(map(str, odd))} as low as the shallow ones)" if odd else ""))
    return cell, [(f"layer {l}", False) for l in odd] + [("the other deep layers", True)], "\n".join(detail)


def claim_layer_budgets(quick):
    layers = need(quick, "layers")
    n, b = layers["n"], layers["budget"]
    detail = ["| method | fewest entries in a layer | most | layers kept whole |", "|---|---|---|---|"] + [
        f"| {name(spec)} | {min(kept)} | {max(kept)} | {', '.join(str(l) for l, k in enumerate(kept) if k >= n) or '—'} |"
        for spec, kept in layers["retention"].items()]
    dyn = layers["retention"].get("dynamickv", [1])
    return (f"at {b:.0%} of {n:,} tokens (mean {round(b * n)} per layer) DynamicKV keeps {min(dyn)}–{max(dyn)} "
            f"per layer (×{max(dyn) / min(dyn):.1f}; rule: at least ×2)",
            [("DynamicKV's budgets", max(dyn) >= 2 * min(dyn))], "\n".join(detail))


def claim_speed(fs):
    sp = need(fs, "speed")
    dec = {m: d["ratio"] for m, d in sp["decode"].items() if m != "full"}
    pre = {m: p["ratio"] for m, p in sp["prefill"].items() if m != "full"}
    peak = {m: p["ratio"] for m, p in sp.get("peak", {}).items() if m != "full"}
    lo_hi = lambda d: f"×{min(d.values()):.2f}–×{max(d.values()):.2f}"  # noqa: E731
    cell = f"decode after {sp['decode_n']:,} tokens at {sp['budget']:.0%}: {lo_hi(dec)} the full cache's speed; " \
           f"prefill of {sp['prefill_n']:,}: {lo_hi(pre)} its time" + (f"; peak memory {lo_hi(peak)}" if peak else "")
    checks = [("decode faster, every method", all(r > 1 for r in dec.values())),
              (f"prefill within ×1.10 ({sum(r <= 1.1 for r in pre.values())} of {len(pre)})",
               all(r <= 1.1 for r in pre.values()))]
    if peak:
        checks.append((f"less peak memory ({sum(r < 1 for r in peak.values())} of {len(peak)})",
                       all(r < 1 for r in peak.values())))
    detail = ["| method | decode / full | prefill / full | peak memory / full |", "|---|---|---|---|"] + [
        f"| {name(m)} | ×{dec[m]:.2f} | ×{pre[m]:.2f} | {f'×{peak[m]:.2f}' if m in peak else '—'} |"
        for m in sorted(dec, key=dec.get, reverse=True)]
    note = redesign_note(fs, "speed")
    return cell, checks, "\n".join(detail + (["", note] if note else []))


# --- the table ---------------------------------------------------------------------------------

def rows(quick: dict, full: dict, fs: dict) -> list[tuple]:
    """(anchor, paper, claim, [(experiment, measure)]): measure() -> (cell, checks, detail[, verdict]); each
    seed claim's row ends with its `why` row."""
    both = [("full", full), ("quick", quick)]
    windows = quick.get("sizes", {}).get("why", {}).get("windows", "?")
    why_row = f"why: {windows} windows, paired"
    return [(anchor, paper, claim, parts + ([(why_row, lambda a=anchor: claim_why(quick, a))] if anchor in WHY else []))
            for anchor, paper, claim, parts in [
        ("weightedkv-baselines", "WeightedKV", "Table I: at equal capacity, streaming perplexity below "
         "StreamingLLM's, H2O's and TOVA's",
         [("streaming", lambda: claim_streaming(both, "weightedkv", ["streaming_llm", "h2o", "tova"]))]),
        ("weightedkv-cam", "WeightedKV", "Table I: its weighted value merge beats CaM's merge: streaming "
         "perplexity below CaM's",
         [("streaming", lambda: claim_streaming(both, "weightedkv", ["cam", "cam[variant=paper]"]))]),
        ("d2o-streaming", "D2O", "Fig. 6: streaming perplexity below H2O's and StreamingLLM's",
         [("streaming", lambda: claim_streaming(both, "d2o", ["h2o", "streaming_llm"]))]),
        ("d2o-roco-cam", "D2O", "Tables 1-3: at equal budget it beats RoCo (eviction) and CaM (merging)",
         [("streaming", lambda: claim_streaming(both, "d2o", ["roco", "cam"])),
          ("fidelity, vs RoCo", lambda: claim_fidelity_pair(both, "d2o", "roco")),
          ("fidelity, vs CaM", lambda: claim_fidelity_pair(both, "d2o", "cam")),
          ("passkey, vs RoCo", lambda: claim_passkey_pair(quick, "d2o", "roco")),
          ("passkey, vs CaM", lambda: claim_passkey_pair(quick, "d2o", "cam"))]),
        ("passkey", "D2O, DynamicKV", "D2O Table 3, DynamicKV Fig. 4: compressed caches keep most of the passkey "
         "accuracy; DynamicKV keeps the most at small budgets", [("passkey", lambda: claim_passkey(quick))]),
        ("dbudgetkv", "DBudgetKV", "with t = 1% its self-chosen budget is near-lossless",
         [("fidelity", lambda: claim_dbudgetkv(quick))]),
        ("snapkv", "SnapKV", "compressing the prompt by its observation window keeps the output",
         [("fidelity", lambda: claim_snapkv(both))]),
        ("pyramidkv", "PyramidKV", "a pyramid of layer budgets beats SnapKV's uniform budgets at equal total",
         [("fidelity", lambda: claim_fidelity_pair(both, "pyramidkv", "snapkv"))]),
        ("dynamickv", "DynamicKV", "per-task layer budgets beat fixed patterns (SnapKV's uniform budgets)",
         [("fidelity", lambda: claim_fidelity_pair(both, "dynamickv", "snapkv")),
          ("passkey", lambda: claim_passkey_pair(quick, "dynamickv", "snapkv"))]),
        ("d2o-layers", "D2O", "Fig. 1, 4: shallow layers attend densely, deep layers sparsely (higher variance)",
         [("layers", lambda: claim_layer_variance(full if "layers" in full else quick))]),
        ("dynamickv-layers", "DynamicKV", "Fig. 2: layers need very different budgets",
         [("layers", lambda: claim_layer_budgets(quick))]),
        ("speed", "D2O, all", "D2O Table 5 and all: a 20% cache decodes faster, needs less memory, and costs "
         "little prefill time", [("speed", lambda: claim_speed(fs))]),
    ]]


def measured(quick: dict, full: dict, fs: dict) -> list[tuple]:
    """(anchor, paper, claim, experiment, cell, checks, detail, verdict) for every (claim, experiment); the
    verdict is the paired test's for a `why` row, a count of checks for a seed claim's other rows, else
    verdict(checks)."""
    out = []
    for anchor, paper, claim, parts in rows(quick, full, fs):
        for experiment, measure in parts:
            try:
                cell, checks, detail, *told = measure()
            except Missing as e:
                cell, checks, detail, told = f"not measured yet (no {e} in the results files)", [], "", []
            if not told and anchor in WHY:  # a seed claim: only its paired row gives a verdict
                known = [ok for _, ok in checks if ok is not None]
                told = [f"{sum(known)} of {len(known)} checks go its way (the verdict: the paired row)"]
            out.append((anchor, paper, claim, experiment, cell, checks, detail, told[0] if told else verdict(checks)))
    return out


def claims(quick: dict, full: dict, fs: dict) -> str:
    """docs/evaluation.md: one row per (claim, experiment); the numbers of each below it (`details`)."""
    out = ["| paper: claim | experiment | measured on SmolLM2-135M | holds? |", "|---|---|---|---|"]
    for anchor, paper, claim, experiment, cell, checks, _, told in measured(quick, full, fs):
        shown = verdict_cell(checks) if told == verdict(checks) else told if anchor in WHY and "paired row" in told \
            else f"**{told}**"
        out.append(f"| [{paper}](#{anchor}): {claim} | {experiment} | {cell} | {shown} |")
    return "\n".join(out)


def details(quick: dict, full: dict, fs: dict) -> str:
    """Every number each verdict of `claims` rests on, one section per claim and experiment."""
    out, seen = [], set()
    for anchor, paper, claim, experiment, _, checks, detail, told in measured(quick, full, fs):
        if anchor not in seen:
            out += [f'<a id="{anchor}"></a>', f"#### {paper}: {claim}", ""]
            seen.add(anchor)
        out += [f"*{experiment}*: {told}.", "", detail or "—", ""]
    return "\n".join(out).rstrip()


SEED = {  # the seed papers' headline claims as the README states them, and the rows that decide each (the
    # first names the seed method in WHY)
    "D2O": ("at equal memory, a lower loss than eviction (H2O, RoCo, StreamingLLM) and merging (CaM)",
            ["d2o-streaming", "d2o-roco-cam"]),
    "DBudgetKV": ("with t = 1%, a self-chosen budget that is near-lossless", ["dbudgetkv"]),
    "WeightedKV": ("at equal capacity, streaming perplexity below eviction (StreamingLLM, H2O, TOVA) and CaM's "
                   "merge", ["weightedkv-baselines", "weightedkv-cam"]),
    "DynamicKV": ("layer budgets set per task beat SnapKV's uniform ones at equal memory; most passkey answers at "
                  "small budgets", ["dynamickv", "passkey"]),
}


def readme(quick: dict, full: dict, fs: dict) -> str:
    """README.md: one line per seed paper's headline claim: the paired test's verdict over every rival its
    rows name, and why (the numbers, and the part that accounts for them), from the `why` experiment."""
    out = ["| paper | headline claim | here | why |", "|---|---|---|---|"]
    for paper, (claim, anchors) in SEED.items():
        seed = WHY[anchors[0]][0]
        rivals = list(dict.fromkeys(r for a in anchors if a in WHY for r in WHY[a][1]))
        try:
            rows = need(quick, "why")
            here, cell = why_verdict(rows, seed, rivals), why_cell(rows, seed, rivals)
        except Missing:
            here, cell = "not measured yet", "no why experiment in results/quick/results.json"
        windows = quick.get("sizes", {}).get("why", {}).get("windows")
        more = " Its passkey claim: the detail." if paper == "DynamicKV" else ""
        out.append(f"| {paper} | {claim} | **{here}** ({windows} windows, paired) | {cell}{more} "
                   f"([detail](docs/evaluation.md#{anchors[0]})) |")
    return "\n".join(out)
