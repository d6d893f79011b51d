"""Allocators: a total of tokens shared out over layers by weights, in whole numbers (D2O's Eq. 5,
DynamicKV's Eq. 7-8); PyramidKV's pyramid is in its own module."""


QUANTUM = 2**-20  # of a token: reals this close count as equal, so that float error never decides a tie


def round_to_total(exact: list[float], total: int) -> list[int]:
    """Round non-negative reals to integers that sum to `total` (largest remainder; equal remainders: the
    earliest first): [1.5, 1.5, 1.0], 4 -> [2, 1, 1]. Each real is first taken to a whole number of QUANTUMs,
    so that reals equal but for float error (the same split of rescaled weights) round alike."""
    units = [round(x / QUANTUM) for x in exact]  # whole quanta: an exact int comparison from here on
    per = round(1 / QUANTUM)
    floors = [u // per for u in units]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(units[i] % per), i))
    for i in by_remainder[: total - sum(floors)]:
        floors[i] += 1
    return floors


def proportional(weights: list[float], total: int, low: int, high: list[int]) -> list[int]:
    """S_l = clamp(lambda * w_l, low, high_l), lambda (by bisection) such that they sum to `total`, rounded
    by largest remainder. [0.9, 0.05, 0.05], total 300, low 60, high 200 each -> [180, 60, 60].
    A weight below 1e-12 of the largest counts as that (a softmax underflowing to 0): `total` stays reachable."""
    L = len(weights)
    weights = [max(w, max(weights) * 1e-12) for w in weights]
    total = max(min(total, sum(high)), low * L)
    clamped = lambda lam: [min(max(lam * w, low), h) for w, h in zip(weights, high)]  # noqa: E731
    lo_lam, hi_lam = 0.0, max(high) / min(weights)  # sum(clamped(hi_lam)) = sum(high) >= total
    for _ in range(200):
        mid = (lo_lam + hi_lam) / 2
        lo_lam, hi_lam = (mid, hi_lam) if sum(clamped(mid)) < total else (lo_lam, mid)
    exact = clamped(hi_lam)
    scale = total / sum(exact) if sum(exact) > 0 else 0.0  # remove the last bisection error before rounding
    return round_to_total([x * scale for x in exact], total)
