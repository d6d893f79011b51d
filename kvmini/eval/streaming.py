r"""Streaming perplexity (WeightedKV Table I, D2O Fig. 6): read a long text through a cache of
fixed capacity and score every token.

The first `2 * capacity` tokens are the prompt: prefilled, then compressed to `capacity`
entries per layer (on average; layer-adaptive methods such as D2O split it unevenly, which
needs a prompt longer than the capacity to measure). The rest of the text follows in chunks
of `chunk` tokens (1 = token by token), teacher-forced; after every chunk a decode-time
method shrinks the cache back to its capacity. For every token after the prompt:

    NLL_t = -\log p(x_t \mid \text{what the cache kept of } x_{<t}),   perplexity = \exp(\mathrm{mean}_t NLL_t)

The full cache (nothing evicted) is the reference. The cumulative mean NLL along the text
is kept (at up to 64 points) for the plot, and `held`: the entries the cache held per layer,
averaged over the layers and over the chunks (each measured after the method compressed), so that
methods are compared at the memory they used, not at their nominal capacity (D2O keeps its
protected layers whole). Methods may carry options, as in the fidelity tool:
`d2o[allocation=uniform]`.
"""
import time

import torch
import torch.nn.functional as F

from kvmini.errors import KvminiError
from kvmini.generate import prefill
from kvmini.methods.registry import policy_for, specs

METHODS = ("full", *specs(while_decoding=True))  # every method that evicts while decoding, every variant


@torch.inference_mode()
def stream_nll(model, ids: torch.Tensor, capacity: int, policy=None, chunk: int = 16,
               held: list | None = None) -> torch.Tensor:
    """ids (1, N) -> NLL (N - P,) of tokens P..N-1, P = 2 * capacity, each predicted from the cache.
    `held`, if given, gets the mean entries per layer after the prompt and after every chunk."""
    N, P = ids.shape[1], 2 * capacity
    cache = model.new_cache(1, capacity=P + chunk)
    first = prefill(model, ids[:, :P], cache, policy, total_len=N - 1)  # (1, V): predicts token P
    nll = [F.cross_entropy(first.float(), ids[0, P : P + 1], reduction="none")]
    for start in range(P, N - 1, chunk):
        if held is not None:
            held.append(sum(cache.lengths()) / len(cache))
        end = min(start + chunk, N - 1)
        logits = model(ids[:, start:end], cache, policy, all_logits=True)[0]  # (end - start, V): start+1..end
        nll.append(F.cross_entropy(logits.float(), ids[0, start + 1 : end + 1], reduction="none"))
    return torch.cat(nll)  # (N - P,)


def curve(nll: torch.Tensor, points: int = 64) -> list[float]:
    """Cumulative mean NLL at `points` evenly spaced tokens (the last one included)."""
    cum = nll.double().cumsum(0) / torch.arange(1, len(nll) + 1)
    at = torch.linspace(0, len(nll) - 1, min(points, len(nll))).round().long()
    return cum[at].tolist()


def run(model, ids: torch.Tensor, capacities: list[int], methods=METHODS, chunk: int = 16, log=print) -> list[dict]:
    """One row per (capacity, method): perplexity after the prompt, the cumulative-NLL curve and the
    mean entries held per layer."""
    N = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0
    if isinstance(capacities, (int, float, str)):
        raise KvminiError(f"capacities must be a list of whole numbers such as [256], got {capacities!r}")
    for capacity in capacities:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity or 2 * capacity >= N - 1:
            raise KvminiError(f"capacities must be whole numbers >= 1 whose prompt (2 * capacity tokens) leaves "
                              f"tokens to score in ids (1, {N}), got {capacity!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise KvminiError(f"chunk must be a whole number >= 1, got {chunk!r}")
    rows = []
    total = len(capacities) * len(methods)
    for capacity in capacities:
        for name in methods:
            t0 = time.perf_counter()
            policy = policy_for(name, capacity)
            held = []
            nll = stream_nll(model, ids, capacity, policy, chunk, held)
            rows.append({"capacity": capacity, "method": name, "tokens": len(nll), "ppl": nll.mean().exp().item(),
                         "held": sum(held) / len(held), "curve": curve(nll), "seconds": time.perf_counter() - t0})
            log(f"[{len(rows)}/{total}] streaming capacity {capacity} {name}: ppl {rows[-1]['ppl']:.3f} "
                f"over {len(nll)} tokens, {rows[-1]['held']:.0f} entries held per layer ({rows[-1]['seconds']:.1f} s)")
    return rows
