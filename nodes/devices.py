"""The devices a model may use and their budgets, as the "Devices (VRAMCut)" node gives them.

Owns ``Devices`` (the text as typed, e.g. ``cuda:0=10, cuda:1=6``, and the reserve kept free on a
device whose budget is ``free``), its check against what this host can see, and the budgets in
bytes an engine is built with. The text is parsed by the engine's ``parse_devices``; what only the
host knows is checked here: which devices exist (``torch.cuda.device_count()``), the host's main
device (``comfy.model_management.get_torch_device()``: inputs arrive and the output returns
there, so it must be one of them) and each device's free memory for a ``free`` budget.

The one rule: bad input is refused with a message naming the entry at fault, before any weight
moves; without a Devices node nothing here runs (the budget is the Max VRAM node's, as before).
May call ComfyUI's model_management and the engine's public face.
"""
from __future__ import annotations

import dataclasses
import math
import re

import torch

import comfy.model_management as mm

from ..vramcut_core import GIB, parse_devices
from .errors import VRAMCutError

DEVICES_TYPE = "VRAMCUT_DEVICES"  # the socket type between the Devices node and the Max VRAM nodes


def device_name(device) -> str:
    """``cuda:0`` for a CUDA device with or without its index, ``cpu`` for the CPU: the names the
    devices text uses."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def memory_word(device) -> str:
    """What a device's memory is called in a message: VRAM on a GPU, memory on the CPU."""
    return "memory" if torch.device(device).type == "cpu" else "VRAM"


def main_device() -> str:
    """The host's main device, where inputs arrive and the output returns."""
    return device_name(mm.get_torch_device())


def host_devices() -> list[str]:
    """The devices this host computes on, its main device first: each GPU it counts, or the CPU."""
    main = main_device()
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]
    return [main] + [g for g in gpus if g != main]


def default_text() -> str:
    """The Devices node's default: every device of this host at its free memory (a list naming
    devices the host does not have would be refused on the first run)."""
    return ", ".join(f"{d}=free" for d in host_devices())


def total_memory(name: str) -> int:
    """``name``'s total memory in bytes (the host's answer: its VRAM, or the machine's RAM)."""
    return int(mm.get_total_memory(torch.device(name)))


def host_knows(name: str) -> bool:
    """Whether this host can see ``name``: a CUDA device it counts, or the CPU where the CPU is
    its main device (a budget on the CPU makes sense only on a host that computes there)."""
    if name == "cpu":
        return main_device() == "cpu"
    if name.startswith("cuda:"):
        return int(name[5:]) < (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return False


@dataclasses.dataclass(frozen=True)
class Devices:
    text: str
    reserve_gb: float = 1.0

    def entries(self) -> list[tuple[str, int | None]]:
        """``[(device, budget bytes or None for free)]`` in the user's order; ``VRAMCutError`` for
        a malformed entry, a device this host cannot see, a budget that is not a positive number
        of GiB, a bad reserve, or a list without the host's main device."""
        r = self.reserve_gb
        if not isinstance(r, (int, float)) or isinstance(r, bool) or math.isnan(r) or math.isinf(r) or r < 0:
            raise VRAMCutError(f"devices: reserve_gb must be a number of GiB, not negative, got {r!r}")
        main = main_device()
        text = str(self.text)
        if re.fullmatch(r"\s*(free|\d+(\.\d*)?|\.\d+)\s*", text, re.IGNORECASE):
            text = f"{main}={text.strip()}"  # a budget alone ("free", "8") is the main device's
        try:
            out = parse_devices(text, known=host_knows, free=True)
        except ValueError as e:
            raise VRAMCutError(str(e)) from None
        if main not in (d for d, _ in out):
            raise VRAMCutError(f"devices: the host's main device {main} is not in the list ({self.text.strip()}): "
                               f"inputs arrive and the output returns there; add it, e.g. {main}=free")
        return out

    def validate(self) -> "Devices":
        """The entries checked, and a reserve no ``free`` device can leave room beside (said
        before any model loads, not when the first one runs)."""
        for name, b in self.entries():
            total = total_memory(name) if b is None else 0
            if b is None and self.reserve_gb * GIB >= total:
                raise VRAMCutError(f"devices: {name}=free: reserve_gb {self.reserve_gb:.3f} GiB is not less than "
                                   f"{name}'s total {memory_word(name)} ({total / GIB:.3f} GiB): no budget would be left")
        return self

    def budgets(self, home, free_memory=None, held=None) -> tuple[tuple[str, int], ...]:
        """The budget of each device in bytes, ``free`` resolved now: the device's free memory
        (plus ``held[device]``, what the model's engine holds there itself) less ``reserve_gb``
        (on ``home``, the device the model computes on, ``free_memory(device)`` where the host
        answers what it could free). ``home`` must be in the list."""
        entries = self.entries()
        home = device_name(home)
        if home not in (d for d, _ in entries):
            raise VRAMCutError(f"devices: this model runs on {home}, which is not in the list ({self.text.strip()})")
        out = []
        for name, b in entries:
            if b is None:
                ask = free_memory if (free_memory is not None and name == home) else mm.get_free_memory
                free = int(ask(torch.device(name))) + int((held or {}).get(name, 0))
                b = free - int(self.reserve_gb * GIB)
                if b <= 0:
                    raise VRAMCutError(f"devices: {name}=free: free {memory_word(name)} {free / GIB:.3f} GiB minus "
                                       f"reserve {self.reserve_gb:.3f} GiB leaves no budget")
            out.append((name, int(b)))
        return tuple(out)

    def follows_free(self) -> bool:
        """Whether some device's budget is ``free`` (read again before each call)."""
        try:
            return any(b is None for _, b in self.entries())
        except VRAMCutError:
            return False

    def fixed_budget(self, device) -> int | None:
        """The budget given for ``device`` in bytes, or None (free, or not in the list)."""
        name = device_name(device)
        try:
            entries = self.entries()
        except VRAMCutError:
            return None
        return next((b for d, b in entries if d == name), None)

    def to_json(self) -> list[dict]:
        """What the node's header says: each device and its budget (None: free less the reserve)."""
        try:
            entries = self.entries()
        except VRAMCutError:
            return []
        return [{"device": d, "budget_bytes": b} for d, b in entries]


def multigpu_clones(patcher) -> list:
    """The copies ComfyUI's "MultiGPU CFG Split" made of this model, one per extra GPU (newer
    hosts; none on hosts without it)."""
    get = getattr(patcher, "get_additional_models_with_key", None)
    return list(get("multigpu")) if callable(get) else []


CFG_SPLIT_REFUSED = ("devices: this model also goes through ComfyUI's MultiGPU CFG Split, which runs a whole copy "
                     "of it on each extra GPU while VRAMCut places its blocks across those GPUs: use one of them "
                     "(remove the CFG Split node, or disconnect the Devices node)")
