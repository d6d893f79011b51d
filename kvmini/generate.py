"""Prefill + decode loop with greedy / temperature / top-k / top-p sampling.
Prefill: the prompt, whole or in chunks, fills the cache; decode: one token at a time.
"""
import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvmini.cache import KVCache
from kvmini.errors import KvminiError
from kvmini.engine import run_length
from kvmini.model import Transformer


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int | None = None
    vocab: int | None = None  # only ids below this are sampled (a tokenizer smaller than the embedding table)

    def __post_init__(self):
        if not is_number(self.temperature) or self.temperature < 0:
            raise KvminiError(f"Sampling: temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if not is_whole(self.top_k) or self.top_k < 0:
            raise KvminiError(f"Sampling: top_k must be a whole number >= 0 (0: off), got {self.top_k!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise KvminiError(f"Sampling: top_p must be a number in (0, 1] (1: off), got {self.top_p!r}")
        if self.seed is not None and (not is_whole(self.seed) or not 0 <= self.seed < 2**64):
            raise KvminiError(f"Sampling: seed must be None or a whole number in [0, 2**64 - 1], got {self.seed!r}")
        if self.vocab is not None and (not is_whole(self.vocab) or self.vocab < 1):
            raise KvminiError(f"Sampling: vocab must be None or a whole number >= 1, got {self.vocab!r}")


def is_whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def token_ids(ids, vocab: int) -> torch.Tensor:
    """The prompt `ids` as a (B, T) tensor of ids in [0, vocab), or a KvminiError naming what is wrong.
    Nested lists of equal rows are accepted (a single list is one sequence)."""
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.tensor(ids if ids and isinstance(ids[0], (list, tuple)) else [ids], dtype=torch.long)
        except (TypeError, ValueError, RuntimeError, IndexError, OverflowError):
            raise KvminiError("ids must be a (B, T) tensor of token ids or a list of equal-length lists of ints, "
                              f"got {type(ids).__name__} {str(ids)[:60]}") from None
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise KvminiError(f"ids must be a (B, T) tensor with B, T >= 1 (a batch of prompts), got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise KvminiError(f"ids must hold integer token ids, got dtype {str(ids.dtype).removeprefix('torch.')}")
    low, high = ids.min().item(), ids.max().item()
    if low < 0 or high >= vocab:
        raise KvminiError(f"ids must be token ids in [0, {vocab - 1}] (the model's vocabulary), got {low if low < 0 else high}")
    return ids


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per sequence, stop token excluded
    prompt_tokens: int
    prefill_s: float
    decode_s: float  # time of the decode forward passes (the first new token comes from prefill)
    decode_steps: int
    cache: KVCache = field(repr=False)


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> next ids (B,)."""
    logits = logits[:, : s.vocab]  # (B, vocab): ids the tokenizer has no text for are never chosen
    if s.temperature <= 0:
        return logits.argmax(-1)
    # (logits - max) / T in float64, the best token's 0 left alone: any T > 0 keeps the order, never inf or 0/0
    shifted = logits.double() - logits.double().amax(-1, keepdim=True)  # (B, V), <= 0
    logits = torch.where(shifted == 0, shifted, shifted / s.temperature)
    if s.top_k > 0:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > s.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def check_finite(logits: torch.Tensor, t: int) -> None:
    """A model whose weights or dtype overflow gives NaN/inf logits: say so instead of answering nothing."""
    if not torch.isfinite(logits).all():
        where = "the prompt" if t == 0 else f"decode step {t}"
        raise KvminiError(f"the model produced non-finite logits (NaN or inf) at {where}: broken weights, "
                          "or a dtype too narrow for them (try --dtype float32)")


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work (no-op on CPU), so that timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model: Transformer, ids: torch.Tensor, cache: KVCache, policy=None, chunk_size: int | None = None,
            total_len: int | None = None, on_progress: Callable[[float], None] | None = None):
    """ids (B, T) -> logits of the last position (B, V), in pieces of chunk_size. On a cache that holds
    tokens, ids are the run's next prompt (docs/design.md, "A cache that lives on"). total_len (the run's
    length, if known) lets a policy skip statistics its budget never needs. on_progress(done) hears the
    tokens done after every layer (c/L per layer for a chunk of c)."""
    if not isinstance(model, Transformer):
        raise KvminiError(f"model must be a kvmini Transformer (kvmini.loading.load_model), got {type(model).__name__}")
    ids = token_ids(ids, model.config.vocab_size)
    if chunk_size is not None and (not is_whole(chunk_size) or chunk_size < 1):
        raise KvminiError(f"chunk_size must be None or a whole number >= 1, got {chunk_size!r}")
    T, L, before = ids.shape[1], model.config.num_layers, cache.seen_tokens
    run_length("prefill", total_len, before + T)
    if ids.shape[0] != cache[0].positions.shape[0]:
        raise KvminiError(f"ids hold {ids.shape[0]} sequences but the cache {cache[0].positions.shape[0]}")
    method_chunk = policy.chunk_for(before + T, total_len) if policy is not None else None  # e.g. WeightedKV's
    chunk = chunk_size or method_chunk or T
    if policy is not None:
        policy.start(T, total_len, model) if before == 0 else policy.next_prompt(T, total_len)
    for start in range(0, T, chunk):
        c = min(chunk, T - start)
        on_layer = None if on_progress is None else (lambda i, start=start, c=c: on_progress(start + c * (i + 1) / L))
        logits = model(ids[:, start : start + chunk], cache, policy, on_layer=on_layer)
    return logits[:, -1]


def fork(cache: KVCache, policy=None):
    """An independent copy of a run (its cache and its policy's state), e.g. to answer several questions
    from one compressed context: each question continues its own copy."""
    return copy.deepcopy((cache, policy))


@torch.inference_mode()
def generate(
    model: Transformer,
    ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: set[int] = frozenset(),
    policy=None,
    chunk_size: int | None = None,
    on_token=None,
    on_progress: Callable[[float], None] | None = None,
    cache: KVCache | None = None,
    more_prompts: bool = False,
) -> GenerationResult:
    """Generate up to max_new_tokens after prompt ids (B, T); on_token(id) streams sequence 0. With `cache`
    (a result's, or a `fork` of it), ids are the run's next prompt and the cache is continued in place.
    more_prompts: a next prompt may follow (a chat), so the policy is not told where the run ends."""
    ids = token_ids(ids, model.config.vocab_size)
    if not is_whole(max_new_tokens) or max_new_tokens < 0:
        raise KvminiError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    if not isinstance(sampling, Sampling):
        raise KvminiError(f"sampling must be a Sampling(...), got {type(sampling).__name__}")
    B, T = ids.shape
    device = model.device
    ids = ids.to(device)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    if cache is None:
        cache = model.new_cache(B, capacity=T + max_new_tokens)
    elif not isinstance(cache, KVCache):
        raise KvminiError(f"cache must be a KVCache (a GenerationResult's .cache), got {type(cache).__name__}")
    t0 = time.perf_counter()
    longest = cache.seen_tokens + T + max(max_new_tokens - 1, 0)  # the last new token is sampled, never appended
    logits = prefill(model, ids, cache, policy, chunk_size, None if more_prompts else longest, on_progress)  # (B, V)
    synchronize(device)
    t1 = time.perf_counter()
    tokens: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    steps = 0
    for t in range(max_new_tokens):
        check_finite(logits, t)
        nxt = sample(logits, sampling, generator)  # (B,)
        for row, i in enumerate(nxt.tolist()):
            if not done[row]:
                if i in stop_ids:
                    done[row] = True
                else:
                    tokens[row].append(i)
                    if row == 0 and on_token is not None:
                        on_token(i)
        if all(done) or t == max_new_tokens - 1:
            break
        logits = model(nxt[:, None], cache, policy)[:, -1]
        steps += 1
    synchronize(device)
    return GenerationResult(tokens, T, t1 - t0, time.perf_counter() - t1, steps, cache)
