"""Progress lines for long work: silent when short or not on a terminal; counts, rate and ETA otherwise."""
import io

import torch

from kvmini.generate import prefill
from kvmini.progress import Progress, _duration
from reference import random_model


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


def test_prefill_reports_tokens_after_every_layer():
    model = random_model(L=3)
    seen = []

    class Recorder(Progress):
        def update(self, done):
            seen.append(done)

    prefill(model, torch.randint(0, 61, (1, 30)), model.new_cache(1), chunk_size=12,
            progress=Recorder("prefill", 30, enabled=False))
    # chunks of 12, 12 and 6 tokens; each layer of a chunk adds a third of it
    assert seen == [4, 8, 12, 16, 20, 24, 26, 28, 30]
