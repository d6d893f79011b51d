"""The explicit KVCache: incremental decoding equals one full forward; buffers behave."""
import pytest
import torch

from kvmini.cache import PAD, KVCache, LayerCache
from kvmini.generate import prefill
from kvmini.loading import load_model
from kvmini.report import allocated_nbytes, cache_summary, full_nbytes, layer_bars


def test_prefill_then_stepwise_decode_equals_full_forward(tiny):
    family, folder, _ = tiny
    model = load_model(folder, "cpu", "float32")
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids, all_logits=True)  # (2, 30, V)
        cache = model.new_cache(2, capacity=4)  # small capacity: the buffer must grow on the way
        steps = [model(ids[:, :20], cache, all_logits=True)]
        steps += [model(ids[:, t : t + 1], cache) for t in range(20, 30)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)
    assert cache.seen_tokens == 30 and cache.lengths() == [30] * len(cache)


def test_chunked_prefill_equals_one_shot(tiny):
    family, folder, _ = tiny
    model = load_model(folder, "cpu", "float32")
    ids = torch.randint(0, 97, (1, 37), generator=torch.Generator().manual_seed(1))
    one = prefill(model, ids, model.new_cache())
    for chunk in (1, 5, 16):
        torch.testing.assert_close(prefill(model, ids, model.new_cache(), chunk_size=chunk), one, atol=1e-5, rtol=0)


