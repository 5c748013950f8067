"""The figures that time a plan, for one engine: the host-to-device bandwidth, the compute
throughput, each unit's measured compute time, and whether residency is chosen by time.

``EngineConfig.speed`` says how residency is chosen: "time" (``residency.by_time``: the plan with
the shortest predicted step under the budget), "count" (``plan.build_plan``: as many bytes
resident as fit; no compute times, no prediction: today's plans exactly) or "auto" (time on CUDA,
where copies overlap compute and the choice matters; count on CPU, so that plans there do not
depend on what a cache file of this machine holds). Choosing by time needs every entered unit's
compute time and a bandwidth; without either the count-based plan is kept.

* Bandwidth: ``EngineConfig.bandwidth_bytes_per_s``, else the figure ``bandwidth`` measured before
  for the device (``cached_host_to_device``: never measured here, never assumed).
* Fixed cost per copy: ``EngineConfig.copy_latency_s``, else the bandwidth probe's fit (cached
  beside the bandwidth) where the bandwidth is the probe's, else 0.
* Fixed cost of a call: the executor's own work of a call, ``runtime.executor.call_seconds``
  (a call of a plan with no units), measured once per device and cached beside the bandwidth.
* Hops between two GPUs (a placement across devices): ``bandwidth.device_to_device``'s figures
  of the link (rate and fixed cost of a peer copy), measured once within what both devices'
  budgets leave, cached.
* Throughput: ``EngineConfig.flops_per_s``, else ``bandwidth.matmul_throughput`` for the device and
  the module's compute dtype (a probe, once per device and dtype, cached), its matrices sized to
  what the budget leaves when it runs (``Figures.room``: the engine's budget less what it holds).
* Measured times: ``UnitTimes`` keeps, for one input signature, a unit clock
  (``runtime.measuring.UnitClock``) until its marks can be read without waiting, then the seconds
  per unit; they replace the dry run's estimate. On CUDA the clock is the measuring forward's; on
  CPU the forward after it is timed, without the meter (a CPU meter runs Python at every
  operator: a measuring forward's wall times carry it).

The one rule: no figure here is assumed; without a measured one the answer is None.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from torch import nn

from . import bandwidth

SPEEDS = ("auto", "time", "count")
COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def by_time(config) -> bool:
    """Does ``config`` choose residency by predicted time (see the module docstring)?"""
    return config.speed == "time" or (config.speed == "auto" and torch.device(config.device).type == "cuda")


def overlaps(config) -> bool:
    """Do copies overlap compute on ``config``'s device (CUDA: a copy stream; CPU: no)?"""
    return torch.device(config.device).type == "cuda"


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype most of the module's floating weight bytes are in, where it is one a matrix
    product runs in (else float32: quantized weights are multiplied after a cast)."""
    count: Counter = Counter()
    for p in module.parameters():
        if p.dtype in COMPUTE_DTYPES:
            count[p.dtype] += p.numel() * p.element_size()
    return count.most_common(1)[0][0] if count else torch.float32


class Figures:
    """Bandwidth and throughput for one module's engine, looked up when first asked for."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._flops: dict[tuple, float | None] = {}
        # device bytes a probe may take now (the budget less what the engine holds); None: no limit
        self.room: Callable[[], int | None] = lambda: None
        # the executor's fixed cost of a call, measured on a device (``executor.call_seconds``,
        # set by the engine: a figure lives below the executor); None: not measured here
        self.call_probe: Callable[[str], float] | None = None

    def flops_per_s(self, config) -> float | None:
        if config.flops_per_s:
            return float(config.flops_per_s)
        key = (config.device,)
        if key not in self._flops:
            try:
                got = bandwidth.matmul_throughput(config.device, compute_dtype(self.module), max_bytes=self.room())
            except Exception:  # a device this build of torch cannot name or use: no estimate
                got = {"flops_per_s": None, "source": "unmeasurable"}
            if got["source"] == bandwidth.NO_ROOM:
                return None  # asked again when the budget leaves room
            self._flops[key] = got["flops_per_s"]
        return self._flops[key]

    @staticmethod
    def bytes_per_s(config) -> float | None:
        if config.bandwidth_bytes_per_s:
            return float(config.bandwidth_bytes_per_s)
        return bandwidth.cached_host_to_device(config.device)

    def call_s(self, config) -> float:
        """The executor's fixed cost of a call on ``config``'s device (``bandwidth.executor_call``:
        measured once, cached beside the bandwidth); 0 where it is not measured."""
        probe = self.call_probe
        if probe is None:
            return 0.0
        try:
            got = bandwidth.executor_call(config.device, lambda: probe(config.device))
        except Exception:  # a device this build of torch cannot name: no figure
            return 0.0
        return got["call_s"] or 0.0

    @staticmethod
    def link(src: str, dst: str, room: int | None = None) -> tuple[float, float] | None:
        """``(bytes_per_s, latency_s)`` of a hop from device ``src`` to ``dst`` (two GPUs:
        ``bandwidth.device_to_device``, measured once with buffers of at most ``room`` bytes on
        each, cached); None where it is not known."""
        if torch.device(src).type != "cuda" or torch.device(dst).type != "cuda":
            return None
        try:
            got = bandwidth.device_to_device(src, dst, max_bytes=room)
        except Exception:  # a device this build of torch cannot name or use: no estimate
            return None
        return (got["bytes_per_s"], got["latency_s"] or 0.0) if got["bytes_per_s"] else None

    @staticmethod
    def latency_s(config) -> float:
        """The fixed seconds of one copy (see the module docstring)."""
        if config.copy_latency_s is not None:
            return float(config.copy_latency_s)
        if config.bandwidth_bytes_per_s:
            return 0.0
        return bandwidth.cached_latency(config.device)


class UnitTimes:
    """Measured compute seconds per unit of one input signature (``shape.Shape.times``).
    ``top(name)`` maps a part of a finer cut to the unit it was cut from (the parts' times add up)."""

    def __init__(self, top: Callable[[str], str]) -> None:
        self.top = top
        self._clock = None
        self._seconds: dict[str, float] | None = None

    def measured(self, clock) -> None:
        """A measuring forward ran with ``clock`` (None: it kept no clock)."""
        self._seconds = None
        if clock is not None:
            self._clock = clock
        self.ready()

    def ready(self) -> bool:
        """True once, when the clock has just become readable (the plan can be timed again);
        reading never waits (a clock whose last mark has not completed stays pending)."""
        clock = self._clock
        if clock is None:
            return False
        secs = clock.seconds()
        if secs is None:
            return False
        self._clock = None
        out: dict[str, float] = {}
        for n, s in secs.items():
            t = self.top(n)
            out[t] = out.get(t, 0.0) + s
        self._seconds = out
        return True

    def seconds(self) -> dict[str, float] | None:
        return self._seconds
