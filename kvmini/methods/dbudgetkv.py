"""DBudgetKV (Ni et al. 2025): each layer prunes until its attention norm would drop by more than t.

Paper: "DBudgetKV: Dynamic Budget in KV Cache Compression for Ensuring Optimal Performance".

Prefill only; decode appends. There is no --budget: the budget is what the norm-stopping rule
(kvmini.methods.frobenius_stop) chooses for each layer, reported per layer by run.py.
Defaults: threshold t = 0.01 (1%, the paper; its official scripts use 5%), k = 1 last row,
position ranking with m = 4 sinks (`--ranking attention` ranks by the prompt's column sums, Table 3),
layers 0 and 1 never pruned (`--protected-layers`), group reduction mean. In a batch, every
sequence gets its own budgets (kvmini.policy.PerSequence).
"""
from kvmini.methods.frobenius_stop import FrobeniusStop
from kvmini.methods.scorers import CumulativeAttention, Position
from kvmini.methods.selectors import TopK
from kvmini.parts import PREFILL
from kvmini.policy import Policy

CHOOSES_BUDGET = True  # the registry rejects --budget for this method


def build(budget: None, threshold: float = 0.01, k: int = 1, ranking: str = "position", sinks: int = 4,
          protected_layers: str = "0,1", reduce: str = "mean") -> Policy:
    by_position = ranking == "position"
    return Policy("dbudgetkv", None, Position() if by_position else CumulativeAttention(reduce),
                  FrobeniusStop(threshold, k, ranking, sinks, reduce, parse_layers(protected_layers)),
                  TopK(sinks if by_position else 0), schedule=PREFILL)


def parse_layers(text: str) -> tuple[int, ...]:
    """"0,1" -> (0, 1); "" -> ()."""
    return tuple(int(x) for x in text.split(",") if x.strip())
