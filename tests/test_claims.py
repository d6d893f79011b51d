"""The verdicts of docs/evaluation.md's claims table (kvmini/eval/claims.py): reading a rival off its
frontier at a measured share, the verdict words, and comparisons made at equal measured memory rather
than at equal nominal budget. Expected values are worked by hand from the made-up rows."""
import math

import pytest

from kvmini.eval import claims


def test_at_share_reads_a_frontier_between_its_points():
    pts = [(0.1, 0.4), (0.3, 0.1), (0.5, 0.05)]
    assert claims.at_share(pts, 0.2) == pytest.approx(0.25)  # halfway: (0.4 + 0.1) / 2
    assert claims.at_share(pts, 0.2, log=True) == pytest.approx(0.2)  # halfway in log: sqrt(0.4 * 0.1)
    assert claims.at_share(pts, 0.4, log=True) == pytest.approx(math.sqrt(0.1 * 0.05))
    assert claims.at_share(pts, 0.303) == 0.1  # within half a point: that point as it is
    assert claims.at_share(pts, 0.05) is None and claims.at_share(pts, 0.6) is None  # outside: unknown
    assert claims.at_share([(256, 12.0)], 256.4, same=0.5) == 12.0


def test_verdict_words():
    assert claims.verdict([("a", True), ("b", True)]) == "holds"
    assert claims.verdict([("a", False), ("b", None)]) == "does not hold here"
    assert claims.verdict([("a", True), ("b", False)]) == "holds in part"
    assert claims.verdict([("a", None)]) == "no verdict"
    assert claims.verdict_cell([("x 20%", True), ("x 30%", False)]) == "**holds in part** (yes: x 20%; no: x 30%)"
    many = [(str(i), i < 2) for i in range(6)] + [("z", None)]
    assert claims.verdict_cell(many) == "**holds in part** (2 of 6 yes; 1 not comparable at equal memory)"


def fidelity_rows(points):
    """One prompt: (method, budget, kept share, KL) -> the fidelity experiment's rows."""
    full = [{"prompt": 0, "method": "full", "budget": None, "ppl": 10.0, "kl": 0.0, "top1": 1.0, "kept_share": 1.0}]
    return full + [{"prompt": 0, "method": m, "budget": b, "ppl": 11.0, "kl": kl, "top1": 0.9, "kept_share": s}
                   for m, b, s, kl in points]


def test_a_method_that_keeps_more_than_its_budget_meets_its_rival_at_the_share_it_kept():
    """At a nominal 20% D2O keeps 30% (protected layers): against RoCo at 20% it would win (0.05 < 0.06),
    but RoCo at 30%, what D2O really kept, has KL 0.04: not lower. Its 10% point keeps 10%: compared
    as it is (0.07 < 0.08: lower)."""
    quick = {"sizes": {"fidelity": {"n": 8, "k": 2}}, "fidelity": fidelity_rows([
        ("d2o", 0.1, 0.10, 0.07), ("d2o", 0.2, 0.30, 0.05),
        ("roco", 0.1, 0.10, 0.08), ("roco", 0.2, 0.20, 0.06), ("roco", 0.3, 0.30, 0.04)])}
    cell, checks, detail = claims.claim_fidelity_pair([("quick", quick)], "d2o", "roco")
    assert checks == [("quick 10%", True), ("quick 20%", False)]
    assert "KL 0.050 keeping 30.0% vs 0.040" in cell
    # a share beyond the rival's measured budgets decides nothing
    quick["fidelity"] = fidelity_rows([("d2o", 0.2, 0.30, 0.05), ("roco", 0.1, 0.10, 0.08), ("roco", 0.2, 0.20, 0.06)])
    assert claims.claim_fidelity_pair([("quick", quick)], "d2o", "roco")[1] == [("quick 20%", None)]


def streaming_rows(points):
    return [{"capacity": c, "method": m, "tokens": 100, "ppl": p, "held": h} for c, m, h, p in points]


def test_streaming_compares_at_the_entries_held():
    """D2O at capacity 256 held 512 entries per layer; H2O, held 256 and 1,024 at capacities 256 and
    1,024, is read at 512 between them, in log held and log perplexity: 512 is their geometric midpoint,
    so H2O's perplexity there is sqrt(14 * 11) = 12.41, below D2O's 12.5 (at nominal 256 it was 14)."""
    full = {"streaming": streaming_rows([(256, "d2o", 512.0, 12.5), (256, "h2o", 256.0, 14.0),
                                         (1024, "h2o", 1024.0, 11.0)])}
    cell, checks, detail = claims.claim_streaming([("full", full)], "d2o", ["h2o"])
    assert checks == [("full 256", False)]
    assert f"H2O {math.sqrt(14 * 11):.2f}" in cell and "holding 512" in cell
    # with one capacity measured, a method that held more than it has no rival at its size
    quick = {"streaming": streaming_rows([(256, "d2o", 512.0, 12.5), (256, "h2o", 256.0, 14.0)])}
    assert claims.claim_streaming([("quick", quick)], "d2o", ["h2o"])[1] == [("quick 256", None)]
    # rows measured before `held` was recorded compare nothing
    old = {"streaming": [{"capacity": 256, "method": m, "tokens": 100, "ppl": p} for m, p in (("d2o", 12.5), ("h2o", 14.0))]}
    assert claims.claim_streaming([("full", old)], "d2o", ["h2o"])[1] == [("full 256", None)]


