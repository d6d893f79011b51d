"""The README's frontier figures (kvmini/eval/plots.py FIGURES): drawn after a suite run that swept
budgets, each recording a digest of the numbers it shows, which `python -m kvmini.eval.docs --check`
compares with the committed results."""
import pytest

from kvmini.eval import plots

pytest.importorskip("matplotlib", reason="matplotlib (requirements-dev.txt) is not installed")


def sweep_results():
    fidelity = [{"prompt": 0, "method": "full", "budget": None, "ppl": 10.0, "kl": 0.0, "top1": 1.0, "kept_share": 1.0},
                {"prompt": 0, "method": "dbudgetkv", "budget": None, "ppl": 10.5, "kl": 0.2, "top1": 0.9, "kept_share": 0.4}]
    fidelity += [{"prompt": 0, "method": m, "budget": b, "ppl": 11.0, "kl": kl / b, "top1": 0.9, "kept_share": b}
                 for m, kl in (("h2o", 0.01), ("d2o", 0.02)) for b in (0.1, 0.2, 0.5)]
    passkey = [{"method": m, "budget": b, "length": 64, "depth": d, "correct": d < 0.5, "kept": 10.0, "prompt_tokens": 64}
               for m, b in (("full", None), ("h2o", 0.1), ("h2o", 0.5), ("dbudgetkv", None)) for d in (0.1, 0.9)]
    return {"profile": "quick", "sizes": {"fidelity": {"n": 64, "k": 8, "prompts": 1, "budgets": [0.1, 0.2, 0.5]}},
            "fidelity": fidelity, "passkey": passkey}


def test_a_sweep_draws_the_frontiers_and_each_records_what_it_shows(tmp_path):
    results = sweep_results()
    files = {p.split("/")[-1] for p in plots.write_plots(results, tmp_path)}
    assert {"frontier_kl.png", "frontier_passkey.png"} <= files
    kl = tmp_path / "frontier_kl.png"
    assert plots.recorded_digest(kl) == plots.figure_digest("results/quick/frontier_kl.png", results)
    results["fidelity"][2]["kl"] *= 2  # measured again, another number: the figure no longer shows it
    assert plots.recorded_digest(kl) != plots.figure_digest("results/quick/frontier_kl.png", results)
    assert plots.recorded_digest(tmp_path / "missing.png") is None


def test_one_budget_draws_no_frontier(tmp_path):
    results = sweep_results()
    results["fidelity"] = [r for r in results["fidelity"] if r["budget"] in (None, 0.2)]
    results["passkey"] = [r for r in results["passkey"] if r["budget"] in (None, 0.1)]
    assert plots.write_plots(results, tmp_path) == [str(tmp_path / "passkey_heatmaps.png")]


def test_the_speed_figure_reads_two_results_files(tmp_path):
    results = sweep_results()
    speed = {"speed": {"budget": 0.2, "decode_n": 8128,
                       "decode": {m: {"ratio": r} for m, r in (("full", 1.0), ("h2o", 1.4), ("d2o", 1.2), ("dbudgetkv", 1.5))}}}
    path = tmp_path / "speed_vs_kl.png"
    plots.draw_figure("results/full-speed/speed_vs_kl.png", path, results, speed)
    assert plots.recorded_digest(path) == plots.figure_digest("results/full-speed/speed_vs_kl.png", results, speed)
    assert path.stat().st_size > 1000
