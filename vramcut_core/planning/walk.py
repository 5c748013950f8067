"""The timeline of a call entry by entry: the schedule (``schedule``) walked as the executor walks
it, for a forward that enters units several times (looped units: a video VAE's decoder, frame by
frame) and for one model on several devices (``hops``).

Pure (no torch). ``timeline.simulate`` times a call as one step per segment, each group's copy
into the slot ``slots`` places before it: exact where each group is entered once a call. A looped
group is entered once per pass, and the executor's slots then hold what the walk left there, not
what a cyclic order says: a group not in its slot when entered is copied then, into the slot the
group just run does not hold, and compute waits for it; a prefetch (the schedule's ``issue``) and a
refill (``refill``, when a slot frees) are made only where the group is not already in a slot.
Here the call is unrolled into its entries and the walk (``runtime.schedule_walk``) followed
entry by entry over the slots, with the executor's clocks:

* the copy stream runs copies one after another in the order they are issued; a copy starts when
  the stream is free, its slot's free event has passed (recorded when the group that held it was
  done: the next hooked entry; a slot whose group is computing has none, and a copy into it waits
  for all compute queued so far) and the host has seen the time it issues at;
* compute runs entries one after another; a streamed entry waits for its group's copy;
* each call first costs the host the executor's own work (``call_s``, per device's executor):
  nothing the call issues starts before the host has done it;
* the host sees the compute stream's time at the end of each call (the forward's timing event is
  read then), and a staged copy's end once its device's compute has passed it (each staged copy
  first reads the ones in flight: ``host_memory.PAGE_LOCKED``); outside a session the call ends by
  waiting for every copy (the buffers are released) and begins by copying the resident units one
  by one, staged (compute waits for them), as a session's first call does.

The entries of a call: the units a forward enters in order, a run of units entered the same
number of times k > 1 taken as a loop over that run (the run's units one after another, k
times), each pass computing ``compute_s / calls``; a streamed group's copy per pass is its units'
bytes over the bandwidth plus ``latency_s`` per unit. Calls are walked until one repeats the one
before (``walk``); the first is the first call of a session. Not modelled: passes that are not
one loop over a run of units (nested loops, counts that differ within a run), a loop across a
device boundary (each device's entries are unrolled on their own), disk-tier reads (the reader
lane is ``timeline.simulate``'s).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .plan import Plan
from .schedule import schedule_of


_MAX_CALLS = 64  # calls walked at most before the last is taken as the steady one (it comes in a few)


@dataclasses.dataclass
class _Host:
    t: float = 0.0   # the latest time the host has seen (a wait, a completed event it queried)
    # the staged copies in flight (``host_memory.PAGE_LOCKED``): each staged copy first queries
    # them, and one complete (its device's compute has passed it) is a time the host has seen
    staged: list = dataclasses.field(default_factory=list)

    def query_staged(self) -> None:
        done = [(d, t) for d, t in self.staged if t <= d.comp_t]
        self.staged = [x for x in self.staged if x not in done]
        self.t = max([self.t] + [t for _, t in done])


@dataclasses.dataclass
class _Slot:
    group: tuple[str, ...] | None = None
    free: float | None = 0.0    # its free event's time; None: its group is computing
    ready: float = 0.0          # when the copy into it lands


def entries(plan: Plan) -> list[tuple[str, float]]:
    """``(unit, compute seconds of one entry)`` of one call, in the order a forward enters them
    (see the module docstring)."""
    units = [u for u in plan.units if u.entered]
    out: list[tuple[str, float]] = []
    i = 0
    while i < len(units):
        k = units[i].calls
        j = i + 1
        while k > 1 and j < len(units) and units[j].calls == k:
            j += 1
        run = [(u.name, (u.compute_s or 0.0) / max(u.calls, 1)) for u in units[i:j]]
        out += run * max(k, 1)
        i = j
    return out


class _Device:
    """One device's executor as the walk sees it: its slots, its copy stream, its compute stream."""

    def __init__(self, plan: Plan, bytes_per_s: float, latency_s: float, host: _Host) -> None:
        self.host = host
        self.plan, self.sched = plan, schedule_of(plan)
        by = {u.name: u for u in plan.units}
        self.cost = {g: sum(by[n].weight_bytes / bytes_per_s + latency_s for n in g) for g in plan.streamed_groups}
        self.resident = set(plan.resident_units)
        self.hooked = {u.name for u in plan.units if u.name not in self.resident} | set(self.sched.frees)
        # a fresh call's resident copies, one per unit (``timeline.load_seconds``)
        self.load_s = [by[n].weight_bytes / bytes_per_s + latency_s for n in plan.resident_units]
        self.slots: list[_Slot] = []
        self.copy_t = self.comp_t = 0.0
        self.open: _Slot | None = None
        self.last: tuple[str, ...] | None = None
        self.current: str | None = None
        self.stalls: list[float] = []   # this call's: what each streamed entry waited for its copy

    def now(self) -> float:
        return max(self.comp_t, self.host.t)

    def slot_of(self, name: str) -> _Slot | None:
        return next((s for s in self.slots if s.group is not None and name in s.group), None)

    def other_slot(self, busy) -> _Slot:
        return next((s for s in self.slots if s.group is None),
                    next((s for s in self.slots if s.group != busy), self.slots[0]))

    def copy(self, group, slot: _Slot) -> None:
        free = slot.free if slot.free is not None else self.now()
        self.copy_t = max(self.copy_t, self.host.t, free) + self.cost[group]
        slot.group, slot.ready = group, self.copy_t

    def begin(self, fresh: bool) -> None:
        """``_begin``: the resident units copied (a fresh call), the slots made, the first group."""
        if fresh:
            for secs in self.load_s:   # one copy each, staged through page-locked host memory
                self.host.query_staged()
                self.copy_t = max(self.copy_t, self.now()) + secs
                self.comp_t = max(self.comp_t, self.copy_t)   # compute waits for it
                self.host.staged.append((self, self.copy_t))
        while len(self.slots) < self.plan.slots:
            self.slots.append(_Slot(free=self.now()))
        groups = self.plan.streamed_groups
        if groups and self.slots and self.slot_of(groups[0][0]) is None:
            self.copy(groups[0], self.slots[0])
        self.open, self.last, self.current, self.stalls = None, None, None, []

    def close(self, entering: str | None, holding: bool) -> None:
        slot = self.open
        if slot is None or (entering is not None and entering in slot.group):
            return
        self.open = None
        slot.free = self.now()
        nxt = self.sched.refill.get(slot.group)
        if nxt is None or self.slot_of(nxt[0]) is not None or not (holding or slot.group not in self.sched.ahead):
            return
        self.copy(nxt, slot)

    def enter(self, name: str, holding: bool) -> None:
        """``ScheduleWalk.enter``: the unit's group in a slot, compute waiting for its copy."""
        if name in self.hooked and name != self.current:
            self.close(name, holding)
            if name not in self.resident:
                slot = self.slot_of(name)
                if slot is None:  # not prefetched: copied now, compute waits for it
                    slot = self.other_slot(self.last)
                    self.copy(self.sched.group_of.get(name, (name,)), slot)
                elif slot.ready <= self.comp_t:  # its ready event queried: complete, the host sees it
                    self.host.t = max(self.host.t, slot.ready)
                self.stalls.append(max(0.0, slot.ready - self.now()))
                self.comp_t = max(self.comp_t, slot.ready)
                self.last, slot.free, self.open = slot.group, None, slot
            nxt = self.sched.issue.get(name)
            if (nxt is not None and len(self.slots) >= 2 and self.slot_of(nxt[0]) is None
                    and (holding or name not in self.sched.ahead)):
                self.copy(nxt, self.other_slot(self.last))
            self.current = name

    def compute(self, seconds: float) -> None:
        self.comp_t = self.now() + seconds

    def end(self, holding: bool) -> None:
        self.close(None, holding)
        self.open, self.last = None, None
        g = self.plan.streamed_groups
        if holding and self.plan.slots == 2 and g and self.slot_of(g[0][0]) is None:
            self.copy(g[0], self.other_slot(self.last))


