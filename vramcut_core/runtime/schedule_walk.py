"""The walk of a call's schedule (``planning.schedule``): which streamed group is in which slot,
and when the next copy into a slot is issued.

Owns the walk's state on one executor: the running plan's schedule (each unit's group, what each
entry issues, what each slot is refilled with once it frees), the streamed group computing (its
slot's free event not yet recorded), each slot's free event, and the copies issued for the next
call (the schedule's ``ahead``: counted in the call that reads them, ``take_ahead``, never in the
call that happened to issue them; dropped unread when the session ends, ``drop_ahead``). The one
rule: a copy into a slot is issued once the group that last held it is done (its free event
recorded when another unit is entered or the call ends) and waits for that event alone; a group
not in its slot when entered is copied at once, and compute waits for it. The copies themselves,
their events and which streams wait on them are ``transfers``'s. May call torch,
``planning.schedule``, ``device_memory`` (slots, byte counts), ``transfers`` (the copies),
``binding`` (pointer swaps) and read ``measuring`` (activations seen, whether a forward measures).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..planning.plan import Plan
from ..planning.schedule import Schedule, schedule_of
from .binding import Binding
from .device_memory import DeviceCopy, DeviceMemory, Slot
from .measuring import Measuring
from .transfers import Transfers


class ScheduleWalk:
    """The running plan's schedule walked, one unit entry at a time, over the executor's slots."""

    def __init__(self, memory: DeviceMemory, transfers: Transfers, binding: Binding, measuring: Measuring) -> None:
        self.memory, self.transfers, self.binding, self.measuring = memory, transfers, binding, measuring
        self.device, self.cuda = transfers.device, transfers.cuda
        self.plan: Plan | None = None              # the running call's (its budget bounds a slot's copy)
        self.schedule: Schedule | None = None      # the plan's (``schedule``): what each entry issues
        self.group_of: dict[str, tuple[str, ...]] = {}       # streamed unit -> its segment's units
        self.next: dict[str, tuple[str, ...] | None] = {}    # unit -> the streamed group to prefetch
        self.last_streamed: tuple[str, ...] | None = None    # the streamed group running
        self.open: Slot | None = None   # the slot of the streamed group computing (its free event not yet recorded)
        self.ahead_stats = None         # the copies issued for the next call, counted there

    # -- a call ---------------------------------------------------------------------------------

    def start(self, stats, plan: Plan) -> None:
        """A call starts under ``plan``: its copies count in ``stats``, those issued for it during
        the call before included."""
        self.plan = plan
        self.transfers.stats = stats
        self.take_ahead(stats)
        self.open = None

    def take_ahead(self, stats) -> None:
        """The copies issued for this call during the one before count in this call."""
        if self.ahead_stats is not None and stats is not None:
            stats.add(self.ahead_stats)
        self.ahead_stats = None

    def drop_ahead(self) -> None:
        """The session ended: the copies made for a call that never came count nowhere."""
        self.ahead_stats = None

    def use_plan(self, plan: Plan) -> None:
        """Copies from now on follow ``plan``'s schedule (``schedule.schedule_of``)."""
        self.schedule = schedule_of(plan)
        self.group_of, self.next = dict(self.schedule.group_of), dict(self.schedule.issue)

    def begin(self, plan: Plan, loaded: Callable[[str, DeviceCopy], None]) -> None:
        """The plan's slots made (the resident units are in), its schedule followed, the units the
        device holds swapped in (``loaded`` runs for resident ones) and its first group copied."""
        mem, groups = self.memory, plan.streamed_groups
        while len(mem.slots) < plan.slots:
            mem.slots.append(Slot(mem.alloc(plan.slot_bytes)))
            # its free event: the kernels queued before it was allocated (memory the allocator may
            # have recycled from them), not those queued before its first copy is issued
            self.mark_free(mem.slots[-1])
        self.use_plan(plan)
        self.binding.swap_in_buffers(mem, loaded)
        if (groups and plan.slots and mem.slot_of(groups[0][0]) is None
                and mem.group_bytes(groups[0]) <= plan.slot_bytes):  # a measuring slot may not hold it
            self._into_slot(groups[0], mem.slots[0], sync=not self.cuda)

    def end(self, ok: bool, holding: bool) -> None:
        """The call ended: the last streamed group is done (its slot's free event), when it ran to
        the end."""
        if ok:
            self.close_group(holding)
        self.open = None
        self.last_streamed = None

    def prefetch_first(self, plan: Plan) -> None:  # wrap around: the next forward's first group
        g, mem = plan.streamed_groups, self.memory  # (tensors stay on their masters until it starts)
        if g and mem.slot_of(g[0][0]) is None and len(mem.slots) >= 2:
            self._into_slot(g[0], mem.other_slot(self.last_streamed), sync=False, swap=False, ahead=True)

    # -- one entry ------------------------------------------------------------------------------

    def enter(self, name: str, holding: bool, loaded: Callable[[str, DeviceCopy], None]) -> None:
        """Unit ``name`` is entered: the group computing before it is done, its own group is in a
        slot (copied now if the schedule did not put it there: a synchronous load), ``loaded``
        runs for a fresh copy, and what the schedule issues at this entry is copied."""
        mem, tr = self.memory, self.transfers
        self.close_group(holding, name)
        if name not in mem.resident_names:
            slot = mem.slot_of(name)
            if slot is None:
                # not prefetched (first forward, a skipped or repeated block): load its group now
                if tr.stats is not None:
                    tr.stats.sync_loads += 1
                slot = mem.other_slot(self.last_streamed)
                a = tr.times.cuda_mark()
                self._into_slot(self.group_of.get(name, (name,)), slot, sync=True)
                if a is not None:
                    tr.times.waits.append((a, tr.times.cuda_mark()))
            else:
                tr.order_entry(slot.copies[name], slot.copies)
            self.last_streamed = slot.group
            slot.free, self.open = None, slot  # read from now on, until the group is done
            loaded(name, slot.copies[name])
        nxt = self.next.get(name)
        if (nxt is not None and len(mem.slots) >= 2 and mem.slot_of(nxt[0]) is None
                and (holding or name not in self.schedule.ahead)):  # (released unread after the call)
            self._into_slot(nxt, mem.other_slot(self.last_streamed), sync=not self.cuda,
                            ahead=name in self.schedule.ahead)

    def close_group(self, holding: bool, entering: str | None = None) -> None:
        """The streamed group computing is done when another unit is entered (``entering``) or
        the call ends (None): its slot's free event is recorded and the group the schedule puts
        there next is copied now (``schedule``: a copy is issued when its slot frees; in a
        measuring forward at the entry before it, as the plan's prefetch order says)."""
        slot = self.open
        if slot is None or (entering is not None and entering in slot.copies):
            return
        self.open = None
        mem = self.memory
        self.mark_free(slot)
        nxt = self.schedule.refill.get(slot.group) if self.schedule is not None else None
        if (nxt is None or self.measuring.meas is not None or mem.slot_of(nxt[0]) is not None
                or mem.group_bytes(nxt) > slot.buf.numel()
                or not (holding or slot.group not in self.schedule.ahead)):  # (released unread after the call)
            return
        # (at the call's end the tensors stay on their masters until the next call enters it)
        self._into_slot(nxt, slot, sync=not self.cuda, swap=entering is not None,
                        ahead=entering is None or slot.group in self.schedule.ahead)

    def unhooked(self) -> set[str]:
        """The units a steady forward does not hook: resident ones, but those whose entry ends a
        streamed group (the schedule's ``frees``: there the group's slot is free for its next copy)."""
        sched = self.schedule
        return self.memory.resident_names - (sched.frees if sched is not None else frozenset())

    def mark_free(self, slot: Slot) -> None:
        """The group in ``slot`` is done computing (no kernel queued from now on reads it): its
        free event, which the next copy into the slot waits for (``Transfers.load``'s ``free``)."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            slot.free = ev

    def _into_slot(self, group: tuple[str, ...], slot: Slot, sync: bool, swap: bool = True,
                   ahead: bool = False) -> None:
        """Copy a streamed group (one segment's units) into a slot as one transfer, evicting what
        it held (nothing is copied back: the host copy is the master). ``swap`` points the units'
        tensors at the slot right away; ``ahead``: for the next call, which counts it."""
        mem, tr = self.memory, self.transfers
        mem.check_fits(group, slot, self.measuring.act_seen, self.plan.budget_bytes if self.plan else 0)
        for old in slot.copies:
            self.binding.swap_out(old)
        mem.account(-mem.slot_other_bytes(slot))
        slot.copies = {}
        stats = tr.stats
        if ahead:  # counted in the next call's stats (none while no call has any)
            if self.ahead_stats is None and stats is not None:
                self.ahead_stats = type(stats)()
            tr.stats = self.ahead_stats
        try:
            slot.copies = tr.load(group, slot.buf, sync=sync, free=slot.free)
        finally:
            tr.stats = stats
        if swap:
            for n, dc in slot.copies.items():
                self.binding.swap_in(n, dc)
