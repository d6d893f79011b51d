"""The evaluation harness: task generation, scoring and metric math on tiny models; one smoke run
of the whole suite on the default model."""
import json
import math
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

from kvmini.errors import KvminiError
from kvmini.eval import layers, passkey, plots, speed, streaming, suite
from kvmini.eval.summary import summary
from kvmini.methods.registry import make_policy
from reference import random_model


# --- streaming perplexity ----------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_streaming_nll_of_the_full_cache_equals_one_forward(chunk):
    model = random_model(seed=1)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, all_logits=True)[0]  # (40, V)
    want = F.cross_entropy(logits[11:39], ids[0, 12:40], reduction="none")  # tokens 12..39: after P = 2 * 6
    torch.testing.assert_close(streaming.stream_nll(model, ids, 6, None, chunk), want, atol=1e-5, rtol=0)
    roomy = make_policy("h2o", 1000)  # a capacity above the text: nothing is ever evicted
    torch.testing.assert_close(streaming.stream_nll(model, ids, 6, roomy, chunk), want, atol=1e-5, rtol=0)


def test_streaming_holds_the_capacity_and_scores_every_later_token():
    model = random_model(seed=2)
    ids = torch.randint(0, 61, (1, 50), generator=torch.Generator().manual_seed(1))
    rows = streaming.run(model, ids, [8], methods=("full", "h2o", "d2o"), chunk=4, log=lambda m: None)
    assert [r["tokens"] for r in rows] == [34, 34, 34]  # 50 - 2 * 8
    assert rows[0]["ppl"] != rows[1]["ppl"] and all(math.isfinite(r["ppl"]) for r in rows)
    # entries held per layer before each chunk (starts 16, 20, ..., 48): the full cache all it read, a
    # mean of 32; H2O its capacity, 8, in every layer
    assert rows[0]["held"] == 32.0 and rows[1]["held"] == 8.0


def test_cumulative_curve_by_hand():
    assert streaming.curve(torch.tensor([1.0, 2, 3, 4]), points=4) == [1.0, 1.5, 2.0, 2.5]
    assert streaming.curve(torch.tensor([1.0, 2, 3, 4]), points=2) == [1.0, 2.5]  # first and last token


# --- passkey ------------------------------------------------------------------------------------

