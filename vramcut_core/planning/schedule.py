"""The schedule of one call: which streamed group is copied when, into which slot, after what,
and what compute waits for. Data, computed once per plan; the executor walks it
(``runtime.schedule_walk``) and the timeline (``timeline.predict``) times it, so the two cannot
drift.

Pure (no torch). ``schedule_of(plan)`` gives the streamed groups a call copies, in execution
order (``Copy``), and what each unit's entry does:

* A copy into a slot waits only for the slot's "free" event: recorded on the compute stream when
  the group that last held the slot is done (``frees``: the first unit entered after a streamed
  group; the call's end after the last one). Resident units between two streamed groups never
  touch a slot: the next copy runs beside them.
* A copy is issued when its slot frees (``refill``: the group copied into a slot once the group
  it holds is done, ``slots`` places later in the call's cyclic order), so the host issues it
  as early as the device can start it; on the device it starts when the copy stream is free too
  (copies run one after another, in the order of the groups). The first call of a session and
  every call outside one copy the resident units, then the first group, when they begin (compute
  waits for the resident copies); outside a session nothing is copied for a next call.
* ``Copy.on_entry``: copied when entered and waited for whole (a looped group: a forward enters
  it several times, each pass copying it again). A group not in its slot when entered (the
  first call, a skipped or repeated block) is copied then (``issue``: the prefetch made at an
  entry when the next group is not already on its way).

A stage before a copy (``Copy.stage``) is where a lower tier plugs in: a read from disk, on the
process's one reader thread, feeding the copy (a disk read is one more engine feeding it). The
tier names the stage on the copies it feeds (``with_stages``). The read is issued with its copy,
when its slot frees, and runs beside the compute before its group (``runtime.read_stage``): on
CPU it fills the slot itself, and the group's entry waits for it; on CUDA it goes piece by piece
through the page-locked bounce buffer, the reader thread issuing each piece's copy as its read is
back, and the group's entry waits for the reads (then compute for the copies, on the device). The
timeline gives the stage its lane (``timeline.Step.read_s``, on CUDA ``Step.pieces``: one read at
a time, from when the slot frees), which the copy, or on CPU the group, waits for.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from .plan import Plan


@dataclasses.dataclass(frozen=True)
class Copy:
    """One streamed group's copy in a call: ``index`` its place among the call's groups;
    ``after`` the index of the group whose slot it takes (that group's end issues it and its free
    event is the copy's only wait on compute); ``wraps`` issued during the call before (its slot
    frees there); ``on_entry`` copied when entered (looped); ``stage`` a stage before the copy."""

    group: tuple[str, ...]
    index: int
    after: int
    wraps: bool = False
    on_entry: bool = False
    stage: str | None = None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A call's schedule (see the module docstring)."""

    copies: tuple[Copy, ...]
    slots: int
    group_of: Mapping[str, tuple[str, ...]]
    issue: Mapping[str, tuple[str, ...] | None]
    frees: frozenset[str]
    refill: Mapping[tuple[str, ...], tuple[str, ...] | None]
    residents: tuple[str, ...]
    # what is copied for the next call: the units whose entry's prefetch (``issue``) is the next
    # call's first group, and the groups whose refill is a group of the next call (outside a
    # session the executor skips both: the buffers are released unread)
    ahead: frozenset = frozenset()

    @property
    def held(self) -> bool:
        """No more groups than slots: in a session each stays in its slot (nothing is copied
        after the first call)."""
        return 0 < len(self.copies) <= self.slots


    def with_stages(self, stages: Mapping[tuple[str, ...], str]) -> "Schedule":
        """The schedule with a stage before the copies of the groups in ``stages`` (a tier's)."""
        return dataclasses.replace(self, copies=tuple(dataclasses.replace(c, stage=stages.get(c.group, c.stage))
                                                      for c in self.copies))


def schedule_of(plan: Plan) -> Schedule:
    """The schedule of ``plan``'s calls (see the module docstring)."""
    groups = plan.streamed_groups
    group_of = {n: g for g in groups for n in g}
    calls = {u.name: u.calls for u in plan.units}
    entered = [u.name for u in plan.units if u.entered]
    # A forward that loops over streamed units (a video VAE, frame by frame) does not start its
    # next pass at the first group: copying it for the next call would be for nothing (the pass
    # loads what it enters; the next call's first group is prefetched after this one).
    loops = any(calls[n] > 1 for n in group_of)
    prefetch = plan.slots >= 2
    issue: dict[str, tuple[str, ...] | None] = {}
    upcoming = groups[0] if groups else None
    for u in reversed(plan.units):
        issue[u.name] = upcoming if prefetch else None
        if u.name in group_of:
            upcoming = group_of[u.name]
    for k, g in enumerate(groups):
        last = k + 1 == len(groups)
        after = None if not prefetch or len(groups) < 2 or (loops and last) else groups[(k + 1) % len(groups)]
        for n in g:
            issue[n] = after
    frees, prev = set(), None
    for n in entered:
        g = group_of.get(n)
        if prev is not None and g != prev:
            frees.add(n)
        prev = g
    first = {g: min(i for i, u in enumerate(plan.units) if u.name in g) for g in groups}
    ahead: set = {u.name for i, u in enumerate(plan.units) if issue.get(u.name) is not None
                  and first[issue[u.name]] <= i}
    slots, n_groups = max(plan.slots, 1), len(groups)
    copies, refill = [], {}
    for k, g in enumerate(groups):
        j = (k - slots) % n_groups
        wraps = k < slots
        copies.append(Copy(g, k, j, wraps, on_entry=max(calls[n] for n in g) > 1))
        # nothing to refill where every group keeps its slot; a loop copies nothing ahead of
        # the next call
        refill[groups[j]] = None if n_groups <= slots or (loops and wraps) else g
        if wraps:
            ahead.add(groups[j])
    return Schedule(tuple(copies), plan.slots, group_of, issue, frozenset(frees), refill,
                    tuple(plan.resident_units), frozenset(ahead))
