"""A statistic declared outside the engine is computed by every path: the chunked explicit pass,
the decode step's row, a prompt gathered over several calls, each equal to a naive full matrix."""
import pytest
import torch

from kvmini.attention import attend
from kvmini.errors import KvminiError
from kvmini.statistics import Request, Statistic, add_up, column_sums, window_sums
from test_attention import naive, setup

SQUARES = Statistic("test_squared_sums", None, lambda rows: rows * rows, "sum")  # sum_i A_ij^2 (RoCo-like)


def above_uniform(rows):
    """1 where a query gave key j more than a uniform share 1/t of its attention (t keys it sees)."""
    t = (rows > 0).sum(-1, keepdim=True)  # (..., T, 1)
    return (rows * t > 1).to(rows.dtype)


HEAVY = Statistic("test_heavy_counts", 3, above_uniform, "max")  # over the last 3 queries (Scissorhands-like)


def expected(probs, H_kv, s: Statistic):
    B, H, T, S = probs.shape
    grouped = probs.view(B, H_kv, H // H_kv, T, S)
    rows = grouped if s.last is None else grouped[:, :, :, -min(s.last, T) :]
    summed = (rows if s.f is None else s.f(rows)).sum(3)  # (B, H_kv, g, S)
    return s.finish(summed)


@pytest.mark.parametrize("T,S_old,window", [(7, 5, None), (1, 9, None), (9, 4, 5), (7, 0, None)])
def test_a_declared_statistic_equals_the_naive_sum_on_every_path(T, S_old, window):
    q, k, v, q_pos, k_pos, w = setup(T, S_old, window, shuffle=True)
    _, probs = naive(q, k, v, q_pos, k_pos, w)
    for request in (Request(SQUARES), Request(HEAVY), Request(HEAVY, column_sums("sum"))):
        _, stats = attend(q, k, v, q_pos, k_pos, request, w)
        for s in request.statistics:
            torch.testing.assert_close(getattr(stats, s.name), expected(probs, 2, s), atol=1e-5, rtol=0)


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
    every, window = Statistic("test_heads", None, None, "heads"), Statistic("test_window_heads", 4, None, "heads")
    _, whole = attend(q, k, v, pos, pos[:, None].expand(2, 2, n), Request(every, window))
    sums, start = {}, 0
    for c in cuts:
        end = start + c
        mine = end - max(start, n - 4)  # this call's queries among the last 4
        share = [every] + ([Statistic("test_window_heads", mine, None, "heads")] if mine > 0 else [])
        _, stats = attend(q[:, :, start:end], k[:, :, :end], v[:, :, :end], pos[:, start:end],
                          pos[:, None, :end].expand(2, 2, end), Request(*share))
        for name in stats:
            add_up(sums, name, getattr(stats, name))
        start = end
    for name in ("test_heads", "test_window_heads"):
        torch.testing.assert_close(sums[name], getattr(whole, name), atol=1e-5, rtol=0)


def test_two_parts_asking_for_one_name_defined_differently_is_an_error():
    with pytest.raises(KvminiError, match="window_sums defined differently"):
        Request.merge([Request(window_sums(4)), Request(window_sums(8))])
    assert Request.merge([Request(column_sums()), None, Request(column_sums())]).statistics == (column_sums(),)


def test_a_function_that_counts_unseen_keys_is_refused():
    with pytest.raises(ValueError, match="must give 0"):
        Statistic("test_bad", None, lambda rows: rows + 1)
