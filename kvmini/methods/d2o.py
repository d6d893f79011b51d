"""D2O (Wan et al. 2024): variance-softmax layer budgets + H2O eviction with EMA-threshold merging.

Paper: "D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of LLMs".

    scorer       cumulative attention (H2O), per KV head
    budgeter     variance-softmax over layers (kvmini.methods.variance_softmax, Eq. 4-5),
                 measured on every layer of the prompt, then every layer is compressed
    compressor   T sinks + N heavy + M recent, N:M = 3:1, T + N + M = S_l (Eq. 6-8), with
                 EMA-threshold merging of the evicted tokens (kvmini.methods.ema_merging, Eq. 9-12)
    schedule     at the end of the prompt, then one eviction (and possible merge) per decode step
Defaults: beta 0.7, N:M 3:1, 4 sinks, allocation variance_softmax (Table 4: reciprocal, uniform),
softmax temperature 1, a layer gets at least sinks + 4 tokens, group reduction mean. In a batch,
every sequence gets its own layer budgets (kvmini.policy.PerSequence).
"""
from kvmini.methods.ema_merging import EMAMerge
from kvmini.methods.scorers import CumulativeAttention
from kvmini.methods.selectors import TopK
from kvmini.methods.variance_softmax import VarianceSoftmax
from kvmini.parts import AFTER_PROMPT
from kvmini.policy import Policy


def build(budget: float, beta: float = 0.7, nm: str = "3:1", sinks: int = 4, allocation: str = "variance_softmax",
          softmax_temperature: float = 1.0, reduce: str = "mean") -> Policy:
    N, M = (int(x) for x in nm.split(":"))
    recent = lambda S_l: (S_l - sinks) * M // (N + M)  # noqa: E731  Eq. 8: N:M of what is not a sink
    return Policy("d2o", budget, CumulativeAttention(reduce), VarianceSoftmax(allocation, softmax_temperature, sinks + 4, reduce),
                  TopK(sinks, recent, merge=EMAMerge(beta)), schedule=AFTER_PROMPT)
