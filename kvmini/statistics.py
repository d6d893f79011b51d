r"""Attention statistics: what a method reads about the attention each cached key received.

Every statistic is a sum over some of a call's queries of a function of their attention rows,
one number per cached key j, declared once (`Statistic`) beside the method that reads it:

    s_j = \mathrm{reduce}_{g} \sum_{i \in Q} f(A_{i\cdot})_j

    Q       the call's last `last` queries (None: every new query; 1: the last row)
    f       rows (..., T, S) -> (..., T, S); None is A itself. A key a query cannot see has A_ij = 0,
            and f must give 0 there too (checked on a row of zeros)
    reduce  how the g query heads sharing a KV head are combined: mean | max | sum -> (B, H_kv, S);
            or "heads": each query head its own row -> (B, H, S), query head h = kv_head * g + i

A sum over queries is computed chunk by chunk (kvmini.attention); a method adds its shares up over a
prompt's calls (`add_up`). A method asks in its `wants` and reads seen.column_sums; a new statistic is
a declaration, no engine change (tutorial 9, part 2).
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmini.errors import KvminiError

REDUCTIONS = ("mean", "max", "sum", "heads")
DECLARED: set[str] = set()  # every statistic name declared so far: reading another is a misspelling


@dataclass(frozen=True)
class Sum:
    r"""What one attention pass adds up per query head, (B, H_kv, g, S): \sum_{i \in Q} f(A_{i\cdot})."""

    last: int | None  # Q: the last `last` queries of the call (None: all)
    f: Callable | None  # None: the attention itself


@dataclass(frozen=True)
class Statistic:
    """One attention statistic (module docstring), read by parts as stats.<name>; (B, H_kv, S) or (B, H, S)."""

    name: str
    last: int | None = None
    f: Callable | None = None
    reduce: str = "mean"

    def __post_init__(self):
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}, not {self.reduce!r}")
        if self.last is not None and self.last < 1:
            raise ValueError(f"statistic {self.name}: last must be None (every query) or >= 1, got {self.last}")
        if self.f is not None and self.f(torch.zeros(1, 1, 2)).any():
            raise ValueError(f"statistic {self.name}: f must give 0 where a key is not seen (attention 0)")
        DECLARED.add(self.name)

    @property
    def sum(self) -> Sum:
        return Sum(self.last, self.f)

    def finish(self, summed: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, g, S) per-query-head sums -> the statistic, (B, H_kv, S) or (B, H, S)."""
        if self.reduce == "mean":
            return summed.mean(2)
        if self.reduce == "max":
            return summed.amax(2)
        if self.reduce == "sum":
            return summed.sum(2)
        B, H_kv, g, S = summed.shape
        return summed.reshape(B, H_kv * g, S)


def reduce_heads(C: torch.Tensor, H_kv: int, reduce: str) -> torch.Tensor:
    """(B, H, S) per query head -> (B, H_kv, S): the g query heads of each KV head combined."""
    B, H, S = C.shape
    C = C.view(B, H_kv, H // H_kv, S)
    return C.mean(2) if reduce == "mean" else C.amax(2) if reduce == "max" else C.sum(2)


def add_up(sums: dict, key, C: torch.Tensor) -> torch.Tensor:
    """A prompt fed in several calls: this call's share C (B, H, S) added to the earlier calls' sums under
    `key` (over fewer keys: zero-padded), kept in `sums` and returned."""
    if key in sums:
        C = F.pad(sums[key], (0, C.shape[-1] - sums[key].shape[-1])) + C
    sums[key] = C
    return C


def column_sums(reduce: str = "mean") -> Statistic:
    """The attention each key received from every new query (H2O's score, D2O's variance)."""
    return Statistic("column_sums", None, None, reduce)


def window_sums(window: int, reduce: str = "mean") -> Statistic:
    """The same sum over only the last `window` queries (SnapKV's observation window)."""
    return Statistic("window_sums", window, None, reduce)


def last_row(reduce: str = "mean") -> Statistic:
    """The attention row of the last new query (TOVA)."""
    return Statistic("last_row", 1, None, reduce)


class Request:
    """The statistics one layer's attention pass must compute, at most one per name."""

    __slots__ = ("statistics",)

    def __init__(self, *statistics: Statistic):
        by_name: dict[str, Statistic] = {}
        for s in statistics:
            if by_name.setdefault(s.name, s) != s:
                raise KvminiError(f"two parts ask for attention statistic {s.name} defined differently: "
                                  f"{by_name[s.name]} and {s}; give one of them another name")
        self.statistics = tuple(by_name.values())

    @staticmethod
    def merge(requests) -> "Request | None":
        """One request for everything any of `requests` asks for (None entries ask for nothing); None if nothing."""
        asked = [r for r in requests if r is not None and r.statistics]
        if len(asked) <= 1:  # nothing to merge (a decode step's usual case: the scorer's request)
            return asked[0] if asked else None
        return Request(*(s for r in asked for s in r.statistics))

    @property
    def sums(self) -> tuple[Sum, ...]:
        """The distinct sums the pass computes (two statistics that differ only in `reduce` share one)."""
        return tuple(dict.fromkeys(s.sum for s in self.statistics))

    @property
    def queries(self) -> int | None:
        """How many of the call's last queries the statistics cover (None: every one)."""
        lasts = [s.last for s in self.statistics]
        return None if None in lasts else max(lasts)

    def finish(self, summed: dict[Sum, torch.Tensor]) -> "Stats":
        return Stats(**{s.name: s.finish(summed[s.sum]) for s in self.statistics})


class Stats:
    """One layer's attention statistics in one call, read as attributes (stats.column_sums), each
    (B, H_kv, S) or (B, H, S); reading one not requested is an error naming it."""

    __slots__ = ("_held",)

    def __init__(self, **held: torch.Tensor):
        unknown = set(held) - DECLARED
        if unknown:
            raise TypeError(f"unknown attention statistics {sorted(unknown)}; declare them as a Statistic")
        self._held = held

    def __getattr__(self, name: str) -> torch.Tensor:
        if name.startswith("_") or name not in DECLARED:
            raise AttributeError(name)
        if name not in self._held:
            raise KvminiError(f"attention statistic {name} was not requested (held: {', '.join(self._held) or 'none'}); "
                              "the part that reads it must ask for it in its request")
        return self._held[name]

    def __iter__(self):
        return iter(self._held)

    def __contains__(self, name: str) -> bool:
        return name in self._held
