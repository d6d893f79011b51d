"""The merge trace: what a merging compressor (D2O, WeightedKV, CaM) merged, for the kept-token page (kvmini.view)."""
from typing import NamedTuple

import torch


class Merged(NamedTuple):
    """One compression's merges, recorded when a merging compressor's `trace` is a list. All (B, H_kv, E):
    `evicted` positions, `into` the kept position each merged into (-1: dropped), `weight` (0: dropped)."""

    layer: int
    evicted: torch.Tensor
    into: torch.Tensor
    weight: torch.Tensor
