"""Host tiers: where each unit's host copy lives under a RAM budget, chosen by time.

Pure data and free functions (no torch). Three tiers per unit: ``device`` (resident: copied once
a session; its host copy is read from its file then, or kept in RAM where the budget leaves room:
``held``, below),
``ram`` (streamed from a flat host master, page-locked where the page-lock room allows) and
``disk`` (streamed, its bytes read from a file each call through the page-locked bounce buffer on
CUDA, straight into the slot on CPU).

What the RAM budget counts (``Tiers.host_bytes``): the flat masters of ``ram`` units, the host
copies of units that cannot be read from a file (weights that are not plain or quantized
tensors), and on CUDA the bounce buffer when anything is read from disk. Staging copies are not
made under a RAM budget (a master that cannot be page-locked is copied synchronously). The page
cache of the files counts nothing: the pack never touches nor locks those pages.

The choice: every streamed unit starts on disk; units are taken for RAM by the time their reads
cost per call (all their passes) per byte of RAM, most first, while the budget holds. The
executor reads ahead: a disk group's read is the stage before it, issued when its slot frees, on
the reader thread beside compute (on CPU into the slot; on CUDA through the bounce buffer, the
reader issuing each piece's copy, ``runtime.read_stage``). Where the plan is timed the choice is
by the timeline (``step_of``: the predicted step with the given units on disk,
``timeline.predict``'s reader lane): a unit goes to RAM only where that makes the step shorter,
so the units whose reads the compute hides stay on disk and their RAM stays free. Untimed (no
compute times) the choice is by bytes, and the step said is the plan's plus the reads, every
byte at the disk's rate (an upper bound). A budget below what one call needs (the units that
must stay in RAM and the bounce buffer) is refused with the smallest ``max_ram_gb`` that works.

Resident units outside a session: the executor releases its device buffers after every call made
outside a session (and at the end of each one), so the next call copies its resident units again:
from their files, read again, where their host copies are on disk (``timeline.load_seconds`` with
``reads``: the call that begins with nothing on the device waits for those reads). The choice
keeps them in RAM instead where the budget allows (``held``: a flat master each, counted in
``ram_bytes``): after the streamed units, which cost every step, the room left takes resident units
(by bytes read saved per byte of RAM, larger first), so a call outside a session, or the first of
one, reads nothing from disk for them; the steady step is the same either way, so this never
costs time, only RAM the budget had left unused. A resident unit that does not fit is read again
each such call (``resident_disk_bytes``).

Where a plan's residency is chosen by time, ``joint`` searches it with the reads of the tiers it
gets (the residency and the tiers to a fixed point).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

from .budget import BudgetError, budget_gib, gib_text, need_gib
from .plan import Plan

DEVICE, RAM, DISK = "device", "ram", "disk"


@dataclasses.dataclass(frozen=True)
class HostUnit:
    """One unit's host side: ``ram_bytes`` its flat master takes, ``read_bytes`` a read of it from
    its file moves, ``fileable`` whether it can be read from a file at all."""

    ram_bytes: int
    read_bytes: int
    fileable: bool = True


@dataclasses.dataclass(frozen=True)
class Tiers:
    """The tier of every unit of a plan under ``ram_budget_bytes``."""

    ram_budget_bytes: int
    tier: tuple[tuple[str, str], ...]       # (unit, DEVICE | RAM | DISK) in the plan's order
    in_ram: tuple[str, ...]                 # units whose host copy is held in RAM (RAM tier and unfileable)
    ram_bytes: int                          # their bytes
    bounce_bytes: int                       # the page-locked bounce buffer (CUDA, when anything is read)
    disk_bytes_per_call: int                # read each call (streamed units on disk, all passes)
    resident_disk_bytes: int                # read once a session (resident units)
    disk_bytes_per_s: float | None = None   # the disk's read rate the choice used (cold reads)
    min_ram_bytes: int = 0                  # the smallest budget that works
    disk_bytes: int = 0                     # host copies left in their files (resident units' too)
    predicted_step_s: float | None = None   # the timeline's step with these reads (where it times them)
    held: tuple[str, ...] = ()              # resident units whose host copy is kept in RAM (in ``in_ram``)
    held_bytes: int = 0                     # their bytes (in ``ram_bytes``)

    @property
    def host_bytes(self) -> int:
        return self.ram_bytes + self.bounce_bytes

    @property
    def disk_s_per_call(self) -> float | None:
        if not self.disk_bytes_per_s:
            return None
        return self.disk_bytes_per_call / self.disk_bytes_per_s

    @functools.cached_property
    def _by_name(self) -> dict[str, str]:
        return dict(self.tier)

    def of(self, name: str) -> str | None:
        return self._by_name.get(name)

    @property
    def disk_units(self) -> tuple[str, ...]:
        return tuple(n for n, t in self.tier if t == DISK)

    def host_tier(self, name: str) -> str | None:
        """Where unit ``name``'s host copy is: RAM (a flat master: its tier is RAM, or it is a
        resident unit ``held``), else its tier."""
        return RAM if name in self.held else self.of(name)


class RamBudgetError(BudgetError):
    """The RAM budget is below what one call needs; ``min_budget_bytes`` is the smallest that works."""


def bounce_for(host: Mapping[str, HostUnit], piece: int, pieces: int) -> int:
    """The bounce buffer's bytes when any unit is read from disk: ``pieces`` pieces, each the
    largest fileable unit's bytes up to ``piece`` (``host_memory.bounce_buffer``)."""
    big = max((h.ram_bytes for h in host.values() if h.fileable), default=0)
    return pieces * min(piece, max(big, 1)) if big else 0


