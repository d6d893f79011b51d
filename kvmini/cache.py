"""The explicit KV cache: what a transformer remembers about the tokens it has seen.

Per layer we store, for every KV head (never expanded to query heads):
    keys      (B, H_kv, S, D)  after RoPE, so a key never needs re-rotating
    values    (B, H_kv, S, D)
    positions (B, H_kv, S)     absolute token position of each entry
    aux[name] (B, H_kv, S)     per-token statistics a compression policy keeps
                               (e.g. accumulated attention); they follow every gather
S may differ between layers (per-layer budgets); all heads of a layer hold S entries.
Memory held by K and V: 2 * B * H_kv * S * D * bytes_per_element per layer.
Buffers are allocated on a layer's first append (so a prefill that compresses layer by layer
never holds every layer in full), grow geometrically, and shrink when eviction leaves them
at most a quarter full.
"""
import torch

from kvmini.config import ModelConfig


class LayerCache:
    """One layer's keys, values, positions and aux tensors in a growable buffer."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype, device, capacity: int = 256):
        self.reserve = max(int(capacity), 1)  # entries to allocate on the first append
        self._k = torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)  # (B, H_kv, cap, D)
        self._v = torch.empty_like(self._k)  # (B, H_kv, cap, D)
        self._pos = torch.empty(batch, kv_heads, 0, dtype=torch.long, device=device)  # (B, H_kv, cap)
        self._aux: dict[str, torch.Tensor] = {}  # name -> (B, H_kv, cap)
        self.length = 0  # S: entries held

    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, :, : self.length]  # (B, H_kv, S, D), a view

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, : self.length]  # (B, H_kv, S, D), a view

    @property
    def positions(self) -> torch.Tensor:
        return self._pos[:, :, : self.length]  # (B, H_kv, S), a view

    @property
    def capacity(self) -> int:
        return self._k.shape[2]

    def aux(self, name: str) -> torch.Tensor:
        """Per-token statistic `name` of the held entries, (B, H_kv, S); zeros when first asked for."""
        if name not in self._aux:
            self._aux[name] = torch.zeros(self._pos.shape, dtype=torch.float32, device=self._pos.device)
        return self._aux[name][:, :, : self.length]

    def aux_names(self) -> list[str]:
        return list(self._aux)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Add T new entries: k, v (B, H_kv, T, D); pos (B, T) absolute positions. Amortized O(T)."""
        T = k.shape[2]
        end = self.length + T
        if end > self.capacity:
            self._resize(max(end, 2 * self.capacity, self.reserve))
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
        self._pos[:, :, self.length : end] = pos[:, None, :]
        for buf in self._aux.values():
            buf[:, :, self.length : end] = 0
        self.length = end

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only entries `idx` (B, H_kv, S') of every head, in that order; S' may be < S."""
        S_new = idx.shape[2]
        k_idx = idx[..., None].expand(-1, -1, -1, self._k.shape[3])  # (B, H_kv, S', D)
        self._k[:, :, :S_new] = self.keys.gather(2, k_idx)
        self._v[:, :, :S_new] = self.values.gather(2, k_idx)
        self._pos[:, :, :S_new] = self.positions.gather(2, idx)
        for buf in self._aux.values():
            buf[:, :, :S_new] = buf[:, :, : self.length].gather(2, idx)
        self.length = S_new
        if 4 * S_new <= self.capacity and self.capacity > 64:  # give memory back after a big eviction
            self._resize(max(2 * S_new, 64))

    @property
    def entry_nbytes(self) -> int:
        """Bytes of one entry's key and value over the batch and KV heads: 2 * B * H_kv * D * bytes."""
        B, H_kv, _, D = self._k.shape
        return 2 * B * H_kv * D * self._k.element_size()

    def nbytes(self) -> int:
        """Exact bytes of the keys and values held (positions and aux bookkeeping excluded)."""
        return self.entry_nbytes * self.length

    def _resize(self, cap: int) -> None:
        """Move the held entries into buffers of `cap` entries (cap >= length)."""
        def resized(buf):
            new = buf.new_empty(buf.shape[:2] + (cap,) + buf.shape[3:])
            new[:, :, : self.length] = buf[:, :, : self.length]
            return new

        self._k, self._v, self._pos = resized(self._k), resized(self._v), resized(self._pos)
        self._aux = {name: resized(buf) for name, buf in self._aux.items()}


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

    def lengths(self) -> list[int]:
        """Entries held per layer."""
        return [layer.length for layer in self.layers]

    def nbytes(self) -> int:
        """Exact bytes of all keys and values held."""
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_nbytes(self) -> int:
        """Bytes of the K/V buffers actually allocated (held entries plus room to grow)."""
        return sum(layer.entry_nbytes * layer.capacity for layer in self.layers)

    def full_nbytes(self) -> int:
        """Bytes of keys and values an uncompressed cache would hold now (seen_tokens per layer)."""
        return sum(layer.entry_nbytes * self.seen_tokens for layer in self.layers)

    def summary(self) -> str:
        """One line: layers, entries held (min/mean/max over layers), bytes."""
        n = self.lengths()
        return (
            f"{len(n)} layers, {min(n)}/{sum(n) / len(n):.1f}/{max(n)} entries (min/mean/max), "
            f"{self.nbytes() / 2**20:.2f} MiB of K/V"
        )