def test_append_grows_and_keep_gathers_everything():
    c = LayerCache(batch=1, kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu", capacity=2)
    k = torch.arange(30.0).view(1, 2, 5, 3)  # (B, H_kv, T, D)
    c.append(k, -k, torch.arange(5)[None])
    c.declare("score")
    c.aux("score")[:] = torch.tensor([[[0.0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]])
    assert c.capacity >= 5 and c.length == 5
    idx = torch.tensor([[[0, 3], [4, 1]]])  # each head keeps its own entries
    c.keep(idx)
    assert c.length == 2
    assert c.positions.tolist() == [[[0, 3], [4, 1]]]
    assert c.keys[0, 1].tolist() == [k[0, 1, 4].tolist(), k[0, 1, 1].tolist()]
    assert torch.equal(c.values, -c.keys)
    assert c.aux("score").tolist() == [[[0.0, 3.0], [14.0, 11.0]]]
    c.append(k[:, :, :1], k[:, :, :1], torch.tensor([[5]]))
    assert c.aux("score")[0, :, -1].tolist() == [0.0, 0.0]  # new entries start with zero statistics


def test_nbytes_is_exact(tiny):
    family, folder, _ = tiny
    model = load_model(folder, "cpu", "float32")
    cfg = model.config
    cache = KVCache(cfg, batch=2, capacity=100)
    model(torch.zeros(2, 7, dtype=torch.long), cache)
    # 2 (K and V) * layers * B * H_kv * S * D * 4 bytes, independent of the buffer's capacity
    assert cache.nbytes() == 2 * cfg.num_layers * 2 * cfg.num_kv_heads * 7 * cfg.head_dim * 4


def test_cache_positions_come_from_seen_tokens_not_length(tiny_llama):
    model = load_model(tiny_llama, "cpu", "float32")
    cache = model.new_cache()
    model(torch.zeros(1, 6, dtype=torch.long), cache)
    cache[0].keep(torch.tensor([[[0, 5], [1, 5]]]))  # layer 0 evicts down to 2 entries
    model(torch.zeros(1, 1, dtype=torch.long), cache)
    assert cache[0].positions[0, :, -1].tolist() == [6, 6]
    assert cache.lengths() == [3, 7]


def test_buffers_are_allocated_on_first_use_and_shrink_after_eviction():
    c = LayerCache(batch=1, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu", capacity=1000)
    assert c.capacity == 0  # nothing allocated before the layer is used
    k = torch.randn(1, 2, 300, 4)
    c.append(k, -k, torch.arange(300)[None])
    assert c.capacity == 1000  # the reserve asked for
    keep = torch.arange(0, 300, 6).expand(1, 2, 50)  # every 6th entry
    c.keep(keep)
    assert c.capacity == 100  # a quarter full or less: shrunk to twice what is held
    assert torch.equal(c.keys, k[:, :, ::6]) and torch.equal(c.values, -k[:, :, ::6])
    assert c.positions[0, 0].tolist() == list(range(0, 300, 6))
    c.append(k[:, :, :1], k[:, :, :1], torch.tensor([[300]]))
    assert c.capacity == 100 and c.length == 51  # steady decode: no reallocation


def test_prefill_compression_releases_memory():
    from kvmini.methods.registry import make_policy
    from reference import random_model

    model = random_model(L=4)
    cache = model.new_cache(1, capacity=400)
    with torch.no_grad():
        prefill(model, torch.randint(0, 61, (1, 400)), cache, make_policy("snapkv", 40, window=4, kernel=3))
    assert cache.lengths() == [40] * 4
    assert allocated_nbytes(cache) <= 2 * cache.nbytes() + 4 * 64 * cache[0].entry_nbytes
    assert allocated_nbytes(cache) < full_nbytes(cache) / 4


def keep_row(lc: LayerCache, b: int, idx: torch.Tensor) -> None:
    """Sequence b keeps only its entries idx (H_kv, s), the others all theirs: `keep` with each row's count."""
    counts = lc.held().clone()  # (B, H_kv)
    counts[b] = idx.shape[-1]
    every = torch.arange(int(counts.max())).repeat(*counts.shape, 1)  # (B, H_kv, S'): rows keep their places
    every[b, :, : idx.shape[-1]] = idx
    lc.keep(every, counts)


def test_rows_of_different_lengths_are_padded_at_their_end():
    c = LayerCache(batch=2, kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu", capacity=2)
    k = torch.arange(8.0).view(2, 1, 4, 1)  # row 0: 0 1 2 3, row 1: 4 5 6 7
    c.append(k, k, torch.arange(4).expand(2, 4))
    c.declare("score")
    c.aux("score")[:] = k[..., 0]
    keep_row(c, 1, torch.tensor([[0, 3]]))  # row 1 keeps positions 0 and 3
    assert c.padded and c.held().tolist() == [[4], [2]] and c.length == 4
    assert c.positions[1, 0].tolist() == [0, 3, PAD, PAD]
    assert c.keys[1, 0, :, 0].tolist() == [4.0, 7.0, 0.0, 0.0] and c.aux("score")[1, 0].tolist() == [4.0, 7.0, 0, 0]
    c.append(torch.tensor([[[[8.0]]], [[[9.0]]]]), torch.zeros(2, 1, 1, 1), torch.tensor([[4], [4]]))
    assert c.held().tolist() == [[5], [3]] and c.length == 5  # each row's new entry follows its own entries
    assert c.positions[:, 0].tolist() == [[0, 1, 2, 3, 4], [0, 3, 4, PAD, PAD]]
    assert c.keys[:, 0, :, 0].tolist() == [[0, 1, 2, 3, 8], [4, 7, 9, 0, 0]]
    assert c.nbytes() == 2 * (5 + 3) * 4  # pads are not counted
    c.evict_one(torch.tensor([[0], [1]]))  # each row's own last entry moves into its slot
    assert c.positions[:, 0].tolist() == [[4, 1, 2, 3], [0, 4, PAD, PAD]] and c.held().tolist() == [[4], [2]]
    keep_row(c, 0, torch.tensor([[1, 3]]))  # rows equal again: no pads
    assert not c.padded and c.length == 2 and c.positions[:, 0].tolist() == [[1, 3], [0, 4]]


def test_heads_that_keep_their_own_counts():
    """`keep(idx, counts)`: each (sequence, KV head) row keeps the first counts of its idx; attention,
    bytes and a decode step's append and eviction follow each row's own count."""
    c = LayerCache(batch=1, kv_heads=3, head_dim=2, dtype=torch.float32, device="cpu")
    k = torch.arange(30.0).view(1, 3, 5, 2)
    c.append(k, -k, torch.arange(5)[None])
    c.declare("score")
    c.keep(torch.tensor([[[4, 0, 2], [1, 2, 3], [0, 3, 4]]]), counts=torch.tensor([[3, 1, 2]]))
    assert c.padded and c.length == 3 and c.held().tolist() == [[3, 1, 2]]
    assert c.positions[0].tolist() == [[4, 0, 2], [1, PAD, PAD], [0, 3, PAD]]
    assert c.values[0, 1, 1:].abs().sum() == 0 and c.nbytes() == 2 * 2 * 4 * 6
    c.append(torch.ones(1, 3, 1, 2), torch.ones(1, 3, 1, 2), torch.tensor([[5]]))
    assert c.positions[0].tolist() == [[4, 0, 2, 5], [1, 5, PAD, PAD], [0, 3, 5, PAD]]
    c.keep(torch.tensor([[[0, 1], [0, 1], [1, 2]]]), counts=torch.tensor([[2, 2, 1]]))
    assert c.positions[0].tolist() == [[4, 0], [1, 5], [3, PAD]] and c.held().tolist() == [[2, 2, 1]]
    c.keep(torch.tensor([[[1], [1], [0]]]))  # every row keeps one: no pads
    assert not c.padded and c.positions[0].tolist() == [[0], [5], [3]]


def test_attention_never_sees_pads():
    """A decode step over a padded row equals the same step over that row's entries alone."""
    from kvmini.attention import sdpa_attention

    q = torch.randn(2, 4, 1, 8, generator=torch.Generator().manual_seed(0))
    k = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6).expand(2, 2, 6).clone()
    pos[1, :, 4:] = PAD  # row 1 holds 4 entries
    out = sdpa_attention(q, k, k, torch.tensor([[6], [6]]), pos, padded=True)
    alone = sdpa_attention(q[1:], k[1:, :, :4], k[1:, :, :4], torch.tensor([[6]]), pos[1:, :, :4])
    torch.testing.assert_close(out[1:], alone, atol=1e-6, rtol=0)


def test_heads_with_their_own_counts_attend_and_score_their_own_entries():
    """One sequence whose KV heads hold different counts: each head's output and column sums (a prompt
    chunk and a decode step) equal that head's attention over its held entries alone."""
    from kvmini.attention import Statistic, attend

    wants = {"column_sums": Statistic()}

    gen = torch.Generator().manual_seed(2)
    lc = LayerCache(1, 2, 8, torch.float32, "cpu")
    lc.append(torch.randn(1, 2, 7, 8, generator=gen), torch.randn(1, 2, 7, 8, generator=gen), torch.arange(7)[None])
    lc.keep(torch.tensor([[[0, 2, 5, 6], [1, 3, 4, 0]]]), counts=torch.tensor([[4, 3]]))  # head 1: 3 and a pad
    for T in (3, 1):  # a chunk of queries, then one
        seen = int(lc.positions[lc.positions != PAD].max()) + 1
        q = torch.randn(1, 4, T, 8, generator=gen)  # 2 query heads per KV head
        lc.append(torch.randn(1, 2, T, 8, generator=gen), torch.randn(1, 2, T, 8, generator=gen),
                  torch.arange(seen, seen + T)[None])
        q_pos = torch.arange(seen, seen + T)[None]
        out, stats = attend(q, lc.keys, lc.values, q_pos, lc.positions, wants, padded=lc.padded)
        for h in range(2):
            n = int(lc.held()[0, h])
            k, v, p = lc.keys[:, h : h + 1, :n], lc.values[:, h : h + 1, :n], lc.positions[:, h : h + 1, :n]
            alone, alone_stats = attend(q[:, 2 * h : 2 * h + 2], k, v, q_pos, p, wants, padded=True)
            torch.testing.assert_close(out[:, 2 * h : 2 * h + 2], alone, atol=1e-6, rtol=0)
            torch.testing.assert_close(stats["column_sums"][:, h, :n], alone_stats["column_sums"][:, 0], atol=1e-6, rtol=0)
            assert stats["column_sums"][:, h, n:].eq(0).all()  # pads get no attention


def test_evict_one_moves_the_last_entry_into_the_slot():
    """LayerCache.evict's worked example: positions [0, 1, 2, 3, 4], slot 1 evicted -> [0, 4, 2, 3], the key, value
    and statistics of position 4 moved with it (head 1 evicts the newest itself: nothing moves)."""
    lc = LayerCache(1, 2, 1, torch.float32, "cpu")
    for t in range(5):
        lc.append(torch.full((1, 2, 1, 1), float(t)), torch.full((1, 2, 1, 1), 10.0 * t), torch.tensor([[t]]))
    lc.declare("score")
    lc.aux("score")[:] = torch.arange(5.0) / 10
    lc.evict_one(torch.tensor([[1, 4]]))  # head 0 drops entry 1, head 1 drops the newest
    assert lc.length == 4
    assert lc.positions.tolist() == [[[0, 4, 2, 3], [0, 1, 2, 3]]]
    assert lc.keys[..., 0].tolist() == [[[0, 4, 2, 3], [0, 1, 2, 3]]]
    assert lc.values[..., 0].tolist() == [[[0, 40, 20, 30], [0, 10, 20, 30]]]
    torch.testing.assert_close(lc.aux("score"), torch.tensor([[[0.0, 0.4, 0.2, 0.3], [0.0, 0.1, 0.2, 0.3]]]))


def test_aux_buffers_are_declared_before_use():
    """A statistic kept in the cache is declared by the method that owns it (its `aux`); a name never
    declared (a typo) is an error, not a silent buffer of zeros."""
    from kvmini.errors import KvminiError
    from kvmini.methods.h2o import H2O
    from kvmini.methods.weightedkv import WeightedKV

    lc = LayerCache(batch=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    lc.append(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), torch.arange(3)[None])
    with pytest.raises(KvminiError, match="no aux buffer 'attention_sum' in this cache"):
        lc.aux("attention_sum")
    lc.declare(*H2O.aux, *WeightedKV.aux)
    assert sorted(lc.aux_names()) == ["a", "attention_sum", "n"] and lc.aux("a").tolist() == [[[0.0, 0.0, 0.0]]]
    with pytest.raises(KvminiError, match=r"no aux buffer 'atention_sum' .*declared: attention_sum, a, n"):
        lc.aux("atention_sum")


def test_aux_buffers_keep_their_dtype_through_every_eviction_and_count_in_bytes():
    """A bool and an int buffer follow keep, evict_one and padded rows like a float one, stay of their
    dtype, and count in aux_nbytes (not in the K/V bytes)."""

    lc = LayerCache(2, 1, 1, torch.float32, "cpu")
    lc.declare(("seen", torch.bool), ("count", torch.int32), "sum")
    for t in range(5):
        lc.append(torch.full((2, 1, 1, 1), float(t)), torch.zeros(2, 1, 1, 1), torch.tensor([[t], [t]]))
    lc.aux("seen")[:] = torch.tensor([True, False, True, False, True])
    lc.aux("count")[:] = torch.arange(5, dtype=torch.int32) * 10
    assert lc.aux_nbytes() == (1 + 4 + 4) * 2 * 5 and lc.nbytes() == 2 * 2 * 4 * 5  # 2 rows x 5 entries
    lc.evict_one(torch.tensor([[1], [4]]))  # row 0 drops entry 1 (entry 4 moves in), row 1 the newest
    assert lc.aux("seen").tolist() == [[[True, True, True, False]], [[True, False, True, False]]]
    assert lc.aux("count").tolist() == [[[0, 40, 20, 30]], [[0, 10, 20, 30]]]
    keep_row(lc, 0, torch.tensor([[0, 2]]))  # row 0 keeps its entries 0 and 2: positions 0, 2
    assert lc.held().tolist() == [[2], [4]] and lc.aux("seen").dtype == torch.bool and lc.aux("count").dtype == torch.int32
    assert lc.aux("count")[0, 0, :2].tolist() == [0, 20] and lc.aux("seen")[0, 0, 2:].tolist() == [False, False]
    assert lc.aux_nbytes() == 9 * (2 + 4)


def test_an_aux_buffer_of_several_values_per_entry_moves_whole():
    """A (w,)-shaped buffer (e.g. a history of flags) moves with its entry through evict_one and keep."""
    lc = LayerCache(1, 1, 1, torch.float32, "cpu")
    lc.declare(("history", torch.bool, (3,)))
    for t in range(4):
        lc.append(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), torch.tensor([[t]]))
    lc.aux("history")[0, 0] = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1]], dtype=torch.bool)
    assert lc.aux_nbytes() == 3 * 4
    lc.evict_one(torch.tensor([[1]]))  # entry 3 (all ones) moves into slot 1
    assert lc.aux("history")[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 1]]
    lc.keep(torch.tensor([[[2, 0]]]))
    assert lc.aux("history")[0, 0].int().tolist() == [[0, 0, 1], [1, 0, 0]]


