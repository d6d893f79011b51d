"""Paired comparisons over windows: is a lower than b in a settled way, and which part of a method is why?

The rows are those of kvmini.eval.why: per window, a seed method, its ablations and its rivals at equal
measured memory. a is compared with b window by window: d_w = KL_a - KL_b. `paired` gives how many windows
a is lower in, an exact two-sided sign test over the windows where they differ, and a 95% bootstrap
interval of the mean d_w. A claim is settled at level ALPHA only by that test ("not settled at this size"
otherwise). No torch: kvmini.eval.docs reads these tables without loading it.
"""
import functools
import math
import random

from kvmini.eval.why import SEEDS

WORDS = 55  # a cell's length, the second part dropped beyond it (the README's cells stay under 60 words)
ALPHA = 0.05  # the sign test's level: with 8 windows only 8 of 8 settles (p = 0.008), with 12 10 of 12 (p = 0.039)


def sign_test(lower: int, higher: int) -> float:
    """Exact two-sided sign test: the chance of a split at least this uneven if each window were a coin flip."""
    n = lower + higher
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lower, higher) + 1)) / 2**n
    return min(1.0, 2 * tail)


@functools.cache  # the documents ask for the same comparisons many times over
def bootstrap(d: tuple[float, ...], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile interval of the mean of d, resampling windows with replacement (a fixed seed)."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(d, k=len(d))) / len(d) for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def paired(a: list[float], b: list[float]) -> dict:
    """a against b, window by window (the same windows in the same order)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired needs one value of each per window, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    lower, higher = sum(x < 0 for x in d), sum(x > 0 for x in d)
    lo, hi = bootstrap(tuple(d))
    return {"windows": len(d), "lower": lower, "higher": higher, "p": sign_test(lower, higher),
            "a": sum(a) / len(a), "b": sum(b) / len(b), "mean_diff": sum(d) / len(d), "interval": (lo, hi)}


def settled(p: dict) -> str:
    """'lower' or 'higher' where the sign test settles it, else 'not settled'."""
    if p["p"] >= ALPHA:
        return "not settled"
    return "lower" if p["lower"] > p["higher"] else "higher"


def kl_of(rows: list[dict], spec: str) -> list[float]:
    """`spec`'s KL in each window ({share} in a spec matches the share written in)."""
    head = spec.split("{")[0]
    return [r["kl"] for r in rows if r["method"] == spec or ("{" in spec and r["method"].startswith(head))]


def rival_kl(rows: list[dict], rival: str, at: str) -> list[float]:
    """`rival`'s KL in each window, run at the share `at` kept there."""
    head = at.split("{")[0]
    return [r["kl"] for r in rows if r["method"] == rival and any(a == at or ("{" in at and a.startswith(head))
                                                                  for a in r.get("at", []))]


def comparisons(rows: list[dict]) -> dict:
    """seed -> {"rivals": {rival: paired(seed, rival at its share)},
                "parts": {switched off: {"spec", "share", "vs_seed": paired(ablation, seed),
                                         "rivals": {rival: paired(ablation, rival at its share)}}}}"""
    out = {}
    for seed, what in SEEDS.items():
        mine = kl_of(rows, seed)
        if not mine:
            continue
        share = lambda spec: [r["kept_share"] for r in rows if r["method"] == spec or  # noqa: E731
                              ("{" in spec and r["method"].startswith(spec.split("{")[0]))]
        out[seed] = {"share": sum(share(seed)) / len(mine),
                     "rivals": {r: paired(mine, rival_kl(rows, r, seed)) for r in what["rivals"]}, "parts": {}}
        for label, spec in what["parts"].items():
            theirs = kl_of(rows, spec)
            out[seed]["parts"][label] = {
                "spec": spec, "share": sum(share(spec)) / len(theirs), "vs_seed": paired(theirs, mine),
                "rivals": {r: paired(theirs, rival_kl(rows, r, spec)) for r in what["rivals"]}}
    return out


def verdict(comp: dict, seed: str, rivals: list[str]) -> str:
    """'holds' where the seed is settled lower than every rival, 'does not hold' where settled higher than
    every rival, 'holds in part' where settled both ways, else 'not settled at this size'."""
    ways = {settled(comp[seed]["rivals"][r]) for r in rivals}
    if ways == {"lower"}:
        return "holds"
    if ways == {"higher"}:
        return "does not hold"
    return "holds in part" if ways == {"lower", "higher"} else "not settled at this size"


def causes(comp: dict, seed: str, helps: bool) -> list[tuple[str, dict]]:
    """The switched-off parts whose effect on KL is settled, in the direction asked (helps: switching it off
    lowers KL), largest mean effect first."""
    found = [(label, x) for label, x in comp[seed]["parts"].items()
             if settled(x["vs_seed"]) == ("lower" if helps else "higher")]
    return sorted(found, key=lambda lx: abs(lx[1]["vs_seed"]["mean_diff"]), reverse=True)


def reason(comp: dict, seed: str, rivals: list[str], name=str) -> str:
    """The verdict's numbers and its cause in a few words (the README's and docs/evaluation.md's cells): the
    part whose switching off moves the seed's KL most in a settled way, and how much of the gap to the best
    rival that closes."""
    c = comp[seed]
    mine = c["rivals"][rivals[0]]["a"] if rivals else next(iter(c["parts"].values()))["vs_seed"]["b"]
    W = next(iter(c["parts"].values()))["vs_seed"]["windows"]
    head = f"KL {mine:.3f} keeping {c['share']:.1%}"
    if rivals:
        ps = [c["rivals"][r] for r in rivals]
        head += (" vs " + ", ".join(f"{name(r)} {p['b']:.3f}" for r, p in zip(rivals, ps)) + " at that share, lower in "
                 + ", ".join(str(p["lower"]) for p in ps) + f" of {W} windows (p " + ", ".join(f"{p['p']:.1g}" for p in ps)
                 + ")")
    losing = verdict(comp, seed, rivals) != "holds" if rivals else True
    found = causes(comp, seed, helps=losing)[:2]
    if not found:
        return f"{head}. No part switched off moves its KL in a settled way."
    side = "lower" if losing else "higher"
    said = [f"{label} (without it KL {x['vs_seed']['a']:.3f}, {side} in {x['vs_seed'][side]} of {W}, p "
            f"{x['vs_seed']['p']:.1g})" for label, x in found]
    best = min((c["rivals"][r]["b"] for r in rivals), default=None)
    if losing and best is not None and mine > best:  # how much of the gap the first part accounts for
        closed = (mine - found[0][1]["vs_seed"]["a"]) / (mine - best)
        said[0] = said[0][:-1] + f"; {min(closed, 1):.0%} of the gap to the best rival)"
    cell = f"{head}. {'What costs it' if losing else 'What it rests on'}: " + "; ".join(said) + "."
    return cell if len(cell.split()) <= WORDS or len(said) == 1 else cell.rsplit("; ", 1)[0].rstrip(")") + ")."


def near_lossless(rows: list[dict], seed: str, tolerance: float = 0.01) -> dict:
    """DBudgetKV's claim window by window: perplexity within `tolerance` of the full cache's, a sign test
    over the windows (within against beyond)."""
    full = {r["window"]: r["ppl"] for r in rows if r["method"] == "full"}
    ratio = [r["ppl"] / full[r["window"]] for r in rows if r["method"] == seed]
    within = sum(x <= 1 + tolerance for x in ratio)
    return {"windows": len(ratio), "within": within, "p": sign_test(within, len(ratio) - within),
            "worst": max(ratio), "mean": sum(ratio) / len(ratio)}


def table(rows: list[dict], name=str, seeds=None) -> str:
    """Markdown: each seed (of `seeds`, default all) against its rivals at equal memory, then each part
    switched off against the seed."""
    comp = {s: c for s, c in comparisons(rows).items() if seeds is None or s in seeds}
    W = len({r["window"] for r in rows})
    show = lambda p: (f"{p['a']:.3f} | {p['b']:.3f} | {p['lower']} of {p['windows']} | {p['p']:.2g} | "  # noqa: E731
                      f"{p['mean_diff']:+.3f} [{p['interval'][0]:+.3f}, {p['interval'][1]:+.3f}] | {settled(p)} |")
    out = [f"KL(full ‖ method) over {W} windows; a paired by window with b (sign test, 95% bootstrap interval of the "
           "mean difference a − b).", "",
           "| a | kept | b (at a's share) | KL a | KL b | a lower in | sign test p | a − b [95%] | settled |",
           "|---|---|---|---|---|---|---|---|---|"]
    for seed, c in comp.items():
        out += [f"| {name(seed)} | {c['share']:.1%} | {name(r)} | " + show(p) for r, p in c["rivals"].items()]
        for label, x in c["parts"].items():
            out.append(f"| {name(seed)} without {label} (`{x['spec']}`) | {x['share']:.1%} | {name(seed)} | "
                       + show(x["vs_seed"]))
            out += [f"| ↳ the same | {x['share']:.1%} | {name(r)} | " + show(p) for r, p in x["rivals"].items()]
    return "\n".join(out)