def call_times(plan: Plan, bytes_per_s: float, session: bool = True, latency_s: float = 0.0,
               call_s: float = 0.0) -> list[tuple[float, tuple[float, ...]]]:
    """``(seconds, stalls)`` of each call of ``plan`` on one device until the steady one (the
    last; the first is a session's first call): see ``walk``."""
    return walk([plan], [(0, n, c) for n, c in entries(plan)], bytes_per_s, session, latency_s, call_s=call_s)


def looped(plan: Plan) -> bool:
    """Does a forward enter a streamed unit several times (the walk times it)?"""
    streamed = set(plan.streamed_order)
    return any(u.calls > 1 for u in plan.units if u.name in streamed)


def across(plans: Sequence[Plan], hops: Sequence[tuple[int, int, str, float]]) -> list[tuple]:
    """The entries of a call of a forward placed on several devices (``plans[d]``: device d's
    part, in execution order), each ``(device, unit, compute seconds)``, with the hops among them,
    ``(src, dst, seconds)``: ``hops`` gives each move as (source device, destination device, the
    unit it is made for, seconds); a move into the unit's device is made when it is first entered,
    one out of it (the home rule: its outputs back home) after it is last entered, the output's
    (unit "output") when the call ends."""
    seq: list[tuple] = []
    for d, p in enumerate(plans):
        seq += [(d, n, c) for n, c in entries(p)]
    dev = {n: d for d, n, _ in seq}
    first = {n: i for i, (_, n, _) in reversed(list(enumerate(seq)))}
    last = {n: i for i, (_, n, _) in enumerate(seq)}
    before: dict[int, list] = {}
    after: dict[int, list] = {}
    for src, dst, unit, secs in hops:
        if unit not in dev:
            after.setdefault(len(seq) - 1, []).append((src, dst, secs))
        elif dev[unit] == dst:
            before.setdefault(first[unit], []).append((src, dst, secs))
        else:
            after.setdefault(last[unit], []).append((src, dst, secs))
    out: list[tuple] = []
    for i, e in enumerate(seq):  # a move in is made after the unit's entry has ordered its copy
        out += [e + (tuple(before.get(i, ())),)] + after.get(i, [])
    return out


