"""Layer analyses (D2O Fig. 1 and 4, DynamicKV Fig. 2): how attention differs from layer to
layer on one prompt, and how the layer-adaptive methods split their budget.

    density map    A^{(l)} = mean_h softmax(q k^T / sqrt(D) + causal mask), pooled into
                   bins x bins blocks (query block, key block): shallow layers spread their
                   attention, deeper ones put it on a few columns
    variance       F_v^{(l)}, D2O Eq. 4: the variance of the keys' column sums s_j = sum_i A_ij
    top-10% share  fraction of all attention that the 10% most attended keys receive
    sink share     fraction that the first 4 tokens receive
    retention      entries each layer keeps under pyramidkv, d2o, dynamickv (budget b) and
                   dbudgetkv (its own budget)
"""
import torch

from kvmini.attention import Statistic
from kvmini.generate import prefill
from kvmini.methods.registry import policy_for
from kvmini.methods.variance_softmax import attention_variance

ADAPTIVE = ("pyramidkv", "d2o", "d2o[variant=paper]", "dynamickv", "dbudgetkv")


class ColumnSums:
    """A recorder that compresses nothing (it keeps no run: its hooks are handed no step) and records every
    layer's column sums, (1, H_kv, n) each."""

    def __init__(self):
        self.sums: list[torch.Tensor] = []

    def before(self, cache, step):
        return {"column_sums": Statistic()}  # what every layer's attention pass computes

    def after_attention(self, layer, cache, stats, step):
        self.sums.append(stats["column_sums"])

    def after_layers(self, cache, step):
        pass


@torch.inference_mode()
def layer_statistics(model, ids: torch.Tensor, sinks: int = 4) -> list[dict]:
    """Per layer: F_v, the top-10% keys' share and the first `sinks` tokens' share of the attention."""
    recorder = ColumnSums()
    model(ids, model.new_cache(1, ids.shape[1]), recorder)
    rows = []
    for layer, s in enumerate(recorder.sums):  # s (1, H_kv, n): sums to n per head
        total = s.sum(-1)  # (1, H_kv)
        top = s.topk(max(1, s.shape[-1] // 10), dim=-1).values.sum(-1)
        rows.append({"layer": layer, "variance": attention_variance(s),
                     "top10_share": (top / total).mean().item(),
                     "sink_share": (s[..., :sinks].sum(-1) / total).mean().item()})
    return rows


@torch.inference_mode()
def density_map(model, ids: torch.Tensor, layer: int, bins: int = 32) -> list[list[float]]:
    """Layer `layer`'s attention probabilities, mean over heads, averaged into (bins, bins) blocks."""
    attn = model.model.layers[layer].self_attn
    seen = {}
    hook = attn.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0], cos=args[2], sin=args[3]))
    try:
        cache = model.new_cache(1, ids.shape[1])
        model(ids, cache)
    finally:
        hook.remove()
    q, _, _ = attn.project(seen["x"], seen["cos"], seen["sin"])  # (1, H, n, D)
    k = cache[layer].keys.repeat_interleave(attn.H // attn.H_kv, 1)  # (1, H, n, D)
    n = ids.shape[1]
    scores = (q @ k.transpose(-1, -2)).float() / attn.D**0.5  # (1, H, n, n)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).mean(1)  # (1, n, n)
    return torch.nn.functional.adaptive_avg_pool2d(probs, bins)[0].tolist()


@torch.inference_mode()
def retention(model, ids: torch.Tensor, budget: float, methods=ADAPTIVE) -> dict[str, list[int]]:
    """Entries each layer keeps after the prompt, per layer-adaptive method (a spec: d2o[variant=paper]).
    A method that compresses at the first decode step (D2O's official variant) is read after it."""
    kept = {}
    for name in methods:
        cache = model.new_cache(1, ids.shape[1] + 1)
        policy = policy_for(name, budget)
        logits = prefill(model, ids, cache, policy, total_len=ids.shape[1] + 1)
        if policy.schedule == "decode":
            model(logits.argmax(-1, keepdim=True), cache, policy)
        kept[name] = cache.lengths()
    return kept
