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
