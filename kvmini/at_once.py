"""A decode step with every layer's eviction at once (docs/design.md, "A decode step: every layer at once").

A decode step evicts one entry per head in each layer. Layer l's eviction changes only layer l's
cache, which no later layer of the same call reads, so waiting changes nothing: `after_attention`
records the layers one entry over their budget, and `end` evicts them together, held as the rows of
one LayerCache (`join`), in one op per step instead of one per layer:

    joint = join(cache, layers)                         (len(layers) * B, H_kv, S)
    scorer.update(joint, stacked stats);  score = scorer(joint, stacked stats)
    compressor.evict_one_each(layers, joint, score, budgets, newest)

The layers whose budget is far above the others' (`joinable`) are a second such group, so that
the rows of the first are not as long as theirs.

With `evict_every = N > 1` a layer holds up to budget + N - 1 entries and evicts N at once, so
most decode steps evict nowhere; an accumulating scorer (Scissorhands' history) still updates its
sums in every layer. In such a step `end` does only that, for all layers at once,

    scorer.update(join(cache, layers, room=N), stacked stats)

and in the step that evicts, the layers N over their budget drop N entries each, at once
(`compressor.evict_few_each`), or, where the compressor cannot (a merge, rows of different
lengths), one layer after the other from the joined score.

Every other call runs kvmini.policy's layer-by-layer loop, the specification; `together = False`
runs it for decode steps too, and tests/test_together.py proves both leave the same caches.
"""
import sys

import torch

from kvmini.cache import PAD, KVCache, LayerCache, entry_buffer
from kvmini.parts import PREFILL
from kvmini.per_sequence import PaddedLayer
from kvmini.policy import Policy
from kvmini.statistics import DECLARED, Request, Stats


