"""The shared state of one Max VRAM node's patches: the settings and the budget they give, and
``PatchState``, shared by a patched object and all its clones, which owns one engine per module
it runs and turns budget errors into the node's message (shown through ``report``). The one rule: a budget that cannot hold a call is a clear error naming what
does not fit (an out-of-memory error only where the host has a smaller fallback). May call the
engine's public face, ``report`` (the node's payload), ``lora`` (device merges), ``gpu`` (the host's own GPU use) and ``compiler``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import weakref

import torch

import comfy.model_management as mm

from ..vramcut_core import GIB, BudgetError, Engine, EngineConfig, RamBudgetError, gib_text, signature
from .compiler import compiler_off
from .devices import Devices, device_name, memory_word
from .errors import VRAMCutError, VRAMCutOOM
from .gpu import host_hooks, may_page_lock
from .lora import DeviceMerge
from .report import NodeReport

log = logging.getLogger("vramcut")

KEY = "vramcut"            # wrapper / callback / attachment key
MODES = ("fixed", "free VRAM minus reserve")

__all__ = ["KEY", "MODES", "VRAMCutError", "VRAMCutOOM", "Settings", "PatchState", "Previewed", "state_of"]


@dataclasses.dataclass(frozen=True)
class Settings:
    max_vram_gb: float
    budget_mode: str = "fixed"
    reserve_gb: float = 1.0
    prefetch: bool = True
    residency: bool = True
    devices: Devices | None = None  # the Devices node's budgets, one per device; None: max_vram_gb's
    max_ram_gb: float = 0.0         # host RAM for the models' weights (the rest is read from disk); 0: no budget

    def validate(self) -> "Settings":
        for name in ("max_vram_gb", "reserve_gb", "max_ram_gb"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or math.isinf(v):
                raise VRAMCutError(f"{name} must be a number of GiB, got {v!r}")
            if v < 0:
                raise VRAMCutError(f"{name} must not be negative, got {v}")
        if self.budget_mode not in MODES:
            raise VRAMCutError(f"budget_mode must be one of {MODES}, got {self.budget_mode!r}")
        if self.devices is not None:
            self.devices.validate()
        return self

    @property
    def enabled(self) -> bool:
        """0 turns VRAMCut off in both modes; with 'free VRAM minus reserve', max_vram_gb caps."""
        return self.max_vram_gb > 0

    def budget_bytes(self, device: torch.device, free_memory=None) -> int:
        """The budget in bytes on ``device``: fixed, or the device's free memory less the reserve.
        ``free_memory(device)`` is what the host could give (its own patcher's answer, which on
        dynamic-VRAM hosts includes what it would evict); the device's free memory otherwise."""
        if self.budget_mode == "fixed":
            b = int(self.max_vram_gb * GIB)
        else:
            free = int((free_memory or mm.get_free_memory)(device))
            b = free - int(self.reserve_gb * GIB)
            if b <= 0:
                raise VRAMCutError(f"free {memory_word(device)} {free / GIB:.3f} GiB minus reserve {self.reserve_gb:.3f} GiB "
                                   "leaves no budget")
            b = min(b, int(self.max_vram_gb * GIB))  # max_vram_gb caps it (0 is off: never here)
        if b <= 0 and self.max_vram_gb > 0:
            raise VRAMCutError(f"max_vram_gb = {self.max_vram_gb:g} is less than one byte: give the budget in "
                               f"GiB (6 means 6 GiB), or 0 to turn VRAMCut off")
        if b <= 0:
            raise VRAMCutError("the budget must be positive (0 turns VRAMCut off)")
        return b


    def home_budget_bytes(self, device) -> int | None:
        """The budget given for ``device`` alone, where it is a fixed number: max_vram_gb, or with
        devices that device's entry; None where it is read from free memory."""
        if self.devices is not None:
            return self.devices.fixed_budget(device)
        return int(self.max_vram_gb * GIB) if self.budget_mode == "fixed" else None

    @property
    def refits(self) -> bool:
        """The budget follows free VRAM: re-read before each call (one device, 'free VRAM minus
        reserve'; with devices, where a device's budget is ``free``)."""
        if self.devices is not None:
            return self.devices.follows_free()
        return self.budget_mode != "fixed"


class Previewed(Exception):
    """Ends a call made for a plan preview where the engine would have run it: the traced plan."""

    def __init__(self, engine: Engine, plan) -> None:
        super().__init__("plan preview")
        self.engine, self.plan = engine, plan


