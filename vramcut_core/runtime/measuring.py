"""One forward's measurement: the meter, a window per unit, the live limit, the forward's peak.

Owns the per-forward measurement state only (the meters themselves live in
``vramcut_core.measure``): which units were entered in which order, the activation bytes at
each unit's entry and its peak, which of a unit's modules ran, and, for a measuring forward
with a limit, the check that stops it before weights plus activations pass the limit. The one
rule: the executor's own buffers are never counted as activations. May call ``measure`` and
read ``device_memory``'s byte counts.
"""
from __future__ import annotations

import torch

from torch import nn

from ..measure import CPUMeter, CUDAMeter, Meter, OverBudget, UnitMeasurement
from .device_memory import DeviceMemory


class Measuring:
    """The measurement of the running forward (reset by ``start``)."""

    def __init__(self, device: torch.device, memory: DeviceMemory, units) -> None:
        self.device, self.cuda, self.memory, self._unit = device, device.type == "cuda", memory, units
        self.meter: Meter | None = None
        self.meas: dict[str, UnitMeasurement] | None = None
        self.order: list[str] = []
        self.entered: set[int] = set()
        self.limit: int | None = None      # measuring forward: stop before passing this many bytes
        self.act_seen = self.cuda_peak = self.input_bytes = 0
        self.base = self.base_reserved = 0  # device bytes not ours at forward start
        self.reset_peak = True              # this forward resets the allocator's peak

    def make_meter(self, measure: bool, track_cpu_memory: bool, check) -> None:
        """The forward's meter (a CUDA one only when measuring; a CPU one when measuring or
        tracking memory); ``check`` is the limit check a CPU meter calls at every new storage."""
        m: Meter | None = None
        if self.cuda:
            m = CUDAMeter(self.device, self._own_bytes_relative) if measure else None
        elif measure or track_cpu_memory:
            m = CPUMeter(check=check if self.limit is not None else None)
            self.memory.pause = m.paused  # the executor's own copies and buffers are not activations
        self.meter = m
        self.meas = {} if m is not None else None
        self.order = []
        self.entered = set()

    def _own_bytes_relative(self) -> int:
        return self.memory.bytes + self.base

    def check_live(self, running: bool, current: str | None, live: int | None = None) -> None:
        """Measuring forward: stop before weights plus activations pass the limit (``current``:
        the unit running, named in the error)."""
        if self.limit is None or not running:
            return
        if live is None:
            m = self.meter
            live = 0 if m is None else (max(m.live(), m.peak()) if self.cuda else m.live())
        self.act_seen = max(self.act_seen, live + self.input_bytes)
        if self.memory.peak + self.act_seen > self.limit:
            raise OverBudget("activations", current, self.memory.peak, self.act_seen, self.limit)

    def switch(self, prev: str | None, name: str, module) -> bool:
        """A unit's module is entered: False when it is the unit running already; else the
        window of ``prev`` closes and ``name``'s opens."""
        if self.meas is not None and module is not None:
            self.entered.add(id(module))  # which parts of a unit ran (for finer cuts)
        if name == prev:
            return False
        if self.meter is not None:
            self.close_window(prev)
            self.open_window(name)
        return True

    def open_window(self, name: str) -> None:
        live = self.meter.live() + self.input_bytes
        m = self.meas.get(name)
        if m is None:
            self.meas[name] = UnitMeasurement(live, live)
            self.order.append(name)
        else:
            m.calls += 1
            m.entry_bytes = max(m.entry_bytes, live)
        if self.cuda:  # the meter resets the allocator's peak per unit: keep the forward's
            self.cuda_peak = max(self.cuda_peak, torch.cuda.max_memory_allocated(self.device))
        self.meter.reset_peak()

    def close_window(self, cur: str | None) -> None:
        if cur is None or self.meas is None:
            return
        m = self.meas[cur]
        m.peak_bytes = max(m.peak_bytes, self.meter.peak() + self.input_bytes)

    def finish(self, cur: str | None) -> dict[str, UnitMeasurement] | None:
        if self.meter is None:
            return None
        self.close_window(cur)
        for n in self.order:
            self.meas[n].modules = frozenset(
                id(m) for m in self._unit(n).hook_modules if id(m) in self.entered)
        return {n: self.meas[n] for n in self.order}

    def start_cuda(self, reset_peak: bool):
        """A CUDA forward starts: its timing event. Peaks are process-wide statistics: reset only
        when the forward measures or switches plans (where old and new buffers could overlap)."""
        self.reset_peak = reset_peak
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_reserved = torch.cuda.memory_reserved(self.device) - self.memory.bytes
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def limit_hooks_cuda(self, check) -> list:
        """The allocator cannot call back: check between module calls while measuring."""
        if self.cuda and self.limit is not None:
            return [nn.modules.module.register_module_forward_pre_hook(check),
                    nn.modules.module.register_module_forward_hook(check)]
        return []

    def end_cuda(self, stats):
        """A CUDA forward ends: its timing event, and its device peak where it reset the peak."""
        end_ev = torch.cuda.Event(enable_timing=True)
        end_ev.record()
        if not self.reset_peak:
            return end_ev
        # a peak read needs this forward's kernels done (only measured or switching forwards)
        end_ev.synchronize()
        # the meter resets the allocator's peak per unit: the forward's peak is the largest seen
        stats.peak_device_bytes = max(max(self.cuda_peak, torch.cuda.max_memory_allocated(self.device)) - self.base,
                                      torch.cuda.max_memory_reserved(self.device) - self.base_reserved)
        return end_ev

    def cpu_stats(self, stats, wall: float) -> None:
        """CPU copies are synchronous: compute waits for every one of them."""
        stats.time_wait_s = stats.time_copy_s
        stats.time_compute_s = max(0.0, wall - stats.time_copy_s)
        if self.meas is not None:
            stats.peak_device_bytes = self.memory.peak + max(
                (m.peak_bytes for m in self.meas.values()), default=0)
