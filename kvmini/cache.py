"""The explicit KV cache: what a transformer remembers about the tokens it has seen.

Per layer we store, for every KV head (never expanded to query heads):
    keys      (B, H_kv, S, D)  after RoPE, so a key never needs re-rotating
    values    (B, H_kv, S, D)  with the keys in one buffer (B, H_kv, S, 2, D): an entry moves in one op
    positions (B, H_kv, S)     absolute token position of each entry
    aux[name] (B, H_kv, S, ...) per-token statistics a policy keeps (e.g. accumulated attention)
S may differ between layers (per-layer budgets). A head (one KV head of one sequence) may hold fewer
entries than S (`counts`: per-sequence budgets in a batch, heads that keep their own counts): its
entries come first, then pads up to S. A pad's position is PAD, later than any query, so attention,
which masks by position, never sees it: that is the one rule (`padded` says when it is needed).
Buffers are allocated on a layer's first append, grow geometrically, and shrink when at most a
quarter full.
"""
import torch

from kvmini.config import ModelConfig
from kvmini.errors import KvminiError


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in the precision of statistics and merges: float32, or float64 when t already is (a float64
    model decides in float64: the recorded-behaviour tests rely on it)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()

PAD = torch.iinfo(torch.long).max  # the position of a pad entry: no query is late enough to see it


