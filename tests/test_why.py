"""The `why` experiment (kvmini/eval/why.py) and its paired comparisons (kvmini/eval/paired.py): the sign
test and bootstrap by hand, the pairing of rows by window and by the share a rival was run at, the verdict
words, and equal memory on a real run."""
import pytest
import torch

from kvmini.eval import paired, why
from reference import random_model


def test_sign_test_by_hand():
    """Two-sided: 2 * P(X <= min) for X ~ Binomial(n, 1/2); windows that tie are left out before."""
    assert paired.sign_test(8, 0) == pytest.approx(2 / 256)  # 0.0078: 8 of 8 settles at 5%
    assert paired.sign_test(1, 7) == pytest.approx(2 * (1 + 8) / 256)  # 0.070: 7 of 8 does not
    assert paired.sign_test(4, 4) == 1.0
    assert paired.sign_test(0, 0) == 1.0
    assert paired.sign_test(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096)


def test_bootstrap_interval():
    assert paired.bootstrap((0.25,) * 8) == (0.25, 0.25)
    lo, hi = paired.bootstrap((1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0))
    assert 1.0 <= lo < 4.5 < hi <= 8.0  # about the mean, inside the sample's range
    first = paired.bootstrap((1.0, 2.0, 3.0))
    paired.bootstrap.cache_clear()  # drawn again, not remembered
    assert paired.bootstrap((1.0, 2.0, 3.0)) == first  # a fixed seed: the same each run


def test_paired_by_hand():
    p = paired.paired([0.1, 0.2, 0.3, 0.4], [0.2, 0.1, 0.5, 0.6])  # differences -0.1, +0.1, -0.2, -0.2
    assert (p["lower"], p["higher"], p["windows"]) == (3, 1, 4)
    assert p["mean_diff"] == pytest.approx(-0.1)
    assert p["p"] == pytest.approx(2 * 5 / 16)
    assert paired.settled(p) == "not settled"
    assert paired.settled(paired.paired([0.1] * 8, [0.2] * 8)) == "lower"
    assert paired.settled(paired.paired([0.3] * 8, [0.2] * 8)) == "higher"
    with pytest.raises(ValueError, match="one value of each per window, got 8 and 7"):
        paired.paired([0.3] * 8, [0.2] * 7)  # a window without its rival is never paired with another


def rows_of(kls: dict, shares: dict, at: dict, windows: int) -> list[dict]:
    """Hand-made rows: kls[spec] a KL per window; rivals carry `at` (the specs whose share they were run at)."""
    out = []
    for w in range(windows):
        out.append({"window": w, "method": "full", "budget": None, "kl": 0.0, "ppl": 10.0, "kept_share": 1.0})
        for (spec, b), kl in kls.items():
            row = {"window": w, "method": spec, "budget": b, "kl": kl[w], "ppl": 10.0 * (1 + kl[w]),
                   "kept_share": shares[spec]}
            if (spec, b) in at:
                row["at"] = at[(spec, b)]
            out.append(row)
    return out


def test_comparisons_pair_each_rival_at_the_share_it_matches():
    """WeightedKV (20%) and its ablation (20%) share one H2O run; each gets its own pairs."""
    W = 8
    seed, off = "weightedkv", "weightedkv[value_merge=off]"
    kls = {(seed, 0.2): [0.2] * W, (off, 0.2): [0.1] * W, ("h2o", 0.2): [0.15] * W,
           ("streaming_llm", 0.2): [0.3] * W, ("tova", 0.2): [0.3] * W, ("cam", 0.2): [0.3] * W}
    shares = {s: 0.2 for s, _ in kls}
    at = {(r, 0.2): [seed, off] for r in ("h2o", "streaming_llm", "tova", "cam")}
    comp = paired.comparisons(rows_of(kls, shares, at, W))
    assert set(comp) == {"weightedkv"}
    c = comp["weightedkv"]
    assert (c["rivals"]["h2o"]["a"], c["rivals"]["h2o"]["b"], c["rivals"]["h2o"]["higher"]) == (pytest.approx(0.2), 0.15, 8)
    part = c["parts"]["the value merge"]
    assert (part["vs_seed"]["lower"], part["rivals"]["h2o"]["lower"]) == (8, 8)
    assert paired.verdict(comp, "weightedkv", ["h2o"]) == "does not hold"
    assert paired.verdict(comp, "weightedkv", ["streaming_llm", "tova"]) == "holds"
    assert paired.verdict(comp, "weightedkv", ["h2o", "cam"]) == "holds in part"
    cell = paired.reason(comp, "weightedkv", ["h2o"])
    assert "What costs it: the value merge (without it KL 0.100, lower in 8 of 8, p 0.008; 100% of the gap" in cell
    assert len(cell.split()) <= 60