class WordTokenizer:
    """One id per whitespace-separated word (enough to count lengths and find the needle)."""

    def encode(self, text):
        return [zlib.crc32(w.encode()) % 61 for w in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def test_passkey_prompt_places_the_needle_at_its_depth_and_length():
    tok = WordTokenizer()
    words_per_unit = len(passkey.FILLER.split())
    for depth in (0.0, 0.5, 1.0):
        for length in (300, 1000):
            ids = passkey.passkey_prompt(tok, None, length, depth, 12345)
            assert abs(len(ids) - length) <= words_per_unit  # within one filler unit of the target
    # the needle's word offset grows with depth: depth 0 first, depth 1 right before the question
    text_ids = {d: passkey.passkey_prompt(tok, None, 600, d, 12345) for d in (0.0, 0.5, 1.0)}
    needle = tok.encode(passkey.needle(12345))
    where = {d: next(i for i in range(len(t)) if t[i : i + len(needle)] == needle) for d, t in text_ids.items()}
    assert where[0.0] == 0 and where[0.0] < where[0.5] < where[1.0]
    question_and_start = len(tok.encode(passkey.QUESTION + "\n" + passkey.ANSWER_START))
    assert where[1.0] + len(needle) + question_and_start == len(text_ids[1.0])


def test_answers_are_scored_by_their_first_number():
    assert passkey.answer_is(" 48213.", 48213)
    assert passkey.answer_is("48213. The passkey is 48213.", 48213)
    assert not passkey.answer_is("482.", 48213)  # a prefix of the key is wrong
    assert not passkey.answer_is("12, then 48213", 48213)
    assert not passkey.answer_is("", 48213)


def test_keys_are_five_digits_and_repeatable():
    cells = [(1000, 0.5)] * 20
    keys = passkey.keys_for(cells, seed=3)
    assert keys == passkey.keys_for(cells, seed=3) and all(10_000 <= k < 100_000 for k in keys)


def test_passkey_run_rows_and_accuracy():
    model = random_model(seed=3)
    rows = passkey.run(model, WordTokenizer(), None, [("full", None), ("h2o", 16)], [60, 90], [0.0, 1.0], set(),
                       log=lambda m: None)
    assert len(rows) == 8 and {r["method"] for r in rows} == {"full", "h2o"}
    assert all(r["kept"] <= 16 + 10 for r in rows if r["method"] == "h2o")
    rows[0]["correct"], rows[1]["correct"] = True, True  # 2 of full's 4 cells
    acc = passkey.accuracy(rows)
    assert acc[("full", None)] == 0.5 + sum(r["correct"] for r in rows[2:4]) / 4


# --- layers -------------------------------------------------------------------------------------

def test_density_map_and_statistics_agree_with_each_other():
    """The map (projections + a naive matmul) and the statistics (the attention pass) are computed
    by different code; the sink share is linear, so the map's column sums must give it."""
    model = random_model(seed=4, L=3)
    n = 24
    ids = torch.randint(0, 61, (1, n), generator=torch.Generator().manual_seed(2))
    stats = layers.layer_statistics(model, ids, sinks=4)
    for layer in range(3):
        grid = torch.tensor(layers.density_map(model, ids, layer, bins=n))  # (n, n), no pooling
        torch.testing.assert_close(grid.sum(1), torch.ones(n), atol=1e-5, rtol=0)  # rows are distributions
        assert grid.triu(1).abs().max() == 0  # causal
        assert abs(grid.sum(0)[:4].sum().item() / n - stats[layer]["sink_share"]) < 1e-5
        assert 0.1 <= stats[layer]["top10_share"] <= 1 and stats[layer]["variance"] >= 0
    pooled = torch.tensor(layers.density_map(model, ids, 0, bins=4))  # 6 x 6 blocks, averaged
    torch.testing.assert_close(pooled.sum(1), torch.full((4,), 4 / n), atol=1e-5, rtol=0)  # each row: 1/6


def test_retention_totals():
    model = random_model(seed=5, L=4)
    ids = torch.randint(0, 61, (1, 80), generator=torch.Generator().manual_seed(3))
    kept = layers.retention(model, ids, 0.5, methods=("pyramidkv", "d2o[variant=paper]", "dynamickv", "dbudgetkv", "d2o"))
    assert sum(kept["d2o[variant=paper]"]) == sum(kept["pyramidkv"]) == sum(kept["dynamickv"]) == 4 * 40
    assert max(kept["d2o"]) == 81  # the official variant protects layers 0, 1, L-1: the prompt + the first step
    assert all(k <= 80 for k in kept["dbudgetkv"]) and kept["dbudgetkv"][:2] == [80, 80]  # protected layers


# --- speed ----------------------------------------------------------------------------------------

def test_speed_ratios_are_relative_to_the_full_cache():
    model = random_model(seed=6)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(4))
    pre = speed.prefill_times(model, ids, ["h2o", "dbudgetkv"], 0.25, reps=2, log=lambda m: None)
    assert pre["full"]["ratio"] == 1.0 and pre["full"]["kept_bytes_ratio"] == 1.0
    assert pre["h2o"]["kept_bytes_ratio"] == 0.25 and pre["h2o"]["ratio"] > 0
    dec = speed.decode_speed(model, ids, ["h2o", "weightedkv", "snapkv"], 0.25, steps=3, rounds=2, log=lambda m: None)
    assert dec["full"]["ratio"] == 1.0 and dec["h2o"]["tokens_per_s"] > 0
    # every decode step runs the method's own code, layer by layer: its hooks' ops counted, none for SnapKV's
    assert dec["h2o"]["ops_per_step"] > 0 and dec["weightedkv"]["ops_per_step"] > 0 and dec["snapkv"]["ops_per_step"] == 0
    assert not any("joint_speedup" in d for d in dec.values())
    # every round of every run is recorded; the median round gives tokens/s
    assert all(len(dec[m]["rounds_s"]) == 2 for m in ("full", "h2o", "snapkv", "weightedkv"))
    assert dec["h2o"]["tokens_per_s"] == pytest.approx(3 / (sum(dec["h2o"]["rounds_s"]) / 2))


