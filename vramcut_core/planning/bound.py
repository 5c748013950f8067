"""A lower bound on the step time any residency under a plan's budget can reach under the
timeline model (``timeline.steady``), so the residency chosen by time states its gap.

Pure (no torch). For any residency that fits the budget, with any slot count and size, the
model's steady step is compute + stalls, and:

* it is at least the compute of the units a forward enters (``C``; stalls are never negative);
* where not every weight fits on the device at once, the streamed segments are more than the
  slots and every one of them is copied each step, one after another on the one copy stream: a
  steady step (one that repeats) lasts at least the copy stream's work in it, the streamed
  units' copy time ``X`` (bytes x passes / bandwidth, plus the fixed cost per copy);
* where copies do not overlap compute (CPU) every copy is waited for whole: the step is at least
  ``C`` plus the copies. (A looped unit's copies are not: after a loop's first pass its groups
  are prefetched like any other but the pass's first, ``walk``.)

So ``step >= max(C, X)`` per residency (``C + X`` where nothing overlaps), and the
bound is that figure's smallest value over the residencies that fit: for each unit that may be
the largest streamed one (its size is at least one slot; every larger unit is resident), the
resident bytes are at most the budget less the activations, the units that must stay resident and
that slot, and the copy time they save is at most a fractional knapsack's (units taken by copy
seconds saved per byte, the last one in part): a relaxation, so never above the optimum. It
costs a sort per candidate size (well under a millisecond for a hundred units).

The gap of a plan is ``step / bound - 1``: the answer is never further than that from the
fastest residency under the model. It is loose where the step is the compute plus stalls that
no copy order can hide (copies about as long as the compute): the bound then counts no stall.
"""
from __future__ import annotations

from typing import Sequence

from .plan import PlanUnit, activation_reserve


def lower_bound(units: Sequence[PlanUnit], budget: int, bytes_per_s: float, measured: bool = True,
                overlap: bool = True, latency_s: float = 0.0) -> float | None:
    """The smallest step time (seconds) any residency of ``units`` within ``budget`` bytes can
    reach under the timeline model (see the module docstring); None where the units' compute
    times are not known or nothing fits."""
    if any(u.compute_s is None for u in units if u.entered) or not bytes_per_s or bytes_per_s <= 0:
        return None
    act = activation_reserve(units) if measured else 0
    compute = sum(u.compute_s for u in units if u.entered)
    must = sum(u.weight_bytes for u in units if u.keep_resident)
    free = [u for u in units if u.entered and not u.keep_resident]
    if must + act + sum(u.weight_bytes for u in free) <= budget:
        return compute  # all resident fits: nothing is copied in a steady step

    def copy(u: PlanUnit) -> float:
        return u.calls * (u.weight_bytes / bytes_per_s + latency_s)

    best = None
    for cap in sorted({u.weight_bytes for u in free}):
        room = budget - act - must - cap
        fit = [u for u in free if u.weight_bytes <= cap]
        room -= sum(u.weight_bytes for u in free if u.weight_bytes > cap)  # larger units: resident
        if room < 0:
            continue
        least = _least(fit, cap, room, copy)
        if overlap:
            t = max(compute, least)
        else:
            t = compute + least
        best = t if best is None or t < best else best
    return best


def _least(fit: list[PlanUnit], cap: int, room: int, value) -> float:
    """The least total ``value`` of the streamed units of ``fit`` when at most ``room`` bytes of
    them are resident and one of ``cap`` bytes streams: all of them less a fractional knapsack's
    best (units by value per byte, the last one in part)."""
    out = min((u for u in fit if u.weight_bytes == cap), key=value)  # streams: the one worth least
    total = sum(value(u) for u in fit)
    saved = 0.0
    for u in sorted((u for u in fit if u is not out), key=lambda u: -value(u) / max(u.weight_bytes, 1)):
        if not u.weight_bytes:
            saved += value(u)
            continue
        if room <= 0:
            break
        share = min(1.0, room / u.weight_bytes)
        room -= u.weight_bytes * share
        saved += value(u) * share
    return max(total - saved, 0.0)
