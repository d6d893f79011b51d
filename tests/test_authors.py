"""The cross-check with the authors' code (kvmini/eval/authors.py). CI cannot fetch their code, so these test
what runs without it: matching held keys to positions and comparing kept sets by hand, kvmini's side equal to
the fidelity protocol, the refusals, and that each committed result was made with the behaviour kvmini's
method has today (the docs' tables are checked against the files by tests/test_docs.py)."""
import importlib
import json
from pathlib import Path

import pytest
import torch

from kvmini.eval import authors, fidelity, provenance
from kvmini.methods.registry import make_policy
from reference import random_model

ROOT = Path(__file__).resolve().parents[1]


def test_match_finds_each_held_key_by_exact_value():
    keys = torch.arange(2 * 5 * 3, dtype=torch.float32).view(1, 2, 5, 3)  # 2 KV heads, 5 positions
    held = torch.stack([keys[0, 0, [4, 0]], keys[0, 0, [1, 2]], keys[0, 1, [3, 0]], keys[0, 1, [3, 3]]])[None]
    assert authors.match(held, keys, groups=2) == [[0, 4], [1, 2], [0, 3], [3, 3]]  # heads 0-1 read KV head 0
    merged = held.clone()
    merged[0, 1, 0] += 0.5  # an averaged key is no prompt key
    with pytest.raises(ValueError, match="query head 1: 1 held keys match no prompt key"):
        authors.match(merged, keys, groups=2)


def test_compare_kept_sets_by_hand():
    """kvmini holds {0, 1, 2} and {3} per KV head; the authors' query heads (2 per KV head) hold {0, 1, 2},
    {0, 1}, {3, 3} (position 3 held twice) and {3, 4}: Jaccard 1, 2/3, 1, 1/2; two identical sets of four."""
    out = authors.compare([[[0, 1, 2], [3]]], [[[0, 1, 2], [0, 1], [3, 3], [3, 4]]], groups=2)
    assert out["jaccard"] == [pytest.approx((1 + 2 / 3 + 1 + 1 / 2) / 4)]
    assert (out["identical"], out["sets"], out["lengths"], out["held_twice"]) == (2, 4, [2.25], 1)


@pytest.mark.parametrize("spec", ["h2o", "snapkv"])
def test_kvmini_side_is_the_fidelity_protocol(spec):
    model = random_model(L=3)
    ids = torch.randint(0, 61, (1, 48), generator=torch.Generator().manual_seed(4))
    logits, kept = fidelity.continuation_logits(model, ids, 40, make_policy(spec, 0.5))
    mine, held = authors.kvmini_run(model, ids, 40, make_policy(spec, 0.5))
    torch.testing.assert_close(mine, logits)
    assert [len(h[0]) for h in held] == [min(k, 40) if spec == "snapkv" else len(h[0]) for k, h in zip(kept, held)]
    assert all(p < 40 for h in held for head in h for p in head)  # prompt positions only


@pytest.mark.parametrize("argv, said", [(["d2o", "--code", "/nonexistent/checkout", "--deps", "."],
                                         "--code /nonexistent/checkout is not a folder"),
                                        *[([m, "--code", "docs", "--deps", "."], f"--code docs is not a checkout of {r}")
                                          for m, r in (("d2o", "AIoT-MLSys-Lab/D2O"), ("dynamickv", "DreamMr/DynamicKV"),
                                                       ("dbudgetkv", "Patrick-Ni/ReFreeKV"), ("roco", "DRSY/EasyKV"),
                                                       ("cam", "zyxxmu/cam"))],
                                        (["h2o", "--code", ".", "--deps", "."], "invalid choice: 'h2o'"),
                                        (["scissorhands", "--code", ".", "--deps", "."],
                                         "scissorhands: lzcemma/Scissorhands @ d0bf444 cannot run beside kvmini: "
                                         "It holds no bounded cache"),
                                        (["d2o", "--code", ".", "--deps", ".", "--budget", "1.5"],
                                         "--budget 1.5 is not a ratio in (0, 1)"),
                                        (["dbudgetkv", "--code", ".", "--deps", ".", "--budget", "0.3"],
                                         "--budget: dbudgetkv chooses its own budget")])
def test_refusals(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        authors.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("method", list(authors.ADAPTERS))
def test_each_adapter_says_what_it_runs_and_changes(method):
    adapter = importlib.import_module(authors.ADAPTERS[method])
    assert adapter.SPEC == f"{method}[variant=official]"
    assert len(adapter.COMMIT) == 40 and "/" in adapter.REPO
    assert {"transformers", "tokenizers", "huggingface-hub"} <= set(adapter.PACKAGES)
    assert all(isinstance(a, str) and ":" in a for a in adapter.ADAPTATIONS)  # each cites the authors' file:line


@pytest.mark.parametrize("path", sorted((ROOT / "results" / "authors").glob("*.json")), ids=lambda p: p.stem)
def test_committed_cross_checks_describe_todays_method(path):
    """A cross-check stays current while kvmini's method behaves as it did (its entries in the behaviour
    recording, as the suite's accuracy results); else it names the command that makes it again."""
    result = json.loads(path.read_text())
    name = result["spec"].split("[")[0]
    now = provenance.recorded_behaviour([name])[name]
    assert result["provenance"]["behaviour"] == now, (
        f"{path.relative_to(ROOT)} was made with another behaviour of {name}: re-run {authors.command(path.stem)}")
    assert result["windows"] and all(r["per_kv_head"]["sets"] > 0 for r in result["windows"])


@pytest.mark.parametrize("method", list(authors.ADAPTERS))
def test_a_folder_laid_out_as_the_checkout_goes_on_to_the_cross_check(method, tmp_path, monkeypatch):
    """The checkout check reads only what the adapter names (FILES): a folder holding those goes on."""
    import importlib

    adapter = importlib.import_module(authors.ADAPTERS[method])
    for f in adapter.FILES:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("") if f.endswith(".py") else (tmp_path / f).mkdir(exist_ok=True)
    monkeypatch.setattr(authors, "cross_check", lambda args: 0)
    assert authors.main([method, "--code", str(tmp_path), "--deps", str(tmp_path)]) == 0