def test_decode_speed_stays_within_the_sequence_it_promised(monkeypatch):
    """Every cache of `decode_speed` holds at most `decode_length` tokens,
    the length each policy is told the run ends at (and the suite checks against the model's context)."""
    model = random_model(seed=6)
    ids = torch.randint(0, 61, (1, 30), generator=torch.Generator().manual_seed(4))
    seen, forward = [], type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, x, cache, policy=None, **kw:
                        seen.append(cache.seen_tokens + x.shape[1]) or forward(self, x, cache, policy, **kw))
    speed.decode_speed(model, ids, ["h2o"], 0.25, steps=3, rounds=2, log=lambda m: None)
    assert max(seen) == speed.decode_length(30, 3, 2) == 30 + 1 + 3 * 2 + 1


def test_a_timed_policy_forks():
    """`kvmini.generate.fork` deep-copies a run; a timed policy (`speed.Timed`) is copied with it, its own."""
    from kvmini.generate import fork
    model, timed = random_model(seed=6), speed._policy("h2o", 0.5)
    cache = model.new_cache(1, 16)
    ids = torch.randint(0, 61, (1, 8), generator=torch.Generator().manual_seed(4))
    from kvmini.generate import prefill
    prefill(model, ids, cache, timed, total_len=16)
    cache2, timed2 = fork(cache, timed)
    assert isinstance(timed2, speed.Timed) and timed2.policy is not timed.policy and timed2.seconds == timed.seconds
    model(ids[:, :1], cache2, timed2)
    assert cache2.seen_tokens == 9 and cache.seen_tokens == 8


def test_of_snapkv_pairs_the_rounds():
    """decode / SnapKV's: the median over rounds of SnapKV's round over the method's, worked by hand:
    SnapKV [1.0, 2.0, 1.0] s and the method [1.25, 2.0, 1.1] s -> 0.8, 1.0, 0.909... -> 0.909...;
    results without rounds: the ratio of the ratios to the full cache. The table's cell adds the lowest and
    highest round, 0.80 and 1.00; one round (or none) has no range to show."""
    from kvmini.eval.tables import of_snapkv, of_snapkv_cell
    assert of_snapkv({"rounds_s": [1.25, 2.0, 1.1]}, {"rounds_s": [1.0, 2.0, 1.0]}) == pytest.approx(1 / 1.1)
    assert of_snapkv({"ratio": 1.2}, {"ratio": 1.5}) == pytest.approx(0.8)
    assert of_snapkv_cell({"rounds_s": [1.25, 2.0, 1.1]}, {"rounds_s": [1.0, 2.0, 1.0]}) == "0.91 (0.80–1.00)"
    assert of_snapkv_cell({"rounds_s": [1.25]}, {"rounds_s": [1.0]}) == "0.80"
    assert of_snapkv_cell({"ratio": 1.2}, {"ratio": 1.5}) == "0.80"
    # a method measured alone in a later run: its rounds are not SnapKV's rounds' pairs (issue 78)
    later = {"rounds_s": [4.0, 4.0], "ratio": 1.2, "run": "2"}
    assert of_snapkv_cell(later, {"rounds_s": [1.0, 1.0], "ratio": 1.5, "run": "1"}) == "0.80"