def test_passkey_pairs_compare_at_the_share_kept():
    """On 200-token prompts D2O at 20% kept 60 entries per layer (30%) and answered 2 of 3; RoCo kept
    40 (20%) and 80 (40%) and answered 1 and 3: at 30%, halfway, 2 answers: not more. At 10% both
    kept 20 (10%): 1 > 0."""
    rows = [{"method": "full", "budget": None, "kept": 200.0, "prompt_tokens": 200, "correct": True}] * 3
    for m, b, kept, right in (("d2o", 0.1, 20.0, 1), ("d2o", 0.2, 60.0, 2), ("roco", 0.1, 20.0, 0),
                              ("roco", 0.2, 40.0, 1), ("roco", 0.4, 80.0, 3)):
        rows += [{"method": m, "budget": b, "kept": kept, "prompt_tokens": 200, "correct": i < right} for i in range(3)]
    cell, checks, _ = claims.claim_passkey_pair({"passkey": rows}, "d2o", "roco")
    assert checks == [("passkey 10%", True), ("passkey 20%", False)]
    assert "20% 2 vs 2.0" in cell


def why_rows(windows: int, d2o_kl: list[float], h2o_kl: list[float], off_kl: list[float]) -> list[dict]:
    """Made-up `why` rows: D2O (28% kept), its ablations, and each rival at D2O's share."""
    from kvmini.eval.why import SEEDS

    rows = []
    for w in range(windows):
        rows.append({"window": w, "method": "full", "budget": None, "kl": 0.0, "ppl": 10.0, "kept_share": 1.0})
        rows.append({"window": w, "method": "d2o", "budget": 0.2, "kl": d2o_kl[w], "ppl": 11.0, "kept_share": 0.28})
        for spec in SEEDS["d2o"]["parts"].values():
            kl = off_kl[w] if spec == "d2o[merge=off]" else d2o_kl[w]
            rows.append({"window": w, "method": spec, "budget": 0.2, "kl": kl, "ppl": 11.0, "kept_share": 0.28})
        for rival in SEEDS["d2o"]["rivals"]:
            kl = h2o_kl[w] if rival == "h2o" else 0.9
            rows.append({"window": w, "method": rival, "budget": 0.28, "kl": kl, "ppl": 11.0, "kept_share": 0.28,
                         "at": ["d2o", *SEEDS["d2o"]["parts"].values()]})
    return rows


def test_a_seed_claims_why_row_takes_the_sign_tests_verdict_and_names_its_cause():
    """H2O lower than D2O in all 12 windows: 'does not hold' against H2O; StreamingLLM (0.9) above it in all:
    'holds' against that one; both: 'holds in part'. Switching the merge off lowers D2O's KL in every window:
    the cause. With H2O lower in only 9 of 12 (p = 0.15): 'not settled at this size'."""
    W = 12
    quick = {"sizes": {"why": {"windows": W}}, "why": why_rows(W, [0.3] * W, [0.1] * W, [0.12] * W)}
    cell, checks, detail, told = claims.claim_why(quick, "d2o-streaming")
    assert told == "holds in part" and checks == [("H2O", False), ("StreamingLLM", True)]
    assert "What costs it: the merge (without it KL 0.120, lower in 12 of 12, p 0.0005; 90% of the gap" in cell
    assert len(cell.split()) <= 60
    assert claims.why_verdict(quick["why"], "d2o", ["h2o"]) == "does not hold"
    split = why_rows(W, [0.3] * W, [0.1] * 9 + [0.5] * 3, [0.12] * W)
    assert claims.why_verdict(split, "d2o", ["h2o"]) == "not settled at this size"
    table = claims.claims(quick, {}, {})
    assert "| [D2O](#d2o-streaming): " in table and "| why: 12 windows, paired | " in table


def test_the_readme_cells_of_the_committed_results_stay_short():
    """Each seed claim's 'why' cell in the README is at most 60 words (issue 58)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    load = lambda p: json.loads((root / p).read_text())  # noqa: E731
    table = claims.readme(load("results/quick/results.json"), load("results/full/results.json"),
                          load("results/full-speed/results.json"))
    for line in table.splitlines()[2:]:
        why_cell = line.split(" | ")[3]
        assert len(why_cell.split("([detail]")[0].split()) <= 60, line
        assert line.split(" | ")[2].split("**")[1] in ("holds", "does not hold", "holds in part",
                                                        "not settled at this size")