def along(idx: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """Entry indices idx (B, H_kv, s) for gather/scatter on a per-entry buffer (B, H_kv, cap, *rest)."""
    rest = buf.shape[3:]
    return idx if not rest else idx.view(*idx.shape, *(1,) * len(rest)).expand(*idx.shape, *rest)


def entry_buffer(lead: tuple, cap: int, rest: tuple, dtype, device) -> torch.Tensor:
    """Zeros for a per-entry buffer (*lead, cap, *rest), lead = (B, H_kv), laid out (*lead, *rest, cap) in
    memory: a step writing one value of every entry's history (rest = (w,)) writes contiguous memory."""
    return torch.zeros(*lead, *rest, cap, dtype=dtype, device=device).movedim(-1, len(lead))


def kv_buffer(B: int, H_kv: int, cap: int, D: int, dtype, device) -> torch.Tensor:
    """Keys and values of `cap` entries, (B, H_kv, cap, 2, D), laid out (B, H_kv, 2, cap, D) in memory: an entry's
    key and value move in one op, and the keys (the values) of a head stay contiguous, as attention reads them."""
    return torch.empty(B, H_kv, 2, cap, D, dtype=dtype, device=device).transpose(2, 3)


class LayerCache:
    """One layer's keys, values, positions and aux tensors in a growable buffer."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype, device, capacity: int = 256):
        self.reserve = max(int(capacity), 1)  # entries to allocate on the first append
        self._kv = kv_buffer(batch, kv_heads, 0, head_dim, dtype, device)  # (B, H_kv, cap, 2, D)
        self._k, self._v = self._kv.select(3, 0), self._kv.select(3, 1)  # (B, H_kv, cap, D) each: views of it
        self._pos = torch.empty(batch, kv_heads, 0, dtype=torch.long, device=device)  # (B, H_kv, cap)
        self._aux: dict[str, torch.Tensor] = {}  # name -> (B, H_kv, cap, *shape)
        self.length = 0  # S: entries held (by the longest head)
        self.counts: torch.Tensor | None = None  # (B, H_kv) entries each head holds when heads differ, else None
        b, h = torch.arange(batch, device=device), torch.arange(kv_heads, device=device)
        self.per_head, self.per_entry = (b[:, None], h), (b[:, None, None], h[:, None])  # index slots (B, H_kv), (B, H_kv, s)

    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, :, : self.length]  # (B, H_kv, S, D), a view

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, : self.length]  # (B, H_kv, S, D), a view

    @property
    def entry_kv(self) -> torch.Tensor:
        return self._kv[:, :, : self.length]  # (B, H_kv, S, 2, D): each entry's key and value, a view

    @property
    def positions(self) -> torch.Tensor:
        return self._pos[:, :, : self.length]  # (B, H_kv, S), a view

    @property
    def capacity(self) -> int:
        return self._pos.shape[2]

    @property
    def batch(self) -> int:
        return self._pos.shape[0]  # B: the sequences of the batch

    @property
    def padded(self) -> bool:
        """Do some heads hold fewer entries than `length`, the rest of their places being pads?"""
        return self.counts is not None

    def held(self) -> torch.Tensor:
        """Entries each head holds, (B, H_kv)."""
        return self._pos.new_full(self._pos.shape[:2], self.length) if self.counts is None else self.counts

    def declare(self, *buffers: "str | tuple") -> None:
        """Per-entry buffers, zeros until written, that follow every append and eviction: a name (one float
        per entry), (name, dtype), or (name, dtype, shape) for several values per entry (a history: (w,)).
        A part lists them (Scorer.aux), the policy declares them."""
        for spec in buffers:
            name, dtype, shape = (spec, wide(self._kv).dtype, ()) if isinstance(spec, str) else (*spec, ())[:3]
            if name not in self._aux:
                self._aux[name] = entry_buffer(self._pos.shape[:2], self._pos.shape[2], shape, dtype, self._pos.device)

    def aux(self, name: str) -> torch.Tensor:
        """Per-token statistic `name` of the held entries, (B, H_kv, S, *shape); a name never declared is an error."""
        if name not in self._aux:
            raise KvminiError(f"no aux buffer {name!r} in this cache (declared: {', '.join(self._aux) or 'none'}); "
                              "a method lists the buffers it keeps in its `aux`, and declares them at a run's first call")
        return self._aux[name][:, :, : self.length]

    def aux_names(self) -> list[str]:
        return list(self._aux)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Add T new entries: k, v (B, H_kv, T, D); pos (B, T) absolute positions, each head's right after
        its own entries. Amortized O(T). The cache keeps values, not an autograd graph (a model run with grad)."""
        k, v = (k.detach(), v.detach()) if k.requires_grad else (k, v)
        T = k.shape[2]
        end = self.length + T
        if end > self.capacity:
            self._resize(max(end, 2 * self.capacity, self.reserve))
        if self.counts is not None:
            return self._append_ragged(k, v, pos, end)
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
        self._pos[:, :, self.length : end] = pos[:, None, :]
        for buf in self._aux.values():  # a new entry's statistics start at 0
            buf.narrow(2, self.length, T).zero_()
        self.length = end

    def _append_ragged(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, end: int) -> None:
        """`append` when heads differ: head r's T entries go to its places counts[r]..counts[r] + T - 1."""
        self._kv[:, :, self.length : end] = 0  # places no head reaches: pads, their keys and values finite (0 * v = 0)
        self._pos[:, :, self.length : end] = PAD
        at = self.counts[..., None] + torch.arange(k.shape[2], device=self.counts.device)  # (B, H_kv, T)
        self._kv.scatter_(2, along(at, self._kv), torch.stack([k, v], 3))
        self._pos.scatter_(2, at, pos[:, None, :].expand_as(at))
        for buf in self._aux.values():  # a new entry's statistics start at 0
            buf.scatter_(2, along(at, buf), 0)
        self.counts = self.counts + k.shape[2]
        self.length = end

    def keep(self, idx: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Keep only entries `idx` (B, H_kv, S') of every head, in that order: the bulk eviction, O(S·D); the
        places it leaves become pads. counts (B, H_kv): head r keeps only the first counts[r] of its idx."""
        S = idx.shape[2]
        pads = None if counts is None else torch.arange(S, device=idx.device) >= counts[..., None]  # (B, H_kv, S')
        for buf in (self._kv, self._pos, *self._aux.values()):  # (B, H_kv, cap, ...)
            buf[:, :, :S] = buf[:, :, : self.length].gather(2, along(idx, buf))
            buf[:, :, S : self.length] = PAD if buf is self._pos else 0  # the places left: pads
            if pads is not None:
                buf[:, :, :S].masked_fill_(along(pads, buf), PAD if buf is self._pos else 0)
        self.length = S if counts is None else int(counts.max())  # the longest head
        self.counts = None if counts is None or bool((counts == self.length).all()) else counts
        self._shrink()

    def evict_one(self, slot) -> None:
        """`evict`, `slot` checked first (an int: that slot in every head): for a caller outside a method's step."""
        self.evict(self._slot(slot))

    def evict(self, slot: torch.Tensor) -> None:
        """Evict entry `slot` (B, H_kv) of every head in O(D), two ops a buffer: the head's last entry (a decode step's
        new one) takes that slot, the place it leaves becomes a pad. Attention masks by position: order means nothing.
        Example: a head holding positions [0, 1, 2, 3, 4] (4 the new entry), slot 1 evicted -> [0, 4, 2, 3], and the
        key and value of position 4 now in slot 1 (`buf[r, h, last]`, a read by index, is a copy, so one entry may be
        both read and written). The buffer is then no longer in position order: what needs neighbours or an order
        (`selectors.shrink`'s sort, SnapKV's pooling) sorts by position first."""
        r, h = self.per_head  # (B, 1), (H_kv,): with slot (B, H_kv), one index per head
        last = slot.new_full((1,), self.length - 1) if self.counts is None else self.counts - 1  # (1,) or (B, H_kv)
        for buf in (self._kv, self._pos, *self._aux.values()):  # (B, H_kv, cap, ...): a key and its value at once
            buf.index_put_((r, h, slot), buf[r, h, last])  # read by index: a copy, so the two may be one entry
        if self.counts is not None:  # the place left: a pad (without counts it is past length, never read)
            self._pos[r, h, last] = PAD  # its key, value and statistics stay: finite, and never seen
        self.length -= 1  # every head held one more: the longest is one shorter (no device sync)
        self.counts = None if self.counts is None else last

    def _slot(self, slot) -> torch.Tensor:
        """`evict_one`'s argument as a (B, H_kv) tensor of held slots (an int: that slot in every head);
        values checked on the CPU only (on a GPU the check would wait for the device every step)."""
        B, H = self._pos.shape[:2]
        if isinstance(slot, int) and not isinstance(slot, bool):
            slot = torch.full((B, H), slot, dtype=torch.long, device=self._pos.device)
        if not isinstance(slot, torch.Tensor) or slot.shape != (B, H) or slot.dtype != torch.long:
            shown = f"{slot.dtype} {tuple(slot.shape)}" if isinstance(slot, torch.Tensor) else repr(slot)
            raise KvminiError(f"evict_one: slot must be a whole number or a long tensor ({B}, {H}) of slots, got {shown}")
        if slot.device.type == "cpu" and bool(((slot < 0) | (slot >= self.held())).any()):
            raise KvminiError(f"evict_one: every slot must be in [0, {self.length - 1}] (entries held), got {slot.tolist()}")
        return slot

    def _shrink(self) -> None:
        """Give memory back after a big eviction: buffers at most a quarter full are halved or more."""
        if 4 * self.length <= self.capacity and self.capacity > 64:
            self._resize(max(2 * self.length, 64))

    @property
    def entry_nbytes(self) -> int:
        """Bytes of one entry's key and value over the batch and KV heads: 2 * B * H_kv * D * bytes."""
        B, H_kv, _, _, D = self._kv.shape
        return 2 * B * H_kv * D * self._kv.element_size()

    def nbytes(self) -> int:
        """Exact bytes of the keys and values held (pads, positions and aux buffers excluded)."""
        return 2 * self._kv.shape[4] * self._kv.element_size() * int(self.held().sum())

    def aux_nbytes(self) -> int:
        """Bytes of the aux buffers' held entries: what a method keeps per token beside K and V."""
        return sum(buf[0, 0, 0].numel() * buf.element_size() for buf in self._aux.values()) * int(self.held().sum())

    def _resize(self, cap: int) -> None:
        """Move the held entries into buffers of `cap` >= length entries (aux buffers as `entry_buffer`)."""
        S = self.length
        B, H_kv, _, _, D = self._kv.shape
        for name, new in (("_kv", kv_buffer(B, H_kv, cap, D, self._kv.dtype, self._kv.device)),
                          ("_pos", self._pos.new_empty(B, H_kv, cap))):
            new[:, :, :S] = getattr(self, name)[:, :, :S]
            setattr(self, name, new)
        self._k, self._v = self._kv.select(3, 0), self._kv.select(3, 1)
        for name, buf in self._aux.items():
            new = entry_buffer(buf.shape[:2], cap, buf.shape[3:], buf.dtype, buf.device)
            new[:, :, :S] = buf[:, :, :S]
            self._aux[name] = new


class KVCache:
    """All layers' caches for one batch of sequences, plus how many tokens were ever appended."""

    def __init__(self, config: ModelConfig, batch: int = 1, dtype=torch.float32, device="cpu", capacity: int = 256):
        self.layers = [
            LayerCache(batch, config.num_kv_heads, config.head_dim, dtype, device, capacity)
            for _ in range(config.num_layers)
        ]
        self.seen_tokens = 0  # position of the next token (not the cache length: eviction shrinks that)

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def lengths(self) -> list[float]:
        """Entries held per layer: the mean over its heads (of every sequence), an int when they agree."""
        return [layer.length if layer.counts is None else layer.counts.float().mean().item() for layer in self.layers]

    def nbytes(self) -> int:
        """Exact bytes of all keys and values held."""
        return sum(layer.nbytes() for layer in self.layers)
