"""D2O (Wan et al. 2024): variance-softmax layer budgets + H2O eviction with EMA-threshold merging.

Paper: "D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of LLMs".

    scorer       cumulative attention (H2O), per KV head
    allocator    variance-softmax over layers (kvmini.methods.variance_softmax, Eq. 4-5),
                 computed once the whole prompt has been seen, then every layer is compressed
    selector     T sinks + N heavy + M recent, N:M = 3:1, T + N + M = S_l (Eq. 6-8)
    compensator  EMA-threshold merging of the evicted tokens (kvmini.methods.ema_merging, Eq. 9-12)
    schedule     at the end of the prompt, then one eviction (and possible merge) per decode step
Defaults: beta 0.7, N:M 3:1, 4 sinks, allocation variance_softmax (Table 4: reciprocal, uniform),
softmax temperature 1, a layer gets at least sinks + 4 tokens, group reduction mean. Batch size 1 only,
because every sequence gets its own layer budgets.
"""
from kvmini.methods.ema_merging import EMAMerge
from kvmini.methods.scorers import CumulativeAttention
from kvmini.methods.variance_softmax import AttentionVariance, VarianceSoftmax
from kvmini.policy import AFTER_PROMPT, Policy


def build(budget: float, beta: float = 0.7, nm: str = "3:1", sinks: int = 4, allocation: str = "variance_softmax",
          softmax_temperature: float = 1.0, reduce: str = "mean") -> Policy:
    N, M = (int(x) for x in nm.split(":"))
    return Policy("d2o", budget, scorer=CumulativeAttention(reduce),
                  layer_stat=AttentionVariance(reduce), allocator=VarianceSoftmax(allocation, softmax_temperature, sinks + 4),
                  sinks=sinks, recent=lambda S_l: (S_l - sinks) * M // (N + M),  # Eq. 8: N:M of what is not a sink
                  compensator=EMAMerge(beta), schedule=AFTER_PROMPT)