def choose(plan: Plan, host: Mapping[str, HostUnit], ram_budget: int, bounce_bytes: int,
           disk_bytes_per_s: float | None = None,
           step_of: Callable[[Mapping[str, int]], float] | None = None) -> Tiers:
    """The tiers of ``plan``'s units under ``ram_budget`` bytes; ``bounce_bytes`` the bounce
    buffer a disk read needs (0 on CPU); ``step_of``: the predicted step with the given units
    (name -> bytes read per pass) on disk, where the executor reads ahead (see the module
    docstring). Raises ``RamBudgetError`` with the smallest budget that works when even every
    fileable unit on disk does not fit."""
    resident = set(plan.resident_units)
    order = [u.name for u in plan.units]
    units = {u.name: u for u in plan.units}
    pinned = sum(host[n].ram_bytes for n in order if not host[n].fileable)
    need = pinned + (bounce_bytes if any(host[n].fileable for n in order) else 0)
    if ram_budget < need:
        raise ram_budget_error(ram_budget, need)
    room = ram_budget - need
    # streamed units a forward enters, by read seconds saved per byte of RAM (looped first), larger first
    cands = sorted((n for n in order if n not in resident and host[n].fileable and units[n].entered),
                   key=lambda n: (-units[n].calls * host[n].read_bytes / max(1, host[n].ram_bytes),
                                  -host[n].ram_bytes, order.index(n)))
    ram: set[str] = set()
    step = None
    if step_of is None:
        for n in cands:
            if host[n].ram_bytes <= room:
                ram.add(n)
                room -= host[n].ram_bytes
    else:
        ram, room, step = _by_time(cands, host, room, step_of)
    held = []  # the room left: resident units' host copies, so no call reads them from disk again
    for n in sorted((n for n in order if n in resident and host[n].fileable),
                    key=lambda n: (-host[n].read_bytes / max(1, host[n].ram_bytes), -host[n].ram_bytes,
                                   order.index(n))):
        if host[n].ram_bytes <= room:
            held.append(n)
            room -= host[n].ram_bytes
    tier = []
    for n in order:
        tier.append((n, DEVICE if n in resident else RAM if (n in ram or not host[n].fileable) else DISK))
    in_ram = tuple(n for n in order if n in ram or n in held or not host[n].fileable)
    disk = [n for n, t in tier if t == DISK]
    per_call = sum(host[n].read_bytes * units[n].calls for n in disk if units[n].entered)
    res_disk = sum(host[n].read_bytes for n in order if n in resident and host[n].fileable and n not in held)
    return Tiers(ram_budget, tuple(tier), in_ram, sum(host[n].ram_bytes for n in in_ram),
                 bounce_bytes if (disk or res_disk) else 0, per_call, res_disk, disk_bytes_per_s, need,
                 sum(host[n].read_bytes for n in order if n not in in_ram), step, tuple(n for n in order if n in held),
                 sum(host[n].ram_bytes for n in held))


