"""kvmini.eval.bench_hf's record: the table docs/speed.md is written from, and the files it refuses."""
import json

import pytest

from kvmini.errors import KvminiError
from kvmini.eval import bench_hf

RUN = {"command": "python -m kvmini.eval.bench_hf --out results/hf/bench.json", "date": "2026-11-25 22:00 UTC",
       "commit": "abc", "machine": {"threads": 2, "load_at_start": 0.3}, "prompt_tokens": 2048, "new_tokens": 128,
       "repeats": 3, "same_tokens": True, "kvmini": {"ttft_s": 2.0, "decode_tokens_per_s": 30.0},
       "hf": {"ttft_s": 2.5, "decode_tokens_per_s": 20.0}, "bytes_per_token": 5.4e8, "copy_bandwidth": 32_700_000_000,
       "profile": {"ms_per_token": 40.0, "op_calls": 7057, "floor_ms": 16.5,
                   "parts_ms": {"weights (linear layers)": 25.0, "attention (q K^T, softmax, p V)": 5.0,
                                "other tensor ops": 8.0, "Python between ops": 2.0}}}


def test_the_table_by_hand():
    text = bench_hf.table({"float32": RUN})
    assert "| float32 | 0.80 (2.00 s) | 30.0 | 20.0 | 1.50x | yes |" in text  # 2.0 / 2.5; 30 / 20
    assert ("- float32 (2,048-token prompt, 128 new tokens, median of 3): 40.0 ms per step (7,057 op calls): the "
            "linear layers 25.0 ms, against 16.5 ms for the bytes a step reads at the measured copy bandwidth "
            "(32.7 GB/s); attention 5.0 ms, other tensor ops 8.0 ms, Python between ops 2.0 ms") in text
    assert "at commit abc, 2026-11-25 22:00 UTC, 2 threads, load average 0.3 at its start" in text


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"float32": {"no": 1}}'])
def test_a_file_that_is_not_a_record_is_refused(tmp_path, content):
    path = tmp_path / "bench.json"
    path.write_text(content)
    with pytest.raises(KvminiError, match="is not a JSON file of this benchmark's runs"):
        bench_hf.read_record(path)


def test_a_record_keeps_the_other_dtypes(tmp_path):
    path = tmp_path / "bench.json"
    assert bench_hf.read_record(path) == {}
    path.write_text(json.dumps({"bfloat16": RUN}))
    assert bench_hf.read_record(path) == {"bfloat16": RUN}


def test_bad_out_is_one_line_before_any_work(capsys, tmp_path):
    assert bench_hf.main(["--out", ""]) == 2
    assert capsys.readouterr().err == "error: argument --out: must not be empty (a path) (see --help)\n"
    assert bench_hf.main(["--out", str(tmp_path / "missing" / "b.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