def test_a_split_that_a_sign_test_cannot_tell_is_not_settled():
    W = 8
    seed, off = "weightedkv", "weightedkv[value_merge=off]"
    kls = {(seed, 0.2): [0.2] * W, (off, 0.2): [0.1, 0.3] * 4, ("h2o", 0.2): [0.1] * 6 + [0.3] * 2}
    for r in ("streaming_llm", "tova", "cam"):
        kls[(r, 0.2)] = [0.3] * W
    comp = paired.comparisons(rows_of(kls, {s: 0.2 for s, _ in kls}, {(r, 0.2): [seed, off] for r, _ in
                                                                  list(kls)[2:]}, W))
    assert paired.verdict(comp, seed, ["h2o"]) == "not settled at this size"  # 2 of 8 lower: p = 0.29
    assert "No part switched off moves its KL in a settled way" in paired.reason(comp, seed, ["h2o"])


def test_dbudgetkv_ablation_is_found_by_the_share_written_in():
    W = 8
    rows = []
    for w in range(W):
        share = 0.3 + 0.01 * w  # its rule chooses another share in every window
        rows += [{"window": w, "method": "full", "budget": None, "kl": 0.0, "ppl": 10.0, "kept_share": 1.0},
                 {"window": w, "method": "dbudgetkv", "budget": None, "kl": 0.2, "ppl": 10.5, "kept_share": share},
                 {"window": w, "method": f"dbudgetkv[fixed_share={share:.4f}]", "budget": None, "kl": 0.1,
                  "ppl": 10.2, "kept_share": share},
                 {"window": w, "method": "snapkv", "budget": round(share, 4), "kl": 0.05, "ppl": 10.1,
                  "kept_share": share, "at": ["dbudgetkv", f"dbudgetkv[fixed_share={share:.4f}]"]}]
    c = paired.comparisons(rows)["dbudgetkv"]
    assert c["parts"]["the stopping rule"]["vs_seed"]["lower"] == 8
    assert c["rivals"]["snapkv"]["windows"] == 8
    x = paired.near_lossless(rows, "dbudgetkv")
    assert (x["within"], x["windows"], x["worst"]) == (0, 8, pytest.approx(1.05))


def test_every_comparison_is_at_equal_measured_memory():
    """On a small random model, two seeds, their ablations and their rivals: each rival row kept the share of
    every spec it is paired with (within SAME), and each rival ran once per distinct share. (A budget of
    40 tokens: SnapKV's window of 32 fits in it, as it does at the suite's sizes.)"""
    model = random_model(L=4)
    ids = torch.randint(0, 61, (1, 166), generator=torch.Generator().manual_seed(0))
    rows = why.run_window(model, ids, 160, 0.25, ["d2o", "dbudgetkv"], log=lambda m: None)  # several shares; {share}
    share = {r["method"]: r["kept_share"] for r in rows if "at" not in r}
    ran = {r["method"] for r in rows}
    for seed, what in ((s, why.SEEDS[s]) for s in ("d2o", "dbudgetkv")):
        assert seed in ran and all(any(m.startswith(s.split("{")[0]) for m in ran) for s in what["parts"].values())
    rivals = [r for r in rows if "at" in r]
    assert rivals
    for r in rivals:
        for spec in r["at"]:
            assert abs(r["kept_share"] - share[spec]) <= why.SAME, (r["method"], spec)
    for name in {r["method"] for r in rivals}:
        budgets = sorted(r["budget"] for r in rivals if r["method"] == name)
        assert all(b - a > why.SAME for a, b in zip(budgets, budgets[1:]))
