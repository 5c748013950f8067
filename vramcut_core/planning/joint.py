"""Residency and host tiers chosen together: the residency chosen by time sees the reads of the
units it streams from disk.

Pure (no torch). ``residency.by_time`` alone times a residency as if every streamed unit were
copied from RAM; under a RAM budget the units ``tiers.choose`` leaves on disk are read each call,
and a residency that streams more bytes (hidden behind compute on the link) may then wait for
their reads. ``fastest`` iterates the two to a fixed point: the residency is searched again with
the reads of the tiers it would get (every unit read from its file when it streams, but those
the last choice put in RAM), the tiers chosen again for the residency found, while the step with
its reads gets shorter (at most ``ROUNDS`` rounds). Each round's search starts from the plan
before it, so the answer is never slower under the model than the residency chosen without the
reads, with its tiers.

The step with reads is the timeline's (``timeline.predict`` with ``reads``: the reader lane)
where the executor reads ahead (``lane``), else the step plus every read whole (reads not
hidden): the same figure ``tiers`` carries (``Tiers.predicted_step_s``, ``tiers_to_json``).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from . import residency, tiers
from .plan import Plan, PlanOptions
from .timeline import predict

ROUNDS = 4  # searches with the reads at most (each a ``residency.by_time``)


def fastest(plan: Plan, host: Mapping[str, tiers.HostUnit], ram_budget: int, bounce_bytes: int,
            bytes_per_s: float, disk_bytes_per_s: float | None, options: PlanOptions = PlanOptions(),
            overlap: bool = True, latency_s: float = 0.0, lane: bool = True) -> Plan:
    """``plan`` (its residency chosen without reads) or a faster residency under the same budget,
    with its tiers (``Plan.tiers``; see the module docstring). Raises ``tiers.RamBudgetError``
    where the RAM budget is below what one call needs."""
    def tiered(p: Plan) -> Plan:
        step_of = None
        if lane and disk_bytes_per_s:
            step_of = lambda reads: predict(p, bytes_per_s, overlap, True, latency_s, reads,  # noqa: E731
                                            disk_bytes_per_s).step_s
        return dataclasses.replace(p, tiers=tiers.choose(p, host, ram_budget, bounce_bytes, disk_bytes_per_s,
                                                         step_of))

    def step(p: Plan) -> float:
        return step_with_reads(p, host, bytes_per_s, disk_bytes_per_s, overlap, latency_s, lane)

    best = tiered(plan)
    best_s = step(best)
    if not disk_bytes_per_s or not best.tiers.disk_units or not options.residency:
        return best
    seen = {_shape(plan)}
    current = best
    for _ in range(ROUNDS):
        ram = set(current.tiers.in_ram)
        reads = {n: h.read_bytes for n, h in host.items() if h.fileable and n not in ram}
        found = residency.by_time(current, bytes_per_s, options, overlap, True, latency_s, reads,
                                  disk_bytes_per_s, lane)
        if _shape(found) in seen:
            break
        seen.add(_shape(found))
        current = tiered(dataclasses.replace(found, tiers=None))
        s = step(current)
        if s < best_s * (1 - 1e-12):
            best, best_s = current, s
    return best


def _shape(p: Plan) -> tuple:
    """What a round can change: the resident units and the window."""
    return p.resident_units, p.slots, p.slot_bytes


def step_with_reads(plan: Plan, host: Mapping[str, tiers.HostUnit], bytes_per_s: float,
                    disk_bytes_per_s: float | None, overlap: bool = True, latency_s: float = 0.0,
                    lane: bool = True) -> float:
    """The predicted steady step of ``plan`` with the reads of its disk-tier units (see the
    module docstring); the step alone where nothing is read."""
    reads = {n: host[n].read_bytes for n in plan.tiers.disk_units} if plan.tiers is not None else {}
    return residency.step_time(plan, bytes_per_s, overlap, True, latency_s, reads, disk_bytes_per_s, lane)
