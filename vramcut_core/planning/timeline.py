"""Time: each unit's compute time, and the step time a plan predicts.

Pure (no torch, no device calls). A unit's compute time comes from the dry run's FLOP count
(``UnitMeasurement.flops``, counted by torch's ``FlopCounterMode``) divided by the matrix-product
throughput measured on this machine (``bandwidth.matmul_throughput``), or from a measured forward;
it is kept on the plan's rows (``PlanUnit.compute_s``).

``simulate`` is the timeline model: given the segments in execution order (``Step``: compute
time, copy time of a streamed segment, device) and the prefetch depth, the predicted step time
and each segment's stall, the part of its copy that the compute before it did not hide.
``predict(plan, bytes_per_s)`` applies it to a plan. The one rule: no figure here is assumed;
times come from a count over a measured throughput, or from a measurement.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from .plan import Plan, PlanUnit


def unit_seconds(flops: int | None, flops_per_s: float | None) -> float | None:
    """Compute seconds of ``flops`` operations at ``flops_per_s``; None when either is unknown."""
    if flops is None or not flops_per_s or flops_per_s <= 0:
        return None
    return flops / flops_per_s


def with_compute_times(units: Sequence[PlanUnit], flops: Mapping[str, int | None],
                       flops_per_s: float | None) -> list[PlanUnit]:
    """``units`` with ``compute_s`` from each unit's FLOP count (``flops[name]``, e.g. the dry run's
    ``UnitMeasurement.flops``) at the measured throughput; a unit without a count keeps None."""
    return [dataclasses.replace(u, compute_s=unit_seconds(flops.get(u.name), flops_per_s)) for u in units]


# -- the step timeline -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Step:
    """One segment of a forward as the timeline sees it, in execution order.

    ``copy_s`` is None for a resident segment, else the seconds its weights take to copy (bytes /
    host-to-device bandwidth); ``hop_s`` the seconds its input takes to reach its device from the
    previous segment's (0 on one device); ``sync`` marks a copy made when the segment is entered
    instead of prefetched (a segment a forward enters several times)."""

    compute_s: float
    copy_s: float | None = None
    device: int = 0
    hop_s: float = 0.0
    sync: bool = False


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The steady step: ``step_s`` from the end of one forward to the end of the next;
    ``stalls[i]`` the seconds step ``i`` waited for its copy (the part the compute before it
    did not hide); ``copied[i]`` whether its weights moved this step (False: resident, or still in
    its slot from the step before). ``step_s`` is compute + hops + stalls, exactly."""

    step_s: float
    stalls: tuple[float, ...]
    copied: tuple[bool, ...]
    compute_s: float
    hop_s: float = 0.0

    @property
    def stall_s(self) -> float:
        return sum(self.stalls)


_MAX_STEPS = 256  # steps simulated at most before the steady one is taken (it comes in a few)


def simulate(steps: Sequence[Step], depth: int | Sequence[int] = 1, overlap: bool = True,
             session: bool = True) -> Timeline:
    """The steady-state timeline of ``steps`` run again and again (one forward per sampling step).

    The model is the executor's schedule, one copy stream and ``depth + 1`` slots per device:

    * ``overlap`` False (CPU: a copy is a memory copy on the thread that computes) or ``depth`` 0
      (one slot, loaded on entry): a streamed segment waits for its whole copy, which starts when
      the segment before it has finished: its stall is its copy time.
    * ``depth`` d >= 1 (d + 1 slots): the copies of a device's streamed segments run in execution
      order on its copy stream, wrapping to the next forward's first; a copy starts when the copy
      before it is done and its slot is free, that is when the streamed segment d + 1 places
      earlier on that device (this forward's or the last one's) has finished computing. The host
      issues copies ahead of the device (it never waits for them), so nothing else delays a copy.
    * A segment computes when the segment before it has finished (plus ``hop_s``, its input's
      trip from the previous device) and its copy is done.
    * ``session`` (the executor keeps its slots between forwards): a device that streams no more
      segments than it has slots copies nothing after the first forward, and the next forward's
      first copies start during this one. Without it every forward starts with empty slots.

    Forwards are simulated until one starts with the copy streams and slots as the one before
    started (it does within a few: then that forward repeats forever) and that one is returned."""
    steps = list(steps)
    devices = sorted({s.device for s in steps})
    slots = {d: 1 + (depth if isinstance(depth, int) else depth[i]) for i, d in enumerate(devices)}
    step_s, stalls, copied = steady([s.compute_s for s in steps], [s.copy_s for s in steps],
                                    [s.device for s in steps], [s.hop_s for s in steps],
                                    [s.sync for s in steps], slots, overlap, session)
    return Timeline(step_s, stalls, copied, sum(s.compute_s for s in steps), sum(s.hop_s for s in steps))