def test_a_buffer_of_several_values_per_entry_holds_each_value_of_every_entry_side_by_side():
    """One value of every entry (a history's slot, which a decode step writes) is contiguous in memory:
    in the declared buffer, and after it grows and shrinks."""
    side_by_side = lambda buf: buf[..., 1].stride(2) == 1  # noqa: E731  entries one element apart
    lc = LayerCache(1, 2, 1, torch.float32, "cpu")
    lc.declare(("history", torch.int16, (5,)))
    assert side_by_side(lc.aux("history"))
    lc.append(torch.zeros(1, 2, 300, 1), torch.zeros(1, 2, 300, 1), torch.arange(300)[None, None].expand(1, 2, 300))
    lc.aux("history")[..., 3] = torch.arange(300, dtype=torch.int16)
    assert side_by_side(lc.aux("history"))  # grown
    lc.keep(torch.arange(0, 300, 10)[None, None].expand(1, 2, 30))
    assert lc.capacity < 300 and side_by_side(lc.aux("history"))  # shrunk
    assert lc.keys.stride(3) == 1 and lc.values.stride(3) == 1  # keys and values stay entry by entry
    assert lc.aux("history")[0, 1, :, 3].tolist() == list(range(0, 300, 10))


def test_the_report_rounds_the_counts_of_heads_that_keep_their_own():
    """A layer whose heads keep their own counts holds a mean over them (`lengths()`, a float): the report
    prints it to one decimal, and a whole count as an integer."""
    means = [169.6666717529297, 169.8, 170.0]  # float32 means, as lengths() gives them
    assert layer_bars(means, 170, per_line=3)[0].endswith("169.7 169.8 170")
    held = type("Held", (), {"lengths": lambda self: means, "nbytes": lambda self: 0})()
    assert cache_summary(held).startswith("3 layers, 169.7/169.8/170 entries (min/mean/max)")
    assert layer_bars([8, 4, 1], 8, per_line=3) == ["layers 0-2     █▄▁  8 4 1"]