class AtOnce(Policy):
    """A Policy whose decode steps evict from every layer at once, in `end`."""

    together = True  # False: decode steps too run the layer-by-layer loop (kvmini.policy)

    @classmethod
    def of(cls, policy: Policy) -> Policy:
        """`policy` with this decode step, when its schedule evicts while decoding and its compressor
        has `evict_one_each`; else `policy` itself."""
        if policy.schedule == PREFILL or not policy.compressor.one_each:
            return policy
        fast = cls(policy.name, policy.budget, *policy.parts, policy.schedule, policy.prefill_chunk)
        fast.evict_every = policy.evict_every
        return fast

    def _new_prompt(self) -> None:
        super()._new_prompt()
        self.join_limit: int | None = None  # the longest budget a layer may have to be evicted with the others
        self.long_together = False  # are the layers budgeted over join_limit evicted together? (set with it)
        self.deferred: list[tuple[int, Stats]] | None = None  # this step's (layer, stats) waiting for `end`
        self.update_only = False  # evict_every > 1 and no layer evicts in this step: `end` only updates the sums

    def begin(self, cache: KVCache, T: int) -> None:
        super().begin(cache, T)
        call = self.call
        at_once = (self.together and call.compress_now and T == 1 and not call.in_prompt
                   and isinstance(cache, KVCache) and self.budgeter.known(0) is not None)
        self.update_only = False
        if at_once and self.evict_every > 1 and not self.evicts_anywhere(cache):  # only the scorer's update, at once
            at_once = self.update_only = call.updates
        self.deferred = [] if at_once else None  # None: this call runs layer by layer

    def evicts_anywhere(self, cache: KVCache) -> bool:
        """Will some layer exceed its budget + evict_every - 1 entries in this decode step (or is a budget unknown)?"""
        for layer in range(len(cache)):
            if not self.budgeter.skips(layer):
                known = self.budgeter.known(layer)
                if known is None or cache[layer].length + 1 > known + self.evict_every - 1:
                    return True
        return False

    def request(self, layer: int) -> Request | None:
        if self.deferred is None:
            return super().request(layer)
        if self.budgeter.skips(layer):
            return None
        wanted = self.call.updates or self.call.cache[layer].length + 1 > self.budgeter.known(layer)
        return self.scorer.request if wanted else None  # without building a request: the scorer's, or none

    def after_attention(self, layer: int, cache: KVCache, stats: Stats) -> None:
        if (self.deferred is not None and not self.budgeter.skips(layer)
                and (self.update_only or cache[layer].length - self.evict_every == self.budgeter.known(layer))
                and (self.budgeter.known(layer) <= self.joinable() or self.long_together)):
            self.deferred.append((layer, stats))  # updated (scored and evicted) with the other layers in `end`
            return
        super().after_attention(layer, cache, stats)

    def joinable(self) -> int:
        """The longest budget of a layer evicted with the others: twice the median budget. The joined rows
        are as long as the longest of them, so a layer far longer than the rest (D2O's paper allocation
        gives some layers the whole prompt) would make every row that long: those are joined apart, as a
        second group, when there are several (`long_together`); one is evicted on its own."""
        if self.join_limit is None:
            budgets = sorted(b for b in (self.budgeter.known(l) for l in range(len(self.call.cache))) if b < sys.maxsize)
            self.join_limit = 2 * budgets[len(budgets) // 2] if budgets else 0
            self.long_together = sum(b > self.join_limit for b in budgets) > 1
        return self.join_limit

    def end(self, cache: KVCache) -> None:
        """The deferred evictions of this decode step (one entry each, or evict_every's batch; or only the
        scorer's updates): the layers far longer than the rest (`joinable`) at once, then all the others at once."""
        if not self.deferred:
            return
        long = {layer for layer, _ in self.deferred if self.budgeter.known(layer) > self.joinable()}
        for group in ([d for d in self.deferred if d[0] in long], [d for d in self.deferred if d[0] not in long]):
            if group:
                self.evict_together(cache, group)
        self.deferred = []

    def evict_together(self, cache: KVCache, deferred: list[tuple[int, Stats]]) -> None:
        """evict_every entries out of each of these (layer, stats), held as the rows of one joined cache;
        in an `update_only` step, only the scorer's update. The joined buffers have room for evict_every
        new entries, so that the layers grow between evictions without leaving them (`join`)."""
        call, layers = self.call, tuple(layer for layer, _ in deferred)
        joint = join(cache, layers, room=self.evict_every)
        stats = Stacked([stats for _, stats in deferred], joint)
        if call.updates:
            self.scorer.update(joint, stats, call.start, call.T)
        if self.update_only:
            return
        score = self.scorer(joint, stats)  # (R, H_kv, S), R = len(layers) * B
        budgets, N = [self.budgeter.known(layer) for layer in layers], self.evict_every
        if N == 1:
            joined = True
            self.compressor.evict_one_each(layers, joint, score, budgets, call.start + call.T - 1)
        else:
            joined = self.compressor.evict_few_each(layers, joint, score, budgets)
        B = cache[layers[0]].keys.shape[0]
        for i, (layer, b) in enumerate(zip(layers, budgets)):  # each drops N entries
            if joined:  # from the joined rows, which are views of the layer's buffers
                cache[layer].length -= N
            else:  # the compressor cannot (a merge, rows of different lengths): layer after layer, from its rows of the score
                self.compressor(layer, cache[layer], score[i * B : (i + 1) * B, :, : cache[layer].length], b)
            self.evicted[layer] += N


class Stacked:
    """The statistics of the layers `AtOnce.end` evicts together, as the rows of the joined cache
    (len(layers) * B, H_kv, S), read as a Stats is: each is stacked when first read, the rows of
    shorter layers padded with zeros."""

    def __init__(self, per_layer: list[Stats], joint: LayerCache):
        self.per_layer, self.S, self.stacked = per_layer, joint.length, {}

    def __getattr__(self, name: str) -> torch.Tensor:
        if name not in DECLARED:
            raise AttributeError(name)
        if name not in self.stacked:
            rows = [getattr(stats, name) for stats in self.per_layer]  # (B, H_kv, S_l) each
            if all(t.shape[-1] == self.S for t in rows):
                self.stacked[name] = torch.cat(rows)  # (len(layers) * B, H_kv, S)
            else:  # each layer's rows copied into zeros as long as the longest
                B = rows[0].shape[0]
                out = rows[0].new_zeros(len(rows) * B, *rows[0].shape[1:-1], self.S)  # (len(layers) * B, H_kv, S)
                for i, t in enumerate(rows):
                    out[i * B : (i + 1) * B, :, : t.shape[-1]] = t
                self.stacked[name] = out
        return self.stacked[name]


def join(cache: KVCache, layers: tuple[int, ...], room: int = 1) -> PaddedLayer:
    """The given layers of `cache` as one LayerCache whose batch rows are theirs, layer after layer
    (len(layers) * B rows): their buffers become views of its buffers, so one operation on it acts
    on all of them (a decode step's evictions). Rows of layers that hold different
    counts are padded after their entries, as the rows of a batch are (`PaddedLayer.counts`).

    Built with `room` free places per row beyond the longest layer, by copying the layers in
    (O(S·D) per layer, once); afterwards each call only reads the layers' lengths, until a layer
    leaves (it outgrew its room and was resized, or gained a statistic the others lack): then the
    layers are copied into new shared buffers. Several disjoint sets of layers may be joined at a time
    (`AtOnce` joins the layers far longer than the rest apart); a set that shares a layer with
    a new one is forgotten. The layers must not be padded batches themselves.
    """
    held = tuple(cache.layers[l].length for l in layers)
    if layers not in cache.joined or not all(_is_view(cache, l, cache.joined[layers][0]) for l in layers):
        for other in [o for o in cache.joined if not set(o).isdisjoint(layers)]:
            del cache.joined[other]
        cache.joined[layers] = (_share([cache.layers[l] for l in layers], room), None, None, None)
    joint, last_held, counts, after = cache.joined[layers]
    joint.length = max(held)
    if min(held) == joint.length:
        joint.counts = None
        return joint
    if held != last_held:  # made once per set of lengths (no copy to the device per step)
        B = joint._k.shape[0] // len(layers)
        counts = torch.tensor(held, device=joint._pos.device).repeat_interleave(B)  # (len(layers) * B,)
        after = torch.arange(joint.capacity, device=joint._pos.device) >= counts[:, None, None]  # (rows, 1, cap)
        cache.joined[layers] = (joint, held, counts, after)
    joint.counts = counts
    joint._pos.masked_fill_(after, PAD)  # a row's places after its entries are pads
    return joint


def _is_view(cache: KVCache, layer: int, joint: LayerCache) -> bool:
    """Are layer's buffers still views of `joint`'s (see join)?"""
    lc = cache.layers[layer]
    shared = lc._k.untyped_storage().data_ptr() == joint._k.untyped_storage().data_ptr()
    return shared and lc._aux.keys() == joint._aux.keys()


def _share(members: list[LayerCache], room: int) -> PaddedLayer:
    """One LayerCache holding `members`' entries as its rows; each member's buffers become views of it."""
    first = members[0]
    B, H_kv, _, D = first._k.shape
    cap = max(lc.length for lc in members) + room
    joint = PaddedLayer(B * len(members), H_kv, D, first._k.dtype, first._k.device, cap)
    joint._k = first._k.new_zeros(B * len(members), H_kv, cap, D)  # (len(layers) * B, H_kv, cap, D)
    joint._v = torch.zeros_like(joint._k)
    joint._pos = first._pos.new_full((B * len(members), H_kv, cap), PAD)  # (len(layers) * B, H_kv, cap)
    names = dict.fromkeys(name for lc in members for name in lc._aux)  # every statistic any member keeps
    like = {name: lc._aux[name] for lc in members for name in lc._aux}  # its dtype and per-entry shape
    joint._aux = {name: entry_buffer(joint._pos.shape[:2], joint._pos.shape[2], like[name].shape[3:], like[name].dtype,
                                     like[name].device) for name in names}
    for i, lc in enumerate(members):
        rows, S = slice(i * B, (i + 1) * B), lc.length
        for name, buf in (("_k", lc._k), ("_v", lc._v), ("_pos", lc._pos)):
            getattr(joint, name)[rows, :, :S] = buf[:, :, :S]
            setattr(lc, name, getattr(joint, name)[rows])
        for name in names:
            if name in lc._aux:
                joint._aux[name][rows, :, :S] = lc._aux[name][:, :, :S]
            lc._aux[name] = joint._aux[name][rows]
    return joint
