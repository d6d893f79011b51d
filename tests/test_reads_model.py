"""A method that reads the model of its run (`self.model`) runs wherever a method runs: every place that
starts a run hands `start` the model, as `kvmini.generate.prefill` does. The method is tests/reads_model.py
(H2O that reads the residual stream through hooks on the model's norms), registered here as `reads_model`;
in each place it keeps what H2O keeps, and it has read one cosine per layer."""
import pytest
import torch

import reads_model
import test_chunked_prefill
import test_engine_regression
import test_policy
from kvmini.course.cells import usable
from kvmini.methods.registry import METHODS, declarations, make_policy
from reference import engine_run, random_model


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(METHODS, "reads_model", reads_model)
    yield
    declarations.cache_clear()  # its options, cached by name


def calls(B=1, n=20, steps=4, seed=0):
    return test_policy.make_calls(B, n, steps, seed)


def policy_run_calls(model, policy):
    logits, cache = test_policy.run_calls(model, calls(), policy, 20)
    return logits, [test_policy.held_positions(lc) for lc in cache]


def chunked_prefill_run(model, name):
    ids = torch.randint(0, 61, (2, 48), generator=torch.Generator().manual_seed(1))
    return test_chunked_prefill.run(model, ids, name, 16, {}, [20, 25])


PLACES = {  # each place that starts a run -> (model, method name) -> what it returns, and the policy it ran (if given one)
    "test_policy.run_calls": lambda model, name: ((p := make_policy(name, 8)), policy_run_calls(model, p)),
    "reference.engine_run": lambda model, name: ((p := make_policy(name, 8)), engine_run(model, calls(), p, 20)),
    "test_chunked_prefill.run": lambda model, name: (None, chunked_prefill_run(model, name)),
    "test_engine_regression.run": lambda model, name: (None, test_engine_regression.run(
        model.to(torch.float64), calls(B=2), name, 8, {}, 20)),
}


def equal(a, b) -> bool:
    """a and b hold the same numbers: tensors exactly, containers element by element."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("place", list(PLACES))
def test_a_method_that_reads_the_model_runs_where_h2o_runs_and_keeps_what_it_keeps(registered, place):
    policy, got = PLACES[place](random_model(L=3), "reads_model")
    _, want = PLACES[place](random_model(L=3), "h2o")
    assert equal(got, want), f"{place}: reads_model ran otherwise than h2o"  # logits, kept entries, budgets
    if policy is not None:
        assert len(policy.cosines) == 3  # one per layer: it read the residual stream in the last call


@pytest.mark.parametrize("B,chunk", [(1, 40), (2, 7)])
def test_the_invariants_hold_for_a_method_that_reads_the_model(registered, B, chunk):
    """test_policy.py's invariants (the example Hypothesis would draw, given by hand): a prompt of 20 in one
    call or in chunks of 7, four decode steps, a batch of one or two."""
    test_policy.test_invariants.hypothesis.inner_test(name="reads_model", kv_heads=2, group=2, B=B, n=20, steps=4,
                                                      budget=8, chunk=chunk, seed=3)


def test_a_tutorial_cell_can_use_a_method_that_reads_the_model(registered):
    assert usable("reads_model")


def test_a_run_started_without_the_model_fails_for_it(registered):
    """The counter-check: the same method, started without a model, fails at its first call."""
    model, policy = random_model(L=3), make_policy("reads_model", 8)
    policy.start(20)
    with torch.no_grad(), pytest.raises(AttributeError, match="'NoneType' object has no attribute 'model'"):
        model(calls()[0], model.new_cache(1), policy)
