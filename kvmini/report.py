"""run.py's report after the answer: the model, the method and its budgets, the prompt, the speed, and
what the cache kept (a compact per-layer bar chart and byte counts)."""
from kvmini.cache import KVCache
from kvmini.methods.options import show
from kvmini.methods.registry import declarations, resolved_options

BLOCKS = "▁▂▃▄▅▆▇█"
ASCII_BLOCKS = " .:-=+*#"  # the bars where the terminal cannot print block characters


def run_report(folder: str, model, tok, chat, method: str, options: dict, policy, result, encoding: str | None,
               threads: str | None = None) -> list[str]:
    """The report's lines: `result` is kvmini.generate's, `encoding` the terminal's (None: ASCII), `threads`
    how many torch ran on and why (kvmini.threads), if run.py chose."""
    c, vocab = model.config, model.config.vocab_size
    lines = ["", "--- kvmini report ---",
             f"model     {folder} ({c.model_type}, {c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} q/kv heads)"
             f" on {model.device.type} {str(model.dtype).removeprefix('torch.')}"]
    if tok.vocab_size < vocab:
        lines.append(f"vocab     the model has {vocab} output ids, the tokenizer {tok.vocab_size}: "
                     f"the {vocab - tok.vocab_size} ids without text are never sampled")
    lines.append(f"method    {describe(method, options, policy)}")
    if policy is not None and policy.run.note:
        lines.append(f"note      {policy.run.note}")
    lines.append(f"prompt    {result.prompt_tokens} tokens ({type(chat).__name__ if chat else 'raw'} format)")
    lines.append(f"prefill   {result.prefill_s:.3f} s, {result.prompt_tokens / result.prefill_s:.1f} tokens/s"
                 + (f" ({threads})" if threads else ""))
    rate = f", {result.decode_steps / result.decode_s:.1f} tokens/s" if result.decode_steps else ""
    lines.append(f"decode    {max(map(len, result.tokens))} new tokens{rate}")
    return lines + cache_report(result.cache, policy, BLOCKS if can_print(BLOCKS, encoding) else ASCII_BLOCKS)


def describe(method: str, given: dict, policy) -> str:
    """`h2o, budget 0.2 (a ratio) = 123 tokens per layer (window budget // 2, reduce mean)`."""
    if policy is None:
        return method
    options, kinds = resolved_options(method, given), {d.name: d.kind for d in declarations(method)}
    shown = f" ({', '.join(f'{k} {show(v, kinds[k])}' for k, v in options.items())})" if options else ""
    budgets = policy.budgets
    per_layer = f"{budgets[0]}" if len(set(budgets)) == 1 else f"{min(budgets)}-{max(budgets)} (mean {sum(budgets) / len(budgets):.1f})"
    if policy.budget is None:
        share = sum(budgets) / (len(budgets) * policy.run.prompt_end)
        return f"{method}, self-chosen budget {per_layer} tokens per layer = {share:.1%} of the prompt{shown}"
    every = policy.evict_every
    amortised = (f"; evicting {every} entries every {every} decode steps, so a layer holds up to {every - 1} "
                 "more than its budget between evictions") if every > 1 else ""
    whole = float(policy.budget).is_integer()  # a token count as digits (1000000, not 1e+06)
    given_as = (f"{policy.budget} (a ratio)" if isinstance(policy.budget, float) and policy.budget <= 1
                else f"{int(policy.budget)}" if whole else f"{policy.budget:g}")
    unit = "token" if per_layer == "1" else "tokens"
    return f"{method}, budget {given_as} = {per_layer} {unit} per layer{budget_note(policy)}{amortised}{shown}"


def budget_note(policy) -> str:
    """Why the cache holds more than the budget asks (D2O's official protected layers, DynamicKV's
    last L % m layers: a budgeter's own `holds_more_because()`), when it does."""
    run = policy.run
    if run.unchanged is not None:  # a prompt too short to compress: the note says so
        return ""
    protected = sorted(run.protected)
    why = policy.holds_more_because() or (
        f"layers {', '.join(map(str, protected))} are protected (never compressed)" if protected else "")
    asked, budgets = run.mean_budget, policy.budgets
    mean = sum(budgets) / len(budgets)
    if not why or asked is None or mean <= asked:
        return ""
    return f"; a mean above {asked} because {why}"  # (a budget, when it was set: the KV cache line is now)


def can_print(text: str, encoding: str | None) -> bool:
    try:
        text.encode(encoding or "ascii")
        return True
    except (UnicodeEncodeError, LookupError):
        return False


def count(x) -> str:
    """An entry count as printed: 148, or 169.7 for a mean over heads that keep their own counts."""
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


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
        lines.append(f"{label:<14} {bars:<{per_line}}  {' '.join(map(count, part))}")
    return lines


def cache_summary(cache: KVCache) -> str:
    """One line: layers, entries held (min/mean/max over layers), bytes."""
    n = cache.lengths()
    return (
        f"{len(n)} layers, {count(min(n))}/{sum(n) / len(n):.1f}/{count(max(n))} entries (min/mean/max), "
        f"{cache.nbytes() / 2**20:.2f} MiB of K/V"
    )


def full_nbytes(cache: KVCache) -> int:
    """Bytes of keys and values an uncompressed cache would hold now (seen_tokens per layer)."""
    return sum(layer.entry_nbytes * cache.seen_tokens for layer in cache.layers)


def allocated_nbytes(cache: KVCache) -> int:
    """Bytes of the K/V buffers actually allocated (held entries plus room to grow)."""
    return sum(layer.entry_nbytes * layer.capacity for layer in cache.layers)


def aux_nbytes(cache: KVCache) -> int:
    """Exact bytes of every layer's aux buffers (the method's per-token statistics)."""
    return sum(layer.aux_nbytes() for layer in cache.layers)


def cache_report(cache: KVCache, policy=None, blocks: str = BLOCKS) -> list[str]:
    """Report lines: entries per layer, kept vs full bytes, evictions and merges."""
    kept = cache.lengths()
    top = max(max(kept), 1)
    lines = [f"KV cache  {cache_summary(cache)}"]
    lines += [f"kept      {line}" for line in layer_bars(kept, top, blocks=blocks)]
    lines[-1] += f"   ({blocks[-1]} = {count(top)} token{'s' * (top != 1)}; the full cache holds {cache.seen_tokens})"
    ratio = cache.nbytes() / max(full_nbytes(cache), 1)
    lines.append(f"bytes     {cache.nbytes() / 2**20:.2f} MiB kept vs {full_nbytes(cache) / 2**20:.2f} MiB full "
                 f"(ratio {ratio:.3f}); {allocated_nbytes(cache) / 2**20:.2f} MiB allocated")
    if aux := aux_nbytes(cache):
        lines.append(f"aux       {aux / 2**20:.2f} MiB of per-token statistics the method keeps beside K/V "
                     f"({', '.join(dict.fromkeys(n for lc in cache.layers for n in lc.aux_names()))})")
    if policy is not None and policy.run.compresses and policy.schedule == "prefill" and cache.seen_tokens > policy.run.prompt_end:
        lines.append(f"appended  each layer's last {cache.seen_tokens - policy.run.prompt_end} entries were appended while "
                     "decoding, after the prompt was compressed (this method compresses the prompt only)")
    if policy is not None:
        total, merged = sum(policy.evicted), sum(policy.merged)
        how = f", {merged:.0f} of them merged into kept tokens (mean over KV heads)" if merged else ""
        lines.append(f"evicted   {total} tokens ({total / len(kept):.1f} per layer on average{how})")
    return lines
