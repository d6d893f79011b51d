"""Progress lines for long work: silent when short or not on a terminal; counts, rate and ETA otherwise."""
import io
import subprocess
import sys
from pathlib import Path

import torch

from kvmini.generate import prefill
from kvmini.progress import Progress, _duration
from reference import random_model

ROOT = Path(__file__).resolve().parents[1]


def test_durations_by_hand():
    assert [_duration(s) for s in (12, 200, 7300, float("inf"))] == ["12s", "3m20s", "2h01m", "?"]


def test_line_by_hand():
    p = Progress("prefill", total=8192, enabled=True, stream=io.StringIO())
    assert p.line(1024, 4.0) == "prefill  1,024/8,192 tokens   12.5%  256.0 tokens/s  ETA 28s"


def test_silent_when_not_a_terminal_or_short():
    stream = io.StringIO()
    quiet = Progress("prefill", 100, stream=stream)  # StringIO is not a terminal
    quiet.update(50)
    quiet.close()
    short = Progress("prefill", 100, enabled=True, stream=stream, delay=60)  # finished before the delay
    short.update(50)
    short.close()
    assert stream.getvalue() == ""


def test_reaching_the_total_ends_the_line_once():
    stream = io.StringIO()
    p = Progress("prefill", 100, enabled=True, stream=stream, delay=0, every=0)
    p.update(50)
    assert stream.getvalue().startswith("\rprefill  50/100 tokens") and "\n" not in stream.getvalue()
    p.update(100)  # what prefill's last report does: the line ends before the answer streams
    shown = stream.getvalue()
    assert shown.count("\n") == 1 and shown.endswith("\033[K\n") and "100/100 tokens" in shown.split("\r")[-1]
    p.close()
    assert stream.getvalue() == shown


def test_prefill_reports_tokens_after_every_layer():
    model = random_model(L=3)
    seen = []

    prefill(model, torch.randint(0, 61, (1, 30)), model.new_cache(1), chunk_size=12, on_progress=seen.append)
    # chunks of 12, 12 and 6 tokens; each layer of a chunk adds a third of it
    assert seen == [4, 8, 12, 16, 20, 24, 26, 28, 30]


def test_the_loop_does_not_import_progress():
    """prefill/generate hear a callback: the terminal line is the caller's (run.py), not the loop's."""
    code = "import sys, kvmini.generate; print('kvmini.progress' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr
