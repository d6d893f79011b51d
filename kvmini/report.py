"""Terminal reports of what a compressed cache kept: a compact per-layer bar chart and byte counts."""
from kvmini.cache import KVCache
from kvmini.parts import PREFILL

BLOCKS = "▁▂▃▄▅▆▇█"


def layer_bars(kept: list[int], full: int, per_line: int = 10, blocks: str = BLOCKS) -> list[str]:
    """One line per `per_line` layers: a bar per layer (█ = `full` tokens, ▁ = fewer than full/8) and the counts.
    `blocks`: the eight bar characters, lowest first (ASCII ones where a terminal lacks these).

    layer_bars([8, 4, 1], 8, per_line=3) -> ["layers 0-2     █▄▁  8 4 1"]
    """
    lines = []
    for start in range(0, len(kept), per_line):
        part = kept[start : start + per_line]
        bars = "".join(blocks[max(0, min(7, -(-k * 8 // full) - 1))] for k in part)
        label = f"layers {start}-{start + len(part) - 1}"
        lines.append(f"{label:<14} {bars:<{per_line}}  {' '.join(map(str, part))}")
    return lines


def cache_report(cache: KVCache, policy=None, blocks: str = BLOCKS) -> list[str]:
    """Report lines: entries per layer, kept vs full bytes, evictions and merges."""
    kept = cache.lengths()
    top = max(max(kept), 1)
    lines = [f"KV cache  {cache.summary()}"]
    lines += [f"kept      {line}" for line in layer_bars(kept, top, blocks=blocks)]
    lines[-1] += f"   ({blocks[-1]} = {top} tokens; the full cache holds {cache.seen_tokens})"
    ratio = cache.nbytes() / max(cache.full_nbytes(), 1)
    lines.append(f"bytes     {cache.nbytes() / 2**20:.2f} MiB kept vs {cache.full_nbytes() / 2**20:.2f} MiB full "
                 f"(ratio {ratio:.3f}); {cache.allocated_nbytes() / 2**20:.2f} MiB allocated")
    if aux := cache.aux_nbytes():
        lines.append(f"aux       {aux / 2**20:.2f} MiB of per-token statistics the method keeps beside K/V "
                     f"({', '.join(dict.fromkeys(n for lc in cache.layers for n in lc.aux_names()))})")
    if policy is not None and policy.active and policy.schedule == PREFILL and cache.seen_tokens > policy.prompt_len:
        lines.append(f"appended  each layer's last {cache.seen_tokens - policy.prompt_len} entries were appended while "
                     "decoding, after the prompt was compressed (this method compresses the prompt only)")
    if policy is not None:
        total, merged = sum(policy.evicted), sum(policy.merged)
        how = f", {merged:.0f} of them merged into kept tokens (mean over KV heads)" if merged else ""
        lines.append(f"evicted   {total} tokens ({total / len(kept):.1f} per layer on average{how})")
    return lines
