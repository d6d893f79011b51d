"""A statistic defined outside the engine is computed by every path: the chunked explicit pass,
the decode step's row, a prompt gathered over several calls, each equal to a naive full matrix."""
import pytest
import torch

from kvmini.attention import Statistic, add_up, attend, reduce_heads
from test_attention import naive, setup

SQUARES = Statistic(None, lambda rows: rows * rows, "sum")  # sum_i A_ij^2 (RoCo-like)


def above_uniform(rows):
    """1 where a query gave key j more than a uniform share 1/t of its attention (t keys it sees)."""
    t = (rows > 0).sum(-1, keepdim=True)  # (..., T, 1)
    return (rows * t > 1).to(rows.dtype)


HEAVY = Statistic(3, above_uniform, "max")  # over the last 3 queries (Scissorhands-like)


def expected(probs, H_kv, s: Statistic):
    B, H, T, S = probs.shape
    grouped = probs.view(B, H_kv, H // H_kv, T, S)
    rows = grouped if s.last is None else grouped[:, :, :, -min(s.last, T) :]
    summed = (rows if s.f is None else s.f(rows)).sum(3)  # (B, H_kv, g, S)
    return {"mean": summed.mean(2), "max": summed.amax(2), "sum": summed.sum(2), "heads": summed.flatten(1, 2)}[s.reduce]


@pytest.mark.parametrize("T,S_old,window", [(7, 5, None), (1, 9, None), (9, 4, 5), (7, 0, None)])
def test_a_declared_statistic_equals_the_naive_sum_on_every_path(T, S_old, window):
    q, k, v, q_pos, k_pos, w = setup(T, S_old, window, shuffle=True)
    _, probs = naive(q, k, v, q_pos, k_pos, w)
    for wants in ({"squares": SQUARES}, {"heavy": HEAVY}, {"heavy": HEAVY, "sums": Statistic(reduce="sum")},
                  {"heads": Statistic(reduce="heads"), "max": Statistic(reduce="max")}):
        _, stats = attend(q, k, v, q_pos, k_pos, wants, w)
        assert set(stats) == set(wants)
        for name, s in wants.items():
            torch.testing.assert_close(stats[name], expected(probs, 2, s), atol=1e-5, rtol=0)


def test_the_threshold_count_by_hand():
    """One query over 4 keys with attention (0.5, 0.3, 0.1, 0.1): above 1/4 are keys 0 and 1."""
    rows = torch.tensor([[[[0.5, 0.3, 0.1, 0.1]]]])  # (1, 1, 1, 4)
    assert above_uniform(rows).tolist() == [[[[1.0, 1.0, 0.0, 0.0]]]]
    masked = torch.tensor([[[[0.6, 0.4, 0.0, 0.0]]]])  # two keys not visible: above 1/2 is key 0 only
    assert above_uniform(masked).tolist() == [[[[1.0, 0.0, 0.0, 0.0]]]]


@pytest.mark.parametrize("cuts", [(5, 4, 3), (11, 1), (1, 1, 10)])
def test_a_prompt_in_calls_adds_up_to_what_one_call_computes(cuts):
    """Each call attends over the cache so far; its share of a sum over the prompt's queries, per query head,
    added up over the calls (`add_up`, as SnapKV and D2O do), equals one call's: every query's and the last 4's."""
    n = sum(cuts)
    q, k, v, _, _, _ = setup(n, 0)
    pos = torch.arange(n).expand(2, n)
    every, window = Statistic(None, None, "heads"), Statistic(4, None, "heads")
    _, whole = attend(q, k, v, pos, pos[:, None].expand(2, 2, n), {"test_heads": every, "test_window_heads": window})
    sums, start = {}, 0
    for c in cuts:
        end = start + c
        mine = end - max(start, n - 4)  # this call's queries among the last 4
        share = {"test_heads": every} | ({"test_window_heads": Statistic(mine, None, "heads")} if mine > 0 else {})
        _, stats = attend(q[:, :, start:end], k[:, :, :end], v[:, :, :end], pos[:, start:end],
                          pos[:, None, :end].expand(2, 2, end), share)
        for name in stats:
            add_up(sums, name, stats[name])
        start = end
    for name in ("test_heads", "test_window_heads"):
        torch.testing.assert_close(sums[name], whole[name], atol=1e-5, rtol=0)


def test_reduce_heads_by_hand():
    """Two KV heads of two query heads each: mean, max, sum over each pair; "heads" leaves every row."""
    C = torch.tensor([[[1.0, 2.0], [3.0, 0.0], [5.0, 5.0], [1.0, 7.0]]])  # (1, H=4, S=2)
    assert reduce_heads(C, 2, "mean").tolist() == [[[2.0, 1.0], [3.0, 6.0]]]
    assert reduce_heads(C, 2, "max").tolist() == [[[3.0, 2.0], [5.0, 7.0]]]
    assert reduce_heads(C, 2, "sum").tolist() == [[[4.0, 2.0], [6.0, 12.0]]]
    heads = reduce_heads(C, 2, "heads")
    assert torch.equal(heads, C) and heads.data_ptr() == C.data_ptr()  # each query head its own row, not a copy


def test_a_function_that_counts_unseen_keys_is_refused():
    with pytest.raises(ValueError, match="must give 0"):
        Statistic(None, lambda rows: rows + 1)
