"""The ops of one steady-state decode step (kvmini.eval.ops.step_ops: every aten op the model, the cache
and the method dispatch), per method, at batch 1 and 8, against the full cache's: a step's cost on a GPU is
its op count (docs/speed.md, "Ops per decode step"), so a change that adds a loop over rows or layers, or
a dozen ops per layer, fails here. Counts are exact; the prompt is short (128 tokens) to keep this fast.

Every method is held to issue 77's limit (kvmini.eval.ops.OPS_LIMIT) except where `NOT_YET` names the
ratio it is held under instead, measured when the entry was written: issue 77 is open for them.
"""
import pytest
import torch

from kvmini.eval.ops import SMOLLM2, ops_limit, step_ops
from kvmini.methods.registry import METHODS
from kvmini.model import Transformer

# (batch 1, batch 8) ceilings, a little above the ratios measured when written (issue 77). D2O's were 1.87 and 2.13
# until issue 83 undid two forms bent only to cut ops (it allows D2O up to 2.2 and 2.4 for that): its step reads
# each row's count from the cache, not a host mirror (batch 8: 2.10 -> 2.13), and merges its one token through
# the prompt's Eq. 11-12 (`convex_merge`, `scatter_mean_merge` with E = 1), not a third form (1.84 -> 1.99, 2.28).
NOT_YET = {"vatp": (1.55, 1.55), "weightedkv": (2.05, 2.05), "cam": (2.0, 2.0), "roco": (2.25, 2.25),
           "d2o": (2.0, 2.29)}


@pytest.fixture(scope="module")
def counted():
    torch.manual_seed(0)
    model = Transformer(SMOLLM2).eval()
    full = {B: step_ops(model, "full", B, n=128).n for B in (1, 8)}
    return lambda name, B: step_ops(model, name, B, n=128).n / full[B]


@pytest.mark.parametrize("name", [m for m in METHODS if m != "full"])
def test_a_decode_step_costs_at_most_its_limit_in_ops(counted, name):
    for i, B in enumerate((1, 8)):
        limit = NOT_YET.get(name, (ops_limit(name),) * 2)[i]
        ratio = counted(name, B)
        assert ratio <= limit, f"{name} at batch {B}: a decode step dispatches {ratio:.3f}x the full cache's ops, over {limit}"


def test_the_count_sees_a_loop_over_rows():
    """The counter can fail: a step that repeats an op per row counts each."""
    from kvmini.eval.ops import OpCount

    x = torch.zeros(8, 4)
    with OpCount() as once:
        x.add_(1)
    with OpCount() as per_row:
        for row in x:
            row.add_(1)
    assert once.n == 1 and per_row.n == 1 + 8  # the rows unbound, then an add_ each
    assert once.kernels == 1 and per_row.kernels == 8  # unbind is a view: no kernel
