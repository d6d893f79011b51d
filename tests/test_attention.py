"""Both attention paths equal a naive full-matrix computation, statistics included."""
import pytest
import torch

from kvmini.methods.method import Method
from kvmini.attention import attend, explicit_attention, in_chunks, pool, sdpa_attention
from kvmini.attention import Statistic


def column_sums(reduce="mean"):
    return Statistic(None, None, reduce)


def window_sums(w, reduce="mean"):
    return Statistic(w, None, reduce)


def last_row(reduce="mean"):
    return Statistic(1, None, reduce)


def naive(q, k, v, q_pos, k_pos, window):
    """Literal softmax(q k^T / sqrt(D) + mask) v with every query head's own K/V copy."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    kk, vv, kp = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), k_pos.repeat_interleave(g, 1)
    probs = torch.zeros(B, H, T, k.shape[2])
    for b in range(B):
        for h in range(H):
            for i in range(T):
                ok = kp[b, h] <= q_pos[b, i]
                if window is not None:
                    ok &= q_pos[b, i] - kp[b, h] < window
                s = (kk[b, h] @ q[b, h, i]) / D**0.5
                probs[b, h, i] = torch.where(ok, s, float("-inf")).softmax(-1)
    return probs @ vv, probs  # (B, H, T, D), (B, H, T, S)


def setup(T=7, S_old=5, window=None, shuffle=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, H_kv, D = 2, 6, 2, 4
    S = S_old + T
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, H_kv, S, D, generator=g), torch.randn(B, H_kv, S, D, generator=g)
    # cached entries: an arbitrary (evicted) subset of older positions, per head; then the T new ones
    old = torch.stack([torch.randperm(20, generator=g)[:S_old].sort().values for _ in range(B * H_kv)]).view(B, H_kv, S_old)
    if shuffle:
        old = old.flip(-1)
    q_pos = torch.arange(20, 20 + T).expand(B, T)
    k_pos = torch.cat([old, q_pos[:, None].expand(B, H_kv, T)], -1)
    return q, k, v, q_pos, k_pos, window


@pytest.mark.parametrize("T,S_old,window", [(7, 0, None), (7, 5, None), (1, 9, None), (7, 5, 4), (1, 9, 6), (6, 0, 3)])
def test_sdpa_path_equals_naive(T, S_old, window):
    q, k, v, q_pos, k_pos, w = setup(T, S_old, window)
    expected, _ = naive(q, k, v, q_pos, k_pos, w)
    torch.testing.assert_close(sdpa_attention(q, k, v, q_pos, k_pos, w), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("reduce", ["mean", "max", "sum"])
@pytest.mark.parametrize("T,S_old,window,chunk", [(7, 5, None, 3), (7, 0, None, 2), (1, 9, None, 4), (9, 4, 5, 4)])
def test_explicit_path_statistics_equal_naive(reduce, T, S_old, window, chunk):
    q, k, v, q_pos, k_pos, w = setup(T, S_old, window, shuffle=True)
    expected, probs = naive(q, k, v, q_pos, k_pos, w)  # probs (B, H, T, S)
    req = {"column_sums": column_sums(reduce), "window_sums": window_sums(3, reduce), "last_row": last_row(reduce)}
    out, sums = in_chunks(q, k, v, q_pos, k_pos, req, w, chunk=chunk)
    stats = {name: pool(sums[name], s.reduce) for name, s in req.items()}
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    B, H, _, S = probs.shape
    grouped = probs.view(B, 2, H // 2, T, S)  # (B, H_kv, g, T, S)
    combine = {"mean": lambda t: t.mean(2), "max": lambda t: t.amax(2), "sum": lambda t: t.sum(2)}[reduce]
    torch.testing.assert_close(stats["column_sums"], combine(grouped.sum(3)), atol=1e-5, rtol=0)
    torch.testing.assert_close(stats["window_sums"], combine(grouped[:, :, :, -3:].sum(3)), atol=1e-5, rtol=0)
    torch.testing.assert_close(stats["last_row"], combine(grouped[:, :, :, -1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("request_", [{"window_sums": window_sums(3)}, {"last_row": last_row("max")},
                                      {"window_sums": window_sums(20)},
                                      {"column_sums": column_sums(), "window_sums": window_sums(2)}, None])
@pytest.mark.parametrize("T,S_old,window", [(7, 5, None), (1, 9, None), (9, 4, 5)])
def test_attend_equals_naive_on_every_path(request_, T, S_old, window):
    """SDPA for the output plus statistics from the last queries only, or the full explicit pass."""
    q, k, v, q_pos, k_pos, w = setup(T, S_old, window, shuffle=True)
    expected, probs = naive(q, k, v, q_pos, k_pos, w)
    out, stats = attend(q, k, v, q_pos, k_pos, request_, w)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    B, H, _, S = probs.shape
    grouped = probs.view(B, 2, H // 2, T, S)  # (B, H_kv, g, T, S)
    combine = {"mean": lambda t: t.mean(2), "max": lambda t: t.amax(2)}
    want = {}
    for name, s in (request_ or {}).items():
        red = combine[s.reduce]
        if name == "column_sums":
            want["column_sums"] = red(grouped.sum(3))
        if name == "window_sums":
            want["window_sums"] = red(grouped[:, :, :, -s.last :].sum(3))
        if name == "last_row":
            want["last_row"] = red(grouped[:, :, :, -1])
    assert set(stats) == set(want)
    for name in want:
        torch.testing.assert_close(stats[name], want[name], atol=1e-5, rtol=0)


def test_statistics_are_only_computed_when_requested():
    q, k, v, q_pos, k_pos, w = setup()
    _, sums = explicit_attention(q, k, v, q_pos, k_pos, {"last_row": last_row()})
    assert set(sums) == {"last_row"}
    assert sums["last_row"].shape == (q.shape[0], k.shape[1], q.shape[1] // k.shape[1], k.shape[2])  # per query head
    _, stats = attend(q, k, v, q_pos, k_pos, {"last_row": last_row()}, w)
    assert set(stats) == {"last_row"} and stats["last_row"].shape == (q.shape[0], k.shape[1], k.shape[2])


def test_unknown_group_reduction_is_rejected():
    with pytest.raises(ValueError, match="reduce"):
        column_sums("median")


class AskEverything(Method):
    """A do-nothing policy that makes every layer take the explicit (statistics) path."""

    def __init__(self):
        super().__init__("ask_everything", None)
        self.seen = []

    def before(self, cache, step):
        return {"column_sums": column_sums(), "window_sums": window_sums(4), "last_row": last_row()}

    def after_attention(self, layer, cache, stats, step):
        self.seen.append((layer, stats["column_sums"].shape))


def test_model_explicit_path_equals_sdpa_path(tiny):
    from kvmini.loading import load_model

    family, folder, _ = tiny
    model = load_model(folder, "cpu", "float32")
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(3))
    policy = AskEverything()
    policy.start(21)
    with torch.no_grad():
        fast = model(ids, all_logits=True)
        slow = model(ids, model.new_cache(2), policy, all_logits=True)
    torch.testing.assert_close(slow, fast, atol=1e-5, rtol=0)
    H_kv = model.config.num_kv_heads
    assert policy.seen == [(i, (2, H_kv, 21)) for i in range(model.config.num_layers)]
