"""One forward's measurement: the meter, the unit entries, the live limit, the forward's peak,
and each unit's compute time (``UnitClock``).

Owns the per-forward measurement state only (the meters and the ``UnitRecorder`` that the dry
run shares live in ``figures.meters``): the meter's readings at each unit's entry and
exit, handed to the recorder, and, for a measuring forward with a limit, the check that stops it
before weights plus activations pass the limit; on CUDA the allocator cap and the forward's
device peak. The one rule: the executor's own buffers are never counted as activations. May
call torch and ``meters``, and read ``device_memory``'s byte counts and its ``empty_cache``.
"""
from __future__ import annotations

import time

import torch

from torch import nn

from ..figures.meters import CPUMeter, CUDAMeter, Meter, OverBudget, UnitMeasurement, UnitRecorder
from .device_memory import DeviceMemory


class Measuring:
    """The measurement of the running forward (reset by ``start``)."""

    def __init__(self, device: torch.device, memory: DeviceMemory, units) -> None:
        self.device, self.cuda, self.memory, self._unit = device, device.type == "cuda", memory, units
        self.meter: Meter | None = None
        self.recorder: UnitRecorder | None = None   # a measured forward's (with its meter)
        self.clock: UnitClock | None = None         # its unit times (with its recorder)
        self.done_clock: UnitClock | None = None    # the last measured forward's, once it finished
        self.limit: int | None = None      # measuring forward: stop before passing this many bytes
        self.act_seen = self.cuda_peak = self.input_bytes = 0
        self.base = self.base_reserved = 0  # device bytes not ours at forward start

    def reset(self, limit: int | None) -> None:
        """A forward starts: its live limit (None: none) and its figures from zero."""
        self.limit = limit
        self.act_seen = self.input_bytes = self.cuda_peak = 0

    def start_meter(self, measure: bool, track_cpu_memory: bool, check, clock: bool, inputs) -> None:
        """The forward's meter made (``make_meter``) and started; ``inputs`` (the forward's
        arguments) count as activations, walked only when a meter runs (not on every forward)."""
        self.make_meter(measure, track_cpu_memory, check, clock)
        if self.meter is not None:
            self.input_bytes = _input_bytes(inputs, self.device, self.memory.buffer_bytes)
            self.meter.start()

    def stop_meter(self) -> None:
        if self.meter is not None:
            self.meter.stop()

    def make_meter(self, measure: bool, track_cpu_memory: bool, check, clock: bool = False) -> None:
        """The forward's meter (a CUDA one only when measuring; a CPU one when measuring or
        tracking memory); ``check`` is the limit check a CPU meter calls at every new storage.
        A unit clock runs with a meter, or alone with ``clock`` (a timed forward: no meter)."""
        m: Meter | None = None
        if self.cuda:
            m = CUDAMeter(self.device, self._own_bytes_relative) if measure else None
        elif measure or track_cpu_memory:
            m = CPUMeter(check=check if self.limit is not None else None)
            self.memory.pause = m.paused  # the executor's own copies and buffers are not activations
        self.meter = m
        self.recorder = UnitRecorder() if m is not None else None
        self.clock = UnitClock(self.device) if m is not None or clock else None

    @property
    def meas(self) -> dict[str, UnitMeasurement] | None:
        """This forward's figures by unit so far (None: nothing is measured)."""
        return None if self.recorder is None else self.recorder.meas

    @property
    def order(self) -> list[str]:
        """Units in the order this forward first entered them."""
        return [] if self.recorder is None else list(self.recorder.meas)

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
        """A unit's module is entered: False when it is the unit running already (``prev``);
        else, when measuring, ``prev`` is left and ``name`` entered in the recorder."""
        rec = self.recorder
        if rec is not None and module is not None:
            rec.saw(module)
        if name == prev:
            return False
        if self.clock is not None:
            self.clock.stop()  # before the next unit's copy is waited for
        if rec is not None:
            rec.leave(self.meter.peak() + self.input_bytes)
            rec.enter(name, self.meter.live() + self.input_bytes)
            if self.cuda:  # the meter resets the allocator's peak per unit: keep the forward's
                self.cuda_peak = max(self.cuda_peak, torch.cuda.max_memory_allocated(self.device))
            self.meter.reset_peak()
        return True

    def entered(self, name: str) -> None:
        """Unit ``name`` is ready to compute (its weights copied and waited for): its time starts."""
        if self.clock is not None:
            self.clock.start(name)

    def finish(self) -> dict[str, UnitMeasurement] | None:
        """The measured figures by unit, in entry order (None: nothing was measured)."""
        if self.clock is not None:
            self.clock.stop()
            self.done_clock = self.clock
        if self.recorder is None:
            return None
        peak = self.meter.peak() + self.input_bytes if self.recorder.current is not None else None
        return self.recorder.finish(lambda n: self._unit(n).hook_modules, peak)

    def start_cuda(self):
        """A CUDA forward starts: its timing event, and the allocator's peak reset so that the
        forward's end reads this forward's peak (every forward: a steady one that outgrows its
        plan must be seen). Peaks are process-wide statistics, and resetting and reading them are
        statistics calls (the host keeps them at each allocation): no host sync."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base_reserved = torch.cuda.memory_reserved(self.device) - self.memory.bytes
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))  # the executor's device, not the current one
        return ev

    def cap_cuda(self, counted: int) -> float | None:
        """A measuring forward on CUDA: cap this process's reserved memory on the device at what
        it reserves now, less ``counted`` (bytes the limit counts: the executor's buffers, the
        inputs), plus the limit, so an allocation that would pass the budget (a temporary made
        and freed inside one module, which no hook sees) fails where it is made and the engine
        cuts finer. Returns the fraction to restore (None: nothing capped)."""
        if not self.cuda or self.limit is None:
            return None
        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        prev = get(self.device) if get is not None else 1.0
        # hazard: cached blocks would serve a temporary past the budget without touching the cap
        self.memory.empty_cache()
        others = torch.cuda.memory_reserved(self.device) - counted
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (others + self.limit) / total), self.device)
        return prev

    def over_cap(self, current: str | None) -> OverBudget:
        """The cap stopped an allocation: the forward would have passed the limit there."""
        weights = self.memory.peak
        act = max(self.act_seen, self.limit - weights + 1)
        return OverBudget("activations", current, weights, act, self.limit)

    def uncap_cuda(self, prev: float | None) -> None:
        if prev is not None:
            torch.cuda.set_per_process_memory_fraction(prev, self.device)

    def limit_hooks_cuda(self, check) -> list:
        """The allocator cannot call back: check between module calls while measuring."""
        if self.cuda and self.limit is not None:
            return [nn.modules.module.register_module_forward_pre_hook(check),
                    nn.modules.module.register_module_forward_hook(check)]
        return []

    def end_cuda(self, stats):
        """A CUDA forward ends: its timing event, and its device peak (every forward)."""
        end_ev = torch.cuda.Event(enable_timing=True)
        end_ev.record(torch.cuda.current_stream(self.device))
        # (no wait for the kernels: the allocator's statistics are kept by the host at each
        # allocation, so reading them costs no host sync)
        # ``base`` leaves out what was allocated before the forward and is not ours, so the
        # executor's held buffers are counted once; the meter resets the allocator's peak per
        # unit while measuring: the forward's peak is the largest seen
        stats.peak_device_bytes = max(max(self.cuda_peak, torch.cuda.max_memory_allocated(self.device)) - self.base,
                                      torch.cuda.max_memory_reserved(self.device) - self.base_reserved)
        return end_ev

    def cpu_stats(self, stats, wall: float) -> None:
        """CPU copies are synchronous: compute waits for every one of them."""
        stats.time_wait_s = stats.time_copy_s
        stats.time_s, stats.timed = wall, 1
        stats.time_compute_s = max(0.0, wall - stats.time_copy_s - stats.time_load_s)
        if self.meas is not None:
            stats.peak_device_bytes = self.memory.peak + max(
                (m.peak_bytes for m in self.meas.values()), default=0)


class UnitClock:
    """Each unit's compute seconds in one measured forward: a mark when the unit is ready to
    compute (after any copy it waited for) and one when the next unit is entered (before that
    one's copy), summed over its passes; what runs between two units counts to the one before, as
    the dry run's FLOPs do. On CUDA the marks are timing events on the compute stream, read only
    once the last has completed (``seconds`` asks ``query``: it never waits, so no host sync is
    added); on CPU, wall time (copies there are made on the thread that computes, outside the
    marks)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.spans: list[tuple[str, object, object]] = []
        self._open: tuple[str, object] | None = None

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def start(self, name: str) -> None:
        self.stop()
        self._open = (name, self._mark())

    def stop(self) -> None:
        if self._open is not None:
            name, a = self._open
            self.spans.append((name, a, self._mark()))
            self._open = None

    def seconds(self) -> dict[str, float] | None:
        """Seconds per unit entered, or None while the last mark has not completed (CUDA)."""
        if self.cuda and self.spans and not self.spans[-1][2].query():
            return None
        out: dict[str, float] = {}
        for n, a, b in self.spans:
            out[n] = out.get(n, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


def _input_bytes(inputs, device: torch.device, size=lambda n: n) -> int:
    """Bytes of the tensors passed into the forward that live on the compute device (each
    storage as ``size`` counts it: the allocator's rounding on CUDA)."""
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten(inputs)
    seen, total = set(), 0
    for t in flat:
        if isinstance(t, torch.Tensor) and t.device.type == device.type and not t.is_meta:
            try:
                ptr = t.untyped_storage().data_ptr()
            except Exception:
                continue
            if ptr not in seen:
                seen.add(ptr)
                total += size(t.untyped_storage().nbytes())
    return total