def test_parts_table_adds_one_part_per_rung():
    """parts_speed's table, worked by hand (4 steps a round). SnapKV [0.40, 0.40, 0.44] s; H2O [0.42, 0.41,
    0.46]: extra 0.02, 0.01, 0.02 s -> median 0.02 / 4 steps = +5 ms, over SnapKV's 0.952, 0.976, 0.957 ->
    0.96 (0.95–0.98); the next rung [0.44, 0.43, 0.48]: +10 ms, of which its part +5 ms, 0.909, 0.930, 0.917 ->
    0.92 (0.91–0.93);
    hooks: policy ms per step minus SnapKV's 0.25."""
    from kvmini.eval.tables import parts_table

    run = lambda rounds, policy: {"rounds_s": rounds, "policy_ms_per_step": policy, "tokens_per_s": 10.0}  # noqa: E731
    res = {"parts_speed": {"budget": 0.2, "decode_n": 64, "steps": 4, "rounds": 3,
                           "ladders": {"d2o": [["H2O rung", "h2o"], ["+ budgets", "d2o[merge=off]"]]},
                           "kept_bytes_ratio": {"snapkv": 0.2, "h2o": 0.2, "d2o[merge=off]": 0.275},
                           "decode": {"snapkv": run([0.40, 0.40, 0.44], 0.25), "h2o": run([0.42, 0.41, 0.46], 1.25),
                                      "d2o[merge=off]": run([0.44, 0.43, 0.48], 2.75)}}}
    table = parts_table(res)
    assert "SnapKV decodes 10.0 tokens/s (100.0 ms per step)" in table
    assert "| D2O (official) | H2O rung | 0.96 (0.95–0.98) | +5.00 | — | +1.00 | 0.200 |" in table
    assert "|  | + budgets | 0.92 (0.91–0.93) | +10.00 | +5.00 | +2.50 | 0.275 |" in table
    assert "## Where D2O's decode step goes" in summary({"profile": "quick", "device": "cpu", **res})



def test_first_step_profile_names_where_the_time_goes(default_model_dir):
    """`python -m kvmini.eval.speed --first-step METHOD --n N`: D2O's official variant compresses the prompt
    at its first decode step; the profile says how long the step took, how much of the cache it left, and
    which tensor operations took the time, largest first."""
    out = subprocess.run([sys.executable, "-m", "kvmini.eval.speed", "--first-step", "d2o", "--n", "96",
                          "--model", str(default_model_dir)], capture_output=True, text=True, check=True).stdout
    head, columns, *rows = [line for line in out.splitlines() if line.strip()]
    assert head.startswith("d2o: first decode step after 96 tokens at budget 0.2: ")
    assert 0 < float(head.split("cache ")[1].split(" of the full")[0]) < 1  # it compressed there
    assert columns.split() == ["operation", "self", "CPU", "share", "calls", "input", "shapes"] and len(rows) == 8
    seconds = [float(row.split()[1]) for row in rows]
    assert all(row.startswith("aten::") for row in rows) and seconds == sorted(seconds, reverse=True)


def test_step_profile_of_later_decode_steps(default_model_dir):
    """`--step METHOD --n N --after K --steps S`: S decode steps after K untimed ones, per step; the policy's
    share is named; a sequence past the model's context, or a count below 1, is a one-line error (exit 2)."""
    run = lambda *args: subprocess.run([sys.executable, "-m", "kvmini.eval.speed", *args, "--model", str(default_model_dir)],  # noqa: E731
                                       capture_output=True, text=True)
    done = run("--step", "d2o", "--n", "96", "--after", "2", "--steps", "2")
    assert done.returncode == 0, done.stderr
    head, columns, *rows = [line for line in done.stdout.splitlines() if line.strip()]
    assert head.startswith("d2o: decode steps 3 to 4 after 96 tokens at budget 0.2: ")
    assert float(head.split(" ms of it in the policy")[0].split(", ")[-1]) > 0 and len(rows) == 8
    for args in (("--steps", "0"), ("--n", "8190", "--after", "16")):
        bad = run("--step", "h2o", *(("--n", "96") if "--n" not in args else ()), *args)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr

# --- outputs --------------------------------------------------------------------------------------

