"""A decode step with every layer's eviction at once (docs/design.md, "A decode step: every layer at once").

A wrapper outside the specification: layer l's eviction changes only layer l's cache, which no later
layer of the same call reads, so `after_attention` records the layers over their budget and `end`
runs the same scorer and compressor calls as kvmini.policy's loop, once, on those layers held as the
rows of one LayerCache (`Stack`, a shorter layer's rows padded), instead of once per layer:

    scorer.update(joint, stacked stats);  score = scorer(joint, stacked stats)
    compressor(layers, joint, score, budgets per row, newest)

Every other call, and `together = False`, runs the loop itself (tests/test_together.py: the same caches).
"""
import torch
import torch.nn.functional as F

from kvmini.cache import PAD, KVCache, LayerCache, entry_buffer
from kvmini.parts import PREFILL
from kvmini.policy import Policy
from kvmini.statistics import Stats


class AtOnce(Policy):
    """A Policy whose decode steps compress every layer at once, in `end`."""

    together = True  # False: decode steps too run the layer-by-layer loop (kvmini.policy)

    @classmethod
    def of(cls, policy: Policy) -> Policy:
        """`policy` with this decode step when its schedule compresses while decoding, else `policy` itself."""
        if policy.schedule == PREFILL:
            return policy
        fast = cls(policy.name, policy.budget, *policy.parts, policy.schedule, policy.prefill_chunk)
        fast.evict_every = policy.evict_every
        return fast

    def _new_prompt(self) -> None:
        super()._new_prompt()
        self.stacks: dict[tuple, Stack] = {}  # layers -> their rows as one LayerCache (kept across steps)
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
        """Will some layer exceed its budget + evict_every - 1 entries in this decode step?"""
        return any(cache[layer].length + 1 > self.budgeter.known(layer) + self.evict_every - 1
                   for layer in range(len(cache)) if not self.budgeter.skips(layer))

    def after_attention(self, layer: int, cache: KVCache, stats: Stats) -> None:
        if (self.deferred is not None and not self.budgeter.skips(layer)
                and (self.update_only or cache[layer].length - self.evict_every == self.budgeter.known(layer))):
            self.deferred.append((layer, stats))  # scored and compressed with the other layers in `end`
            return
        super().after_attention(layer, cache, stats)

    def end(self, cache: KVCache) -> None:
        """The deferred layers of this decode step, at once."""
        if self.deferred:
            self.compress_together(cache, self.deferred)
        self.deferred = []

    def compress_together(self, cache: KVCache, deferred: list[tuple[int, Stats]]) -> None:
        """The loop's steps for these (layer, stats), once, on their rows of one LayerCache; in an
        `update_only` step only the scorer's update."""
        call, layers, N = self.call, tuple(layer for layer, _ in deferred), self.evict_every
        stack = self.stacks.get(layers)
        if stack is None or not stack.holds(cache):
            stack = self.stacks[layers] = Stack(cache, layers, room=N)
        joint, stats = stack.joint, stacked([stats for _, stats in deferred], stack.joint.length)
        if call.updates:
            self.scorer.update(joint, stats, call.start, call.T)
        if self.update_only:
            return
        score = self.scorer(joint, stats)  # (R, H_kv, S), R = len(layers) * B
        newest = call.start + call.T - 1
        if N == 1:  # every row one entry over its budget: one call for all of them
            b = joint.length - 1 if joint.counts is None else joint.counts[:, :1, None] - 1  # (R, 1, 1) where they differ
            self.compressor(layers, joint, score, b, newest)
            for layer in layers:
                cache[layer].length -= 1
        else:  # N entries from each: layer after layer, from its rows of the score
            B = cache[layers[0]].keys.shape[0]
            for i, layer in enumerate(layers):
                lc = cache[layer]
                self.compressor((layer,), lc, score[i * B : (i + 1) * B, :, : lc.length], self.budgeter.known(layer), newest)
        for layer in layers:
            self.evicted[layer] += N


class Stack:
    """The given layers of a cache as the rows of one LayerCache `joint` (layer i: rows i*B..(i+1)*B-1),
    in the cache's ragged layout, so one `LayerCache.evict_one` evicts in all of them. Each layer's buffers
    become views of its rows, so its own appends and evictions act on the joint too. Built by copying the
    layers in (O(S·D) each), with `room` places beyond the longest; then `holds` only checks the views."""

    def __init__(self, cache: KVCache, layers: tuple, room: int):
        members = [cache[layer] for layer in layers]
        first = members[0]
        B, H_kv, _, D = first._k.shape
        R, cap = B * len(members), max(lc.length for lc in members) + room
        joint = LayerCache(R, H_kv, D, first._k.dtype, first._k.device, cap)
        joint._k = first._k.new_zeros(R, H_kv, cap, D)  # (R, H_kv, cap, D)
        joint._v = torch.zeros_like(joint._k)
        joint._pos = first._pos.new_full((R, H_kv, cap), PAD)  # (R, H_kv, cap)
        like = {name: buf for lc in members for name, buf in lc._aux.items()}  # every statistic any layer keeps
        joint._aux = {name: entry_buffer((R, H_kv), cap, buf.shape[3:], buf.dtype, buf.device) for name, buf in like.items()}
        for i, lc in enumerate(members):
            rows, n = slice(i * B, (i + 1) * B), lc.length
            for name in ("_k", "_v", "_pos"):
                getattr(joint, name)[rows, :, :n] = getattr(lc, name)[:, :, :n]
                setattr(lc, name, getattr(joint, name)[rows])
            for name, buf in joint._aux.items():
                if name in lc._aux:
                    buf[rows, :, :n] = lc._aux[name][:, :, :n]
                lc._aux[name] = buf[rows]
        self.cache, self.layers, self.joint = cache, layers, joint
        self.views = [(lc._k, dict(lc._aux)) for lc in members]
        self.holds(cache)

    def holds(self, cache: KVCache) -> bool:
        """Are the layers of `cache` still views of `joint` (then the joint's rows take their counts)?"""
        if cache is not self.cache:
            return False
        for layer, (k, aux) in zip(self.layers, self.views):
            lc = cache[layer]
            if lc._k is not k or lc._aux.keys() != aux.keys() or any(lc._aux[n] is not a for n, a in aux.items()):
                return False
        lengths = [cache[layer].length for layer in self.layers]
        R, H_kv = self.joint._pos.shape[:2]
        self.joint.length = max(lengths)
        self.joint.counts = None if min(lengths) == max(lengths) else torch.tensor(
            lengths, device=self.joint._pos.device).repeat_interleave(R // len(lengths))[:, None].expand(R, H_kv)
        return True


def stacked(per_layer: list[Stats], S: int) -> Stats:
    """The layers' statistics as a Stack's rows (len(layers) * B, H_kv, S), shorter layers followed by zeros."""
    def widened(t: torch.Tensor) -> torch.Tensor:  # (B, H_kv, S_layer) -> (B, H_kv, S)
        return t if t.shape[-1] == S else F.pad(t, (0, S - t.shape[-1]))
    return Stats(**{name: torch.cat([widened(getattr(s, name)) for s in per_layer]) for name in per_layer[0]})