def _hop(devs: Sequence[_Device], src: int, dst: int, seconds: float) -> None:
    """A peer copy (``tensor.to``): on the source's compute stream once the destination's is done
    with what it queued (the barrier), then the destination waits for it."""
    a, b = devs[src], devs[dst]
    a.comp_t = max(a.comp_t, b.comp_t, a.host.t) + seconds
    b.comp_t = max(b.comp_t, a.comp_t)


def walk(plans: Sequence[Plan], seq: Sequence[tuple], bytes_per_s: float, session: bool, latency_s: float,
         calls: int = _MAX_CALLS, call_s: float = 0.0) -> list[tuple[float, tuple[float, ...]]]:
    """``(seconds, stalls)`` of each call of a forward over devices ``plans`` (one executor each,
    nested in that order), ``seq`` its entries in order: ``(device, unit, compute seconds[, hops
    in])``, and hops ``(src, dst, seconds)`` (``_hop``); a unit's hops in are made once its
    entry has ordered its copy, before it computes.
    Calls are walked until one ends
    with the clocks and slots as the one before ended (relative to its end: from there every
    call repeats it), at most ``calls``; that one is the last. ``stalls``: what each streamed
    entry of the call waited for its copy, in the order they ran. ``call_s``: the executor's own
    work of a call on the host (``executor.call_seconds``), before each device's executor issues
    anything: what it issues cannot start before."""
    host = _Host()
    devs = [_Device(p, bytes_per_s, latency_s, host) for p in plans]
    out: list[tuple[float, tuple[float, ...]]] = []
    state = None
    for k in range(calls):
        start = host.t
        for d in devs:  # each device's executor's call, nested: its host work, then its begin
            host.t += call_s
            d.begin(k == 0 or not session)
        stalls: list[float] = []
        for e in seq:
            if not isinstance(e[1], str):
                _hop(devs, *e)
                continue
            d = devs[e[0]]
            n = len(d.stalls)
            d.enter(e[1], session)
            stalls += d.stalls[n:]
            for h in e[3] if len(e) > 3 else ():
                _hop(devs, *h)
            d.compute(e[2])
        for d in reversed(devs):  # the innermost executor's forward ends first
            d.end(session)
            host.t = max(host.t, d.comp_t)   # the forward's end event, read by the host
        if not session:  # released: every copy waited for
            host.t = max([host.t] + [d.copy_t for d in devs])
            for d in devs:
                d.slots.clear()
        out.append((host.t - start, tuple(stalls)))
        now = tuple(round(x - host.t, 12) for d in devs
                    for x in [d.copy_t, d.comp_t, *(v for s in d.slots for v in (s.ready, -1.0 if s.free is None else s.free))])
        now += tuple(s.group for d in devs for s in d.slots)
        if k > 0 and now == state:
            break
        state = now
    return out