FAKE = {
    "profile": "quick", "device": "cpu",
    "streaming": [{"capacity": 8, "method": m, "tokens": 10, "ppl": p, "held": h, "curve": [2.0, 2.2, 2.3], "seconds": 1}
                  for m, p, h in (("full", 9.0, 12.0), ("h2o", 11.0, 8.0))],
    "passkey": [{"method": m, "budget": b, "length": n, "depth": d, "correct": m == "full" or d == 0.0}
                for m, b in (("full", None), ("h2o", 64)) for n in (1000, 2000) for d in (0.0, 1.0)],
    "fidelity": [{"prompt": i, "method": m, "budget": b, "ppl": p + i, "kl": kl, "top1": 0.9, "kept_share": s,
                  "kept_per_layer": [5, 6]} for i in range(2)
                 for m, b, p, kl, s in (("full", None, 9.0, 0.0, 1.0), ("dbudgetkv", None, 10.0, 0.3, 0.4))],
    "layers": {"n": 16, "budget": 0.5, "statistics": [{"layer": 0, "variance": 0.5, "top10_share": 0.3,
                                                          "sink_share": 0.2}],
               "density_maps": {0: [[1.0, 0.0], [0.5, 0.5]]}, "retention": {"d2o": [8]}},
    "speed": {"budget": 0.2, "prefill_n": 16, "decode_n": 16, "peak_n": 16, "steps": 4, "rounds": 2,
              "prefill": {"full": {"seconds": 1.0, "ratio": 1.0, "kept_bytes_ratio": 1.0},
                          "h2o": {"seconds": 1.2, "ratio": 1.2, "policy_s": 0.05, "kept_bytes_ratio": 0.2},
                          "snapkv": {"seconds": 1.1, "ratio": 1.1, "policy_s": 0.04, "kept_bytes_ratio": 0.2}},
              "decode": {"full": {"tokens_per_s": 10.0, "ratio": 1.0, "rounds_s": [0.4, 0.4]},
                         "h2o": {"tokens_per_s": 15.0, "ratio": 1.5, "policy_ms_per_step": 2.5, "first_step_s": 0.25,
                                 "policy_share": 0.0375, "ops_per_step": 91, "layer_by_layer_tokens_per_s": 12.0,
                                 "layer_by_layer_policy_ms_per_step": 5.0, "layer_by_layer_ops_per_step": 1350,
                                 "joint_speedup": 1.25, "rounds_s": [0.28, 0.26]},
                         "snapkv": {"tokens_per_s": 16.0, "ratio": 1.6, "policy_ms_per_step": 0.5, "first_step_s": 0.2,
                                    "policy_share": 0.008, "ops_per_step": 0, "rounds_s": [0.25, 0.25]}},
              "peak": {"full": {"peak_growth_mib": 100.0, "ratio": 1.0}}},
}


def test_summary_tables():
    md = summary(FAKE)
    assert "| 8 | h2o | 10 | 8 | 11.000 |" in md
    assert "| full | — | 1.00 | 1.00 | 1.00 |" in md and "| h2o | 64 | 0.50 | 0.50 | 0.50 |" in md
    # perplexity / full averaged over prompts: (10/9 + 11/10) / 2
    assert f"| dbudgetkv | self-chosen | 40.0% | {(10 / 9 + 11 / 10) / 2:.3f} | 0.300 [0.300–0.300] | 0.900 |" in md
    assert "| 0 | 0.5 | 0.30 | 0.20 | 8 |" in md
    # the speed tables of docs/speed.md; H2O over SnapKV: rounds 0.25 / 0.28 = 0.89 and 0.25 / 0.26 = 0.96
    assert "| full cache | 1.00 (1.0 s) | — | 1.00 (10.0 tokens/s) | — | 1.000 | — | — | — | 1.00 (100 MiB) |" in md
    assert "| H2O | 1.20 | 0.05 s | 1.50 | 0.93 (0.89–0.96) | 0.200 | 2.50 ms (3.8%) | 91 | 0.25 s | — |" in md
    assert "| H2O | 15.0 | 12.0 | 1.25 | 2.50 ms | 5.00 ms | 91 | 1,350 |" in md
    gpu = dict(FAKE, speed=dict(FAKE["speed"], batch={"full": {"batch": 4, "tokens_per_s": 800.0, "peak_gib": 1.5},
                                                     "h2o": None}, batch_n=16, cap_gib=2))
    md = summary(gpu)
    assert "| full | 4 | 800 | 1.50 |" in md and "| h2o | none fits | — | — |" in md


