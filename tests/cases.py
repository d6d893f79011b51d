"""Stored cases: a literal reference's outputs, for a student copy that must not hold the reference.

A reference a test compares against is decorated `@stored`, its body (and its helpers) between
`# BEGIN REFERENCE` / `# END REFERENCE` lines. In the instructor's repository it simply runs; with
KVMINI_RECORD_CASES=FILE (`python -m kvmini.course new --withhold-references` sets it) each call's
inputs, in summary, and outputs are recorded, keyed by the test and the call's rank in it. A copy made
with the references withheld has their bodies removed and tests/data/withheld_cases.pt beside them:
there each call checks that its inputs are the recorded ones and returns the recorded outputs.
Hypothesis runs derandomized without its example database while recording or replaying, so a test
draws the same examples in both.
"""
import atexit
import functools
import os
from collections import Counter
from pathlib import Path

import torch

CASES = Path(__file__).parent / "data" / "withheld_cases.pt"
RECORD = os.environ.get("KVMINI_RECORD_CASES", "")
recorded: dict = {}
calls: Counter = Counter()
replaying = CASES.is_file() and not RECORD
stored_cases = torch.load(CASES, weights_only=False) if replaying else {}

if RECORD or replaying:
    from hypothesis import settings

    settings.register_profile("stored-cases", derandomize=True, database=None)
    settings.load_profile("stored-cases")


def summary(x):
    """What identifies an input: numbers, strings and shapes as they are; a tensor (a module: its
    parameters) by its shape, dtype and three sums (compared with a tolerance); anything else by its type."""
    if isinstance(x, torch.nn.Module):
        return {k: summary(v) for k, v in x.state_dict().items()}
    if isinstance(x, torch.Tensor):
        v = x.detach().double().flatten()
        return ("tensor", tuple(x.shape), str(x.dtype),
                [v.sum().item(), (v * v).sum().item(), (v * torch.arange(1, len(v) + 1)).sum().item()])
    if isinstance(x, (list, tuple)):
        return [summary(y) for y in x]
    if isinstance(x, dict):
        return {str(k): summary(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return type(x).__name__


def same(a, b, where="") -> str:
    """'' when two summaries agree (floats within 1e-6, relative), else where they differ."""
    if isinstance(a, float) or isinstance(b, float):
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and (
            a == b or abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b)) or a != a and b != b)  # (inf; NaN)
        return "" if ok else f"{where or 'the input'}: {a} recorded, {b} now"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return next((d for d in (same(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))) if d), "")
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return next((d for d in (same(a[k], b[k], f"{where}.{k}") for k in a) if d), "")
    return "" if a == b else f"{where or 'the input'}: {a!r} recorded, {b!r} now"


def stored(reference):
    @functools.wraps(reference)
    def call(*args, **kwargs):
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]  # "tests/test_x.py::test_y[p]"
        key = (test, reference.__name__, calls[test, reference.__name__])
        calls[test, reference.__name__] += 1
        if replaying:
            if key not in stored_cases:
                raise AssertionError(f"no stored case for call {key[2]} of {key[1]} in {test}: the instructor's "
                                     "repository made no such call (a test changed, or an example it did not draw)")
            inputs, outputs = stored_cases[key]
            differs = same(inputs, summary((args, kwargs)))
            if differs:
                raise AssertionError(f"call {key[2]} of {key[1]} in {test} has other inputs than its stored case: {differs}")
            return outputs
        outputs = reference(*args, **kwargs)
        if RECORD:
            recorded[key] = (summary((args, kwargs)), outputs)
        return outputs
    return call


@atexit.register
def save():
    if RECORD and recorded:
        Path(RECORD).parent.mkdir(parents=True, exist_ok=True)
        torch.save(recorded, RECORD)