class PatchState:
    """Shared by a patched object and all its clones (ComfyUI copies attachments by calling
    ``on_model_patcher_clone``). Owns one engine per module it runs."""

    def __init__(self, kind: str, settings: Settings, report: NodeReport, keep_resident: tuple[str, ...] = ()) -> None:
        self.kind, self.settings, self.report, self.keep_resident = kind, settings, report, keep_resident
        self._engines: "weakref.WeakKeyDictionary[torch.nn.Module, Engine]" = weakref.WeakKeyDictionary()
        self._patches: "weakref.WeakKeyDictionary[Engine, object]" = weakref.WeakKeyDictionary()
        self.free_memory = None  # the host's answer to "how much could you free", where it has one
        self.fast_disk = False   # the host streams the model from a fast disk: keep file-backed masters
        self.in_run = False      # between the host's ON_PRE_RUN and ON_CLEANUP (a sampling run)
        self.teardown_pending = False  # the host tore the model down during a forward: release after it
        self._after_forward: list = []  # what the host's teardown left for the end of the running forward
        self.previewing = False  # a plan preview: calls reaching ``run`` give their traced plan, nothing runs
        self._reloads: set[int] = set()  # clones the host detaches only to load this patch again
        _STATES.add(self)

    def on_model_patcher_clone(self):
        return self

    def engine(self, module: torch.nn.Module, device, keep_buffers: bool | None = None) -> Engine:
        """The engine for ``module`` on ``device``; ``keep_buffers`` (when given) says whether it
        holds device buffers between calls until ``release``."""
        dev = torch.device(device)
        eng = self._engines.get(module)
        if eng is None or eng.device != dev:
            cfg = EngineConfig(**self._budget(dev), prefetch=self.settings.prefetch, residency=self.settings.residency,
                               keep_resident=self.keep_resident, pin_memory=may_page_lock(), keep_file_backed=self.fast_disk,
                               ram_budget_bytes=int(self.settings.max_ram_gb * GIB) or None)
            eng = Engine(module, cfg, on_plan=lambda e, plan, sig: self.report.set(self.kind, e, plan),
                         host=host_hooks(dev))
            for w in eng.unitset.warnings:
                log.warning("VRAMCut %s: %s", self.kind, w)
            self._engines[module] = eng
        if keep_buffers is not None:
            eng.keep_buffers(keep_buffers)
        return eng

    def _budget(self, dev: torch.device) -> dict:
        """The budget part of the engine's configuration on ``dev``: one budget, as before, or with
        the Devices node each device's (``devices``, ``dev`` the home device among them, the
        budget their sum), passed only when the user gave devices."""
        if self.settings.devices is None:
            return {"budget_bytes": self.settings.budget_bytes(dev, self.free_memory), "device": str(dev)}
        budgets = self.settings.devices.budgets(dev, self.free_memory)
        if "devices" not in getattr(EngineConfig, "__dataclass_fields__", {}):
            raise VRAMCutError("devices: this version of the engine plans one device only; disconnect the "
                               "Devices node (the budget is then max_vram_gb's)")
        return {"budget_bytes": sum(b for _, b in budgets), "device": device_name(dev), "devices": budgets}

    def engines(self) -> list[Engine]:
        """The engines this patch has made (one per module it ran), alive now."""
        return list(self._engines.values())

    @property
    def running(self) -> bool:
        return any(e.running for e in self.engines())

    def begin_run(self, *_args, **_kw) -> None:
        """Start of a sampling run (ON_PRE_RUN): until its cleanup, a model planned all resident
        keeps its weights swapped in between steps (no hooks, no pointer swaps per step). Outside
        a run (a node calling the model directly) they go back after every call."""
        self.in_run = True

    def release(self, *_args, **_kw) -> None:
        """Give back every device buffer the engines hold (ComfyUI cannot see them)."""
        self.in_run = False
        for e in self.engines():
            if not e.running:
                e.keep_buffers(False)
                e.release()

    def before_teardown(self) -> bool:
        """The host is about to detach or unpatch the model (and move it to its offload device):
        the engines give their device copies back first, nothing copied back (the host masters
        are the truth), so the host's move finds every weight on the host. While a forward runs
        on the weights nothing is taken from under it: False, and the engines let go when the
        forward ends."""
        if self.running:
            self.teardown_pending = True
            return False
        self.release()
        return True

    def reloading(self, patcher) -> None:
        """The host is about to detach ``patcher``, a clone of this patch, only to load this patch
        again (``load_models_gpu`` detaches every clone of the model it loads, the one it loads
        included: a later prompt on the same model): the engines keep what they hold."""
        self._reloads.add(id(patcher))

    def loading(self) -> None:
        """The host loads a clone of this patch: what ``reloading`` announced is settled."""
        self._reloads.clear()

    def detaching(self, patcher, unpatch_all: bool) -> None:
        """The host detaches ``patcher``, a clone of this patch. To unload it (``unpatch_all``:
        memory for another model, Unload models), or because another model of the same network
        is loaded (the original, another patch of it) or the patcher is deleted, the engines give
        everything back: the host no longer counts this model as loaded and would never unload it
        again. Detached only to be loaded again (``reloading``), they keep it."""
        kept = not unpatch_all and id(patcher) in self._reloads
        self._reloads.discard(id(patcher))
        if not kept:
            self.before_teardown()

    def detached(self, _patcher=None, unpatch_all: bool = True, *_a, **_kw) -> None:
        """ON_DETACH: an unload gives everything back (``detaching`` decided the rest)."""
        if unpatch_all:
            self.release()

    def after_forward(self, fn) -> None:
        """Call ``fn()`` once no forward runs any more (after the engines let go of the weights)."""
        self._after_forward.append(fn)

    def outside(self, path: str) -> None:
        """Say on the node (and once in the log) that a call path runs outside the budget."""
        msg = (f"{self.kind}: {path} runs outside VRAMCut's budget: ComfyUI streams this model's "
               "weights layer by layer itself (results are the same; memory and speed are ComfyUI's)")
        if self.report.payload.get("message") != msg:
            log.warning("VRAMCut: %s", msg)
        self.report.notice(msg)
        self.report.send()

    def finish(self, *_args, **_kw) -> None:
        """End of a run (ComfyUI's cleanup after sampling): the module whole again (no held
        weight, no hook), and the node shows what the run did (forwards, bytes streamed, measured
        peak). The device buffers stay, so the next prompt on this patch copies nothing they
        still hold; they go when the host unloads the model (the device memory they take counts
        as used when it makes room for another model), when another model of the same network
        is loaded, when the patches merged into them or the budgets change, and when the patch
        is deleted (``detaching``, ``run``, ``refit``)."""
        self.in_run = False
        for e in self.engines():
            if not e.running:
                e.rest()
        for e in self.engines():
            if e.last_plan is not None and e.stats.forwards and not e.running:
                self.report.set(self.kind, e, e.last_plan)
                e.reset_stats()  # the next run reports its own

    def refit(self, engine: Engine) -> None:
        """'free VRAM minus reserve' read again before a call: what is free now (ComfyUI has made
        room for the model by the first call, not when the node ran; another program may take
        memory between calls) plus what this engine holds itself, less the reserve. The engine
        decides whether the change is worth planning again (it keeps its plan on small
        wobbles) and says so in its plan ("refit"). One reading of the host's free-memory
        figure per call: no host sync beyond what the host does itself. With devices, each
        ``free`` device's budget is read so (``Engine.set_devices``)."""
        if self.settings.devices is not None:
            engine.set_devices(self.settings.devices.budgets(engine.config.device, self.free_memory,
                                                             held=engine.held_bytes_by_device))
            return
        ask = self.free_memory or mm.get_free_memory
        held = engine.held_bytes
        engine.set_budget(self.settings.budget_bytes(torch.device(engine.config.device),
                                                     lambda d: int(ask(d)) + held))

    def run(self, engine: Engine, fn, *args, sig=None, patcher=None, **kwargs):
        """Run through the engine, merging ``patcher``'s weight patches into each unit's device
        copy as it arrives. A budget that cannot hold this call is a plain error naming what does
        not fit and the smallest budget; it becomes an OOM error only where the host has a
        fallback that makes the call smaller (tiled VAE, smaller upscale tiles). In a plan
        preview the call only traces (``Previewed`` carries its plan; budget errors pass as they
        are): no budget resolved, nothing copied, nothing remembered but the traced profile."""
        merge = DeviceMerge.for_call(patcher, engine.module)
        if self.previewing:
            with _host_quiet(merge):
                plan = engine.preview_as(signature(args, kwargs) if sig is None else sig, fn, *args,
                                         on_loaded=merge, **kwargs)
            raise Previewed(engine, plan)
        if self.settings.refits and not engine.running:
            self.refit(engine)
        key = merge.key if merge is not None else None
        if self._patches.get(engine, key) != key and not engine.running:
            engine.release()  # held device copies were merged with other patches
        self._patches[engine] = key
        try:
            steady = engine.steady_stats.forwards
            with _host_quiet(merge):  # the compiler off: CLIP, VAE and the rest have no sampling run
                out = (engine.run(fn, *args, on_loaded=merge, **kwargs) if sig is None
                       else engine.run_as(sig, fn, *args, on_loaded=merge, **kwargs))
            if self.kind != "MODEL" and engine.steady_stats.forwards > steady and not engine.running:
                # an encode / decode that ran the plan: the node shows its measured cost (sampling
                # shows it once, at the end of the run: `finish`)
                self.report.set(self.kind, engine, engine.last_plan)
            return out
        except BudgetError as e:
            fallback = _host_fallback(self.kind, fn, args)
            if fallback is False and self.kind == "VAE":
                msg = (f"{self.kind}: {e}. ComfyUI's tiled fallback would run this VAE call at the same size "
                       f"(the input is no larger than one tile), so it cannot help: raise max_vram_gb")
            else:
                msg = f"{self.kind}: {e}"  # the banner joins several models' messages: each names its own
            self.report.fail(msg, e, kind=self.kind)
            # the error panel leads with the fix, the number the node shows
            lead = msg
            to = "to" if getattr(e, "exact", False) else "to at least"  # "at least": a lower bound only
            if getattr(e, "device_budgets", None):   # the devices replace max_vram_gb: name each one
                lead = f"Devices: set {to} {', '.join(f'{d}={gib_text(b)}' for d, b in e.device_budgets)}. {msg}"
            elif getattr(e, "min_budget_bytes", None) and (self.settings.devices is None
                                                            or isinstance(e, RamBudgetError)):
                what = "max_ram_gb" if isinstance(e, RamBudgetError) else "max_vram_gb"
                lead = f"Max VRAM: set {what} {to} {gib_text(e.min_budget_bytes)}. {msg}"
            if fallback:
                raise VRAMCutOOM(lead) from e
            raise VRAMCutError(lead) from e
        except torch.OutOfMemoryError as e:
            self.report.fail(str(e))
            raise
        finally:
            if self.teardown_pending and not self.running:
                self.teardown_pending = False
                self.release()
            if self._after_forward and not self.running:
                self.release()  # the host's own tensors again, and no copy still reading them
                todo, self._after_forward = self._after_forward, []
                for fn in todo:
                    fn()


@contextlib.contextmanager
def _host_quiet(merge):
    """The host's model compiler off, and its per-forward patch functions where ``merge`` puts
    the patches into the device copies instead."""
    with compiler_off(), merge.host_patches_off() if merge is not None else contextlib.nullcontext():
        yield


# The tile sizes ComfyUI's VAE falls back to after an out-of-memory error (latent units for a
# decode, pixels for an encode): a call no larger than a tile would be run again at full size.
_VAE_TILE = {"decode": 64, "encode": 512}


def _host_fallback(kind: str, fn, args) -> bool | None:
    """Whether the host retries this call smaller after an out-of-memory error: True (upscale
    tiles; a VAE call larger than a tile), False (a VAE call the tiles would not shrink), None
    (no fallback: sampling, text encoders, CLIP vision)."""
    if kind == "UPSCALE_MODEL":
        return True
    if kind != "VAE":
        return None
    tile = _VAE_TILE.get(getattr(fn, "__name__", ""))
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if tile is None or x is None or x.ndim < 4:
        return True
    return max(x.shape[-2:]) > tile


_STATES: "weakref.WeakSet[PatchState]" = weakref.WeakSet()   # every patch alive in the process


def wait_all_copies() -> None:
    """Every live engine's copies landed (the host is about to unpin weights that clones of one
    model share: a clone of another patch may be streaming from them)."""
    for st in list(_STATES):
        for eng in st.engines():
            eng.wait_copies()


def running_on(model: torch.nn.Module) -> "PatchState | None":
    """The patch whose engine runs a forward of ``model`` (or a module inside it) now, if any:
    clones of one model share the host's pinned weights, so another clone's teardown must wait
    for that forward's end."""
    for st in list(_STATES):
        for eng in st.engines():
            if eng.running and (eng.module is model or any(m is eng.module for m in model.modules())):
                return st
    return None


def state_of(patcher) -> PatchState | None:
    att = getattr(patcher, "attachments", None) or {}
    st = att.get(KEY)
    return st if isinstance(st, PatchState) else None