def test_plots_are_written_or_skipped_with_a_reason(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib (requirements-dev.txt) is not installed")
    files = plots.write_plots(FAKE, tmp_path)
    assert sorted(p.split("/")[-1] for p in files) == sorted(
        ["streaming_nll.png", "passkey_heatmaps.png", "layers_density.png", "layers_variance.png",
         "layers_retention.png"])
    assert all((tmp_path / f).stat().st_size > 1000 for f in files)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(plots.PlotsUnavailable, match="pip install matplotlib"):
        plots.write_plots(FAKE, tmp_path)


@pytest.mark.slow
def test_smoke_profile_end_to_end(tmp_path, default_model_dir, monkeypatch):
    """Every experiment, tiny sizes, on the default model: JSON, markdown and exit code."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the no-matplotlib path of the command
    code = suite.main(["--profile", "smoke", "--out", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(suite.EXPERIMENTS) <= set(results) and "matplotlib" in results["plots_skipped"]
    assert results["speed"]["peak"]["full"]["ratio"] == 1.0
    md = (tmp_path / "summary.md").read_text()
    assert "## Passkey retrieval" in md and "Smoke profile: these numbers mean nothing" in md
    from kvmini.eval import provenance  # a fresh run records how it was made, and is current

    assert results["provenance"]["fidelity"]["command"] == f"python -m kvmini.eval.suite --profile smoke --out {tmp_path}"
    assert provenance.stale(tmp_path / "results.json", suite.today("smoke")) == []
    # one method measured alone: its rows are replaced, every other row is kept as it was
    argv = ["--profile", "smoke", "--only", "fidelity", "speed", "--methods", "h2o", "--out", str(tmp_path)]
    assert suite.main(argv) == 0
    merged = json.loads((tmp_path / "results.json").read_text())
    others = lambda rows: [r for r in rows if r["method"] != "h2o"]  # noqa: E731
    assert others(merged["fidelity"]) == others(results["fidelity"]) and merged["fidelity"] != results["fidelity"]
    assert [r["method"] for r in merged["fidelity"]] == [r["method"] for r in results["fidelity"]]
    assert {k: v for k, v in merged["speed"]["decode"].items() if k != "h2o"} == \
        {k: v for k, v in results["speed"]["decode"].items() if k != "h2o"}
    assert merged["speed"]["decode"]["h2o"] != results["speed"]["decode"]["h2o"]
    assert merged["streaming"] == results["streaming"]  # it does not measure h2o: not run
    assert merged["provenance"]["speed"]["merged"][0]["methods"] == ["h2o"]
    assert merged["provenance"]["speed"]["merged"][0]["command"] == "python -m kvmini.eval.suite " + " ".join(argv)
    assert provenance.stale(tmp_path / "results.json", suite.today("smoke")) == []


def test_a_partial_run_keeps_the_other_experiments_of_the_same_profile(tmp_path):
    from kvmini.eval.suite import kept_from

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"profile": "quick", "device": "cpu", "sizes": {"streaming": {"n": 1}, "speed": {"n": 2}},
                                "streaming": ["old rows"], "speed": {"old": 1}, "seconds": {"streaming": 5.0}}))
    new = {"profile": "quick", "device": "cpu", "sizes": {"speed": {"n": 3}}, "speed": {"new": 1}, "seconds": {"speed": 1.0}}
    merged = kept_from(path, new, log=lambda m: None)
    assert merged["streaming"] == ["old rows"] and merged["speed"] == {"new": 1}  # the re-run replaces its own
    assert merged["sizes"] == {"streaming": {"n": 1}, "speed": {"n": 3}} and merged["seconds"]["streaming"] == 5.0
    assert kept_from(path, {**new, "profile": "full"}, log=lambda m: None) == {**new, "profile": "full"}
    assert kept_from(tmp_path / "missing.json", new) == new


def test_one_method_measured_alone_replaces_its_rows_in_place_and_nothing_else():
    from kvmini.eval import provenance

    rows = lambda tag, methods: [{"prompt": p, "method": m, "kl": f"{tag}{p}{m}"} for p in (0, 1)  # noqa: E731
                                 for m in methods]
    speed_rows = lambda tag, methods: {m: {"tokens_per_s": f"{tag}{m}"} for m in methods}  # noqa: E731
    fid_specs, speed_specs = ["full", "h2o", "dbudgetkv"], suite.today("smoke")["speed"]["methods"]
    old = {"profile": "smoke", "sizes": {"fidelity": suite.PROFILES["smoke"]["fidelity"]},
           "fidelity": rows("old", fid_specs), "speed": {"budget": 0.5, "decode": speed_rows("old", speed_specs)},
           "seconds": {"fidelity": 1.0, "speed": 2.0},
           "provenance": {"fidelity": provenance.stamp("fidelity", fid_specs, ["--profile", "smoke"]),
                          "speed": provenance.stamp("speed", speed_specs, ["--profile", "smoke"])}}
    new = {"fidelity": rows("new", ["full", "h2o"]), "speed": {"budget": 0.5, "decode": speed_rows("new", ["full", "h2o"])},
           "seconds": {"fidelity": 9.0, "speed": 9.0},
           "provenance": {e: provenance.stamp(e, ["full", "h2o"], ["--methods", "h2o"]) for e in ("fidelity", "speed")}}
    merged = suite.merged_into(old, new, ["h2o"], "smoke", ["--profile", "smoke", "--methods", "h2o"])
    assert merged["fidelity"] == [{"prompt": p, "method": m, "kl": f"{'new' if m == 'h2o' else 'old'}{p}{m}"}
                                  for p in (0, 1) for m in fid_specs]  # in place: prompt 0's rows, then prompt 1's
    assert merged["speed"]["decode"] == {m: {"tokens_per_s": f"{'new' if m == 'h2o' else 'old'}{m}"} for m in speed_specs}
    assert merged["seconds"] == old["seconds"] and merged["speed"]["budget"] == 0.5
    made = merged["provenance"]["fidelity"]
    assert made["methods"] == fid_specs and made["command"] == old["provenance"]["fidelity"]["command"]
    assert made["merged"][0]["methods"] == ["h2o"] and made["merged"][0]["command"].endswith("--methods h2o")
    # a method new to the file: its rows come after the others'
    assert suite.merged_rows(rows("old", ["full", "h2o"]), rows("new", ["full", "cake"]),
                             lambda s: s == "cake") == rows("old", ["full", "h2o"]) + rows("new", ["cake"])


def test_measuring_one_method_alone_needs_a_current_results_file_of_that_profile(tmp_path):
    with pytest.raises(KvminiError, match="missing or not JSON: run the suite without --methods first"):
        suite.mergeable(tmp_path / "results.json", "quick", ["speed"])
    (tmp_path / "results.json").write_text(json.dumps({"profile": "full"}))
    with pytest.raises(KvminiError, match="holds the full profile, not quick: give --profile full"):
        suite.mergeable(tmp_path / "results.json", "quick", ["speed"])
    (tmp_path / "results.json").write_text(json.dumps({"profile": "quick", "sizes": {"speed": {}}, "speed": {},
                                                       "provenance": {"speed": {"command": "python -m x"}}}))
    with pytest.raises(KvminiError, match="speed must be re-run whole first: .*fingerprint by method"):
        suite.mergeable(tmp_path / "results.json", "quick", ["speed"])


def test_kept_bytes_of_a_method_that_compresses_at_the_first_decode_step_are_read_after_it():
    """D2O's official variant compresses at the first decode step: its kept bytes are those of the cache
    after that step (the layers' lengths `layers.retention` reads there, over L (n + 1) entries), not
    the whole prompt's 1.000; a method that compresses with the prompt is read after the prompt."""
    model = random_model(L=5, seed=6)
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(4))
    pre = speed.prefill_times(model, ids, ["d2o", "h2o"], 0.25, log=lambda m: None)
    held = layers.retention(model, ids, 0.25, methods=("d2o",))["d2o"]
    assert held[2] < 41 and pre["d2o"]["kept_bytes_ratio"] == sum(held) / (5 * 41) < 1.0
    assert pre["h2o"]["kept_bytes_ratio"] == 0.25
