"""Device memory: every byte the executor places on the device, and where its units sit there.

Owns resident buffers (one flat buffer per resident unit), streaming slots (buffers of the plan's
slot size, a streamed segment's units back to back in one), the subclass tensors moved beside
them, the units' layouts, and the count of every byte it allocates (``bytes``, ``peak``). The one
rule: nothing is allocated on the device but through ``alloc`` (counted), and nothing is freed
that a copy may still write: callers order the copy stream first (``transfers``). May call torch,
``layout``, ``units`` and ``meters``' ``OverBudget``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

from ..figures.meters import OverBudget
from ..model.units import Unit
from .layout import Layout, layout_of


# torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): every block is a multiple
# of kMinBlockSize; a request of kMinLargeAlloc or more gets a segment of its own, rounded up to
# kRoundLarge (smaller ones share 2 MiB / 20 MiB segments with other blocks)
K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


def alloc_size(nbytes: int) -> int:
    """The device bytes a buffer of ``nbytes`` takes in the caching allocator: what its
    statistics report for it (a large buffer's whole segment), and what a plan counts."""
    if nbytes <= 0:
        return 0
    if nbytes >= K_MIN_LARGE_ALLOC:
        return -(-nbytes // K_ROUND_LARGE) * K_ROUND_LARGE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def _placement(device: torch.device) -> torch.device:
    """Where tensors for ``device`` are created: the device itself (a simulated accelerator in the
    tests maps it to host memory)."""
    return device


class DeviceCopy:
    """A unit's weights on the device: views into a flat buffer plus subclass tensors. Units
    copied together (a streamed segment) share one ``ready`` event."""

    def __init__(self) -> None:
        self.unit: str | None = None
        self.views: dict[int, torch.Tensor] = {}     # tensor index -> device tensor
        self.parts: dict[int, list[torch.Tensor]] = {}  # quantized tensor index -> device parts
        self.ready: object | None = None             # CUDA event of the copy (CPU: its reads ahead), or None
        self.patched = False                         # on_loaded has run on this copy


@dataclasses.dataclass
class Slot:
    """A streaming slot: one buffer holding the copies of one streamed segment's units, back to
    back, in execution order."""

    buf: torch.Tensor
    copies: dict[str, DeviceCopy] = dataclasses.field(default_factory=dict)
    # CUDA event recorded on the compute stream once the group it holds was last done computing
    # (``schedule``: per-slot free events); None while that group runs, or before it ever ran
    free: object | None = None

    @property
    def group(self) -> tuple[str, ...] | None:
        return tuple(self.copies) or None


class DeviceMemory:
    """The device buffers of one executor, and their accounting."""

    def __init__(self, units: Callable[[str], Unit], device: torch.device,
                 alloc_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        self._unit = units
        self.device = device
        self.cuda = device.type == "cuda"
        self.place = _placement(device)
        self.layouts: dict[str, Layout] = {}
        self.resident: dict[str, tuple[torch.Tensor, DeviceCopy]] = {}
        self.resident_names: set[str] = set()   # what the current plan keeps resident
        self.slots: list[Slot] = []
        self.bytes = 0
        self.peak = 0
        # Entered around every allocation: the meter's pause (its own buffers are not
        # activations) and the host's allocation context (``HostHooks.alloc_context``).
        self.pause: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.alloc_context = alloc_context
        self.on_grow: Callable[[], None] | None = None  # a measuring forward's limit check

    def layout(self, name: str) -> Layout:
        lay = self.layouts.get(name)
        if lay is None:
            lay = self.layouts[name] = layout_of(self._unit(name))
        return lay

    def unit_bytes(self, name: str) -> int:
        """A unit's device bytes as the allocator counts them (its flat buffer rounded on CUDA)."""
        lay = self.layout(name)
        return self.buffer_bytes(lay.nbytes) + lay.other_bytes

    def buffer_bytes(self, nbytes: int) -> int:
        """What a buffer of ``nbytes`` counts for: the allocator's rounding on CUDA."""
        return alloc_size(nbytes) if self.cuda else nbytes

    @property
    def block_bytes(self) -> int:
        """The granularity of the allocator's blocks (a plan's slot size is a multiple of it)."""
        return K_MIN_BLOCK_SIZE if self.cuda else 1

    def group_bytes(self, group: tuple[str, ...]) -> int:
        """Flat bytes of units copied back to back (each layout is aligned)."""
        return sum(self.layout(n).nbytes for n in group)

    def alloc(self, nbytes: int) -> torch.Tensor:
        with self.pause(), self.alloc_context():
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.place)
        self.account(self.buffer_bytes(nbytes))
        return buf

    def account(self, delta: int) -> None:
        self.bytes += delta
        self.peak = max(self.peak, self.bytes)
        if delta > 0 and self.on_grow is not None:
            self.on_grow()

    def other_bytes(self, dc: DeviceCopy) -> int:
        if dc.unit is None:
            return 0
        lay = self.layout(dc.unit)
        return lay.other_bytes

    def slot_other_bytes(self, slot: Slot) -> int:
        return sum(self.other_bytes(dc) for dc in slot.copies.values())

    def free_for(self, plan, stale: bool, after_copies: Callable[[], None]) -> None:
        """Free what a new plan no longer keeps, before anything new is allocated (in methods, so
        that no local variable keeps a freed buffer alive). ``stale``: the host wrote into the
        masters, every slot copy goes. ``after_copies`` orders the compute stream after the
        copies issued (on the device: the host does not wait)."""
        resident = set(plan.resident_units)
        freed = self.free_unkept_resident(resident)
        if self.slots_differ(plan.slots, plan.slot_bytes):
            # hazard: freeing a slot a prefetch still writes (the allocator hands it out again on
            # the compute stream, which then runs after the copy)
            after_copies()
            self.free_slots()
            freed = True
        if stale:
            self.drop_slot_copies(lambda _g: True)
        else:  # a unit the new plan keeps resident must not also sit in a slot; groups it cuts
            kept = set(plan.streamed_groups)  # differently are copied again
            self.drop_slot_copies(lambda g: g not in kept or any(n in resident for n in g))
        if freed:
            self.empty_cache()  # hazard: the freed blocks stay reserved next to the new ones
        self.resident_names = resident

    def check_fits(self, group: tuple[str, ...], slot: Slot, act_seen: int, budget: int) -> None:
        if self.group_bytes(group) > slot.buf.numel():
            # a measuring plan sizes its slot over the units that can fit: this one cannot
            name = max(group, key=self.unit_bytes)
            raise OverBudget("weights", name, self.unit_bytes(name), act_seen, budget)

    def free_unkept_resident(self, resident: set) -> bool:
        freed = False
        for name in [n for n in self.resident if n not in resident]:
            buf, dc = self.resident.pop(name)
            self.account(-self.buffer_bytes(buf.numel()) - self.other_bytes(dc))
            freed = True
        return freed

    def slots_differ(self, slots: int, slot_bytes: int) -> bool:
        return len(self.slots) > slots or any(s.buf.numel() != slot_bytes for s in self.slots)

    def free_slots(self) -> None:
        """Free every slot (the caller has ordered the copies that write them)."""
        for s in self.slots:
            self.account(-self.buffer_bytes(s.buf.numel()) - self.slot_other_bytes(s))
        self.slots = []

    def drop_slot_copies(self, drop: Callable[[tuple[str, ...]], bool]) -> None:
        for s in self.slots:
            if s.copies and drop(s.group):
                self.account(-self.slot_other_bytes(s))
                s.copies = {}

    def slot_of(self, name: str) -> Slot | None:
        for s in self.slots:
            if name in s.copies:
                return s
        return None

    def other_slot(self, busy: tuple[str, ...] | None) -> Slot:
        """A slot not holding ``busy`` (the group running or just run)."""
        for s in self.slots:
            if not s.copies:
                return s
        for s in self.slots:
            if s.group != busy:
                return s
        return self.slots[0]

    def clear(self) -> None:
        """Drop every buffer (the caller has ordered the streams that use them)."""
        self.resident.clear()
        self.slots.clear()
        self.bytes = 0
        self.empty_cache()  # hazard: freed buffers stay reserved, lost to other programs

    def empty_cache(self) -> None:
        """Give the allocator's cached blocks back (callers name the hazard)."""
        if self.cuda:
            with torch.cuda.device(self.device):  # the executor's device, not the current one
                torch.cuda.empty_cache()

    def forget_layouts(self) -> None:
        self.layouts.clear()
