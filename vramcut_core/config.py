"""What an engine is built with: its ``EngineConfig`` (the budget, the device or devices, the
plan options, the speed figures) and the ``HostHooks`` a host gives it of its own use of the
device. Checked once, at construction (precise ``ValueError``s); frozen afterwards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable

import torch

from .figures.speed import SPEEDS
from .planning.plan import PlanOptions

VERIFY_ENV = "VRAMCUT_VERIFY"


def verify_from_env() -> bool:
    return os.environ.get(VERIFY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    budget_bytes: int
    device: str = "cuda"
    family: str | None = None
    prefetch: bool = True
    residency: bool = True
    keep_resident: tuple[str, ...] = ()  # unit name patterns that must stay resident
    track_cpu_memory: bool = False   # measure activations on every CPU forward, not only the first
    pin_memory: bool = True          # page-lock host masters (CUDA); off: plain pageable copies
    keep_file_backed: bool = False   # file-mapped weights stay their own masters (no flat host
                                     # copy), streamed through a page-locked window (a fast disk)
    verify: bool = dataclasses.field(default_factory=verify_from_env)  # compare first forwards with unpatched
    # residency chosen by predicted time ("time"), by bytes ("count") or "auto" (time on CUDA); see ``speed``
    speed: str = "auto"
    bandwidth_bytes_per_s: float | None = None  # host-to-device; None: the figure measured before, if any
    flops_per_s: float | None = None            # compute throughput; None: measured once (``bandwidth``)
    copy_latency_s: float | None = None         # fixed seconds per copy; None: the bandwidth probe's fit (or 0)
    # per-device budgets in bytes, in the user's order (``placement.parse_devices``); empty: one
    # device, ``device``, under ``budget_bytes``. Non-empty: ``device`` is the home device (inputs
    # arrive and the output returns there) and one of them; ``budget_bytes`` is their sum
    devices: tuple[tuple[str, int], ...] = ()
    # host memory the pack may hold for this module's weights (``tiers``): flat masters, the bounce
    # buffer; what does not fit is read from its file each call. None: no RAM budget (every
    # streamed unit has its master in RAM, as before)
    ram_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget_bytes, int) or isinstance(self.budget_bytes, bool) or self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {self.budget_bytes!r}")
        if self.speed not in SPEEDS:
            raise ValueError(f"speed must be one of {', '.join(SPEEDS)}, got {self.speed!r}")
        for f in ("bandwidth_bytes_per_s", "flops_per_s", "copy_latency_s"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not (v >= 0 if f == "copy_latency_s" else v > 0)):
                raise ValueError(f"{f} must be a positive number or None, got {v!r}")
        if self.devices:
            _check_devices(self)
        r = self.ram_budget_bytes
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r <= 0):
            raise ValueError(f"ram_budget_bytes must be a positive int or None, got {r!r}")
        if r is not None and len(self.devices) > 1:
            raise ValueError("ram_budget_bytes: a RAM budget is planned for one device only, not yet for several")

    @property
    def options(self) -> PlanOptions:
        return PlanOptions(prefetch=self.prefetch, residency=self.residency)


def _check_devices(c: "EngineConfig") -> None:
    names = []
    for entry in c.devices:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"devices: each entry is (device, budget bytes), got {entry!r}")
        name, b = entry
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError):
            raise ValueError(f"devices: {name!r} is not a device") from None
        if len(c.devices) > 1 and (dev.index is None or dev.type != "cuda"):  # one device: today's path
            raise ValueError(f"devices: {name!r}: name each device with its index (cuda:N); "
                             "several devices must all be CUDA devices")
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
            raise ValueError(f"devices: the budget of {name} must be a positive int of bytes, got {b!r}")
        names.append(str(dev))
    if len(set(names)) != len(names):
        raise ValueError(f"devices: a device is named twice ({', '.join(names)})")
    home = torch.device(c.device)
    if str(home) not in names:
        raise ValueError(f"devices: the home device {c.device!r} (where inputs arrive and the output "
                         f"returns) must be one of {', '.join(names)}")
    total = sum(b for _, b in c.devices)
    if c.budget_bytes != total:
        raise ValueError(f"devices: budget_bytes ({c.budget_bytes}) must be the devices' budgets summed ({total})")


@dataclasses.dataclass(frozen=True)
class HostHooks:
    """What a host tells an engine of its own use of the device, given once at construction.

    ``alloc_context()`` is entered around every device allocation the engine makes (a host that
    records allocation graphs keeps the engine's out of them). ``reader_streams()`` lists the
    host's other streams that may read weights while they are swapped in (its offload streams):
    each is ordered after the copies, as the compute stream is. ``page_lock_room()`` gives the
    bytes the host's own page-lock limit leaves after what the host locked itself; the engines'
    page-locked bytes stay within it (the process has one ledger: the last host to give one
    sets it)."""

    alloc_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    reader_streams: Callable[[], list] | None = None
    page_lock_room: Callable[[], int] | None = None


class TraceUnavailable(RuntimeError):
    """The dry run could not run these inputs (``Engine.preview_as``); the message says why."""