def _by_time(cands: list[str], host: Mapping[str, HostUnit], room: int,
             step_of: Callable[[Mapping[str, int]], float]) -> tuple[set[str], int, float]:
    """The units of ``cands`` (in their order) that go to RAM within ``room`` bytes: each one that
    makes the predicted step shorter (its reads were not hidden), passes repeated while one
    does; (those units, the room left, the step predicted)."""
    disk = {n: host[n].read_bytes for n in cands}
    step = step_of(disk)
    ram: set[str] = set()
    for _ in range(3):  # a unit's read may start to count once others left the reader's lane
        moved = False
        for n in cands:
            if n in ram or host[n].ram_bytes > room:
                continue
            trial = {k: v for k, v in disk.items() if k != n}
            t = step_of(trial)
            if t < step * (1 - 1e-9):
                ram.add(n)
                room -= host[n].ram_bytes
                disk, step, moved = trial, t, True
        if not moved:
            break
    return ram, room, step


def ram_budget_error(budget: int, need: int) -> RamBudgetError:
    """The refusal of a RAM budget below ``need`` bytes, with the ``max_ram_gb`` that works."""
    msg = (f"RAM budget {budget_gib(budget)} is too small: one call needs {need_gib(need)} of host "
           f"memory (the bounce buffer disk reads pass through, and weights that cannot be read from a "
           f"file); the smallest max_ram_gb that works is {gib_text(max(need, 1))}")
    e = RamBudgetError("host memory", need, budget, message=msg)
    e.min_budget_bytes, e.exact = max(need, 1), True  # (not through BudgetError's text: that one names VRAM)
    return e


def tiers_to_json(t: Tiers | None, plan: Plan | None = None) -> dict | None:
    """The tiers as the plan JSON carries them (keys read by tools and the UI: keep them stable)."""
    if t is None:
        return None
    counts = {DEVICE: 0, RAM: 0, DISK: 0}
    for _, k in t.tier:
        counts[k] += 1
    step = t.predicted_step_s  # the timeline's, reads ahead beside compute
    if step is None and plan is not None and plan.time is not None and t.disk_s_per_call is not None:
        step = plan.time.predicted_s + t.disk_s_per_call  # untimed choice: no read hidden (an upper bound)
    return {
        "ram_budget_bytes": t.ram_budget_bytes,
        "resident_bytes": plan.resident_bytes if plan is not None else None,
        "disk_bytes": t.disk_bytes,
        "predicted_step_s": step,
        "ram_bytes": t.ram_bytes,
        "bounce_bytes": t.bounce_bytes,
        "host_bytes": t.host_bytes,
        "disk_bytes_per_call": t.disk_bytes_per_call,
        "resident_disk_bytes": t.resident_disk_bytes,
        "held_bytes": t.held_bytes,
        "disk_bytes_per_s": t.disk_bytes_per_s,
        "disk_s_per_call": t.disk_s_per_call,
        "min_ram_bytes": t.min_ram_bytes,
        "units": counts,
        "tier": {n: k for n, k in t.tier},
    }