def steady(compute: Sequence[float], copy: Sequence[float | None], device: Sequence[int],
           hop: Sequence[float], sync: Sequence[bool], slots: Mapping[int, int], overlap: bool = True,
           session: bool = True) -> tuple[float, tuple[float, ...], tuple[bool, ...]]:
    """``simulate`` on plain lists, one entry per step (``Step``'s fields) and the slots of each
    device: (step seconds, stalls, copied). The planner's searches call it directly (no objects
    built per residency tried)."""
    n = len(compute)
    devices = set(device)
    streamed = {d: sum(1 for i in range(n) if device[i] == d and copy[i] is not None) for d in devices}
    held = {d: session and streamed[d] <= slots[d] for d in devices}
    copied = tuple(copy[i] is not None and not held[device[i]] for i in range(n))
    # a streamed step waits for its whole copy: no overlap, one slot, or a copy made on entry
    waits = tuple(c and (not overlap or slots[device[i]] == 1 or sync[i]) for i, c in enumerate(copied))
    # per device: when its copy stream is free, and when each of its last (slots) streamed
    # segments finished computing (a slot is free once its segment has run)
    copy_free = {d: 0.0 for d in devices}
    freed: dict[int, list[float]] = {d: [0.0] * slots[d] for d in devices}
    end = 0.0
    stalls: list[float] = []
    state: tuple | None = None
    for _ in range(_MAX_STEPS):
        start = end
        if not session:  # slots released after each forward: the first copies start with the next
            copy_free = {d: start for d in devices}
            freed = {d: [start] * slots[d] for d in devices}
        # a forward is fixed by the copy streams and slots as they stand when it starts (relative
        # to its start): when they stand as they did one forward ago, that forward repeats forever
        now = tuple(round(t - start, 12) for d in sorted(devices) for t in [copy_free[d], *freed[d]])
        if now == state:
            return step_s, tuple(stalls), copied
        state = now
        stalls = []
        for i in range(n):
            ready = end + hop[i]
            d = device[i]
            if not copied[i]:
                begin = ready
            elif waits[i]:
                begin = ready + copy[i]
                copy_free[d] = begin
            else:
                f = freed[d]
                copy_end = max(copy_free[d], f[0]) + copy[i]
                copy_free[d] = copy_end
                begin = ready if ready > copy_end else copy_end
            end = begin + compute[i]
            if copied[i]:
                f = freed[d]
                f.pop(0)
                f.append(end)
            stalls.append(begin - ready)
        step_s = end - start
    return step_s, tuple(stalls), copied


def known(units: Sequence[PlanUnit]) -> bool:
    """Does every unit a forward enters have its compute time?"""
    return all(u.compute_s is not None for u in units if u.entered)


def plan_steps(plan: Plan, bytes_per_s: float, device: int = 0) -> list[Step]:
    """The steps of ``plan``'s segments a forward enters: their units' compute time (all passes)
    and, for a streamed segment, its bytes per forward over ``bytes_per_s``. A segment entered
    several times (a looped unit: a segment of its own) is copied on each entry, not prefetched."""
    if not known(plan.units):
        raise ValueError("the plan's units have no compute times (PlanUnit.compute_s)")
    if not bytes_per_s or bytes_per_s <= 0:
        raise ValueError(f"bytes_per_s must be a positive rate, got {bytes_per_s!r}")
    out = []
    for seg in plan.segments:
        us = [plan.units[i] for i in seg.units if plan.units[i].entered]
        if not us:
            continue
        compute = sum(u.compute_s for u in us)
        copy = None if seg.resident else sum(u.weight_bytes * u.calls for u in us) / bytes_per_s
        out.append(Step(compute, copy, device, sync=not seg.resident and max(u.calls for u in us) > 1))
    return out


def predict(plan: Plan, bytes_per_s: float, overlap: bool = True, session: bool = True) -> Timeline:
    """The steady step time ``plan`` predicts: its segments through ``simulate`` with its slots
    (two: prefetch depth 1; one: loaded on entry). ``overlap`` False for CPU (copies synchronous)."""
    return simulate(plan_steps(plan, bytes_per_s), max(plan.slots - 1, 0), overlap, session)
