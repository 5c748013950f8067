"""What VRAMCut needs from ComfyUI, in one place: the patcher subclass that keeps every weight
off the GPU, the shared per-patch state, budgets, and the live plan events.

Extension points used exist in ComfyUI 0.3.6x and in the newer releases (detected by presence):
``ModelPatcher`` subclassing (``clone()`` keeps the class), ``attachments`` (copied to clones),
``add_wrapper_with_key`` / ``add_callback_with_key``, ``CallbacksMP.ON_CLEANUP`` / ``ON_DETACH``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import weakref

import torch

import comfy.model_management as mm
import comfy.model_patcher
from comfy.patcher_extension import CallbacksMP

from ..vramcut_core import BudgetError, Engine, EngineConfig
from ..vramcut_core.tensors import GIB, fmt_bytes

log = logging.getLogger("vramcut")

KEY = "vramcut"            # wrapper / callback / attachment key
EVENT = "vramcut.plan"     # server event the web extension listens to
MODES = ("fixed", "free VRAM minus reserve")


class VRAMCutError(ValueError):
    """A user-facing problem with the node's inputs."""


class VRAMCutOOM(torch.cuda.OutOfMemoryError):
    """Raised when the budget cannot hold a call's activations, so that ComfyUI's own
    out-of-memory fallbacks (tiled VAE decode/encode, smaller upscale tiles) take over."""


@dataclasses.dataclass(frozen=True)
class Settings:
    max_vram_gb: float
    budget_mode: str = "fixed"
    reserve_gb: float = 1.0
    prefetch: bool = True
    residency: bool = True

    def validate(self) -> "Settings":
        for name in ("max_vram_gb", "reserve_gb"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or math.isinf(v):
                raise VRAMCutError(f"{name} must be a number of GiB, got {v!r}")
            if v < 0:
                raise VRAMCutError(f"{name} must not be negative, got {v}")
        if self.budget_mode not in MODES:
            raise VRAMCutError(f"budget_mode must be one of {MODES}, got {self.budget_mode!r}")
        return self

    @property
    def enabled(self) -> bool:
        return self.budget_mode != "fixed" or self.max_vram_gb > 0

    def budget_bytes(self, device: torch.device) -> int:
        """The budget in bytes on ``device``: fixed, or the device's free memory less the reserve
        (resolved when a model first runs, after ComfyUI has made room for it)."""
        if self.budget_mode == "fixed":
            b = int(self.max_vram_gb * GIB)
        else:
            free = int(mm.get_free_memory(device))
            b = free - int(self.reserve_gb * GIB)
            if self.max_vram_gb > 0:
                b = min(b, int(self.max_vram_gb * GIB))
            if b <= 0:
                raise VRAMCutError(f"free VRAM {fmt_bytes(free)} minus reserve {self.reserve_gb} GiB leaves no budget")
        if b <= 0 and self.budget_mode == "fixed" and self.max_vram_gb > 0:
            raise VRAMCutError(f"max_vram_gb = {self.max_vram_gb:g} is less than one byte: give the budget in "
                               f"GiB (6 means 6 GiB), or 0 to turn VRAMCut off")
        if b <= 0:
            raise VRAMCutError("the budget must be positive (0 turns VRAMCut off)")
        return b


class NodeReport:
    """The payload one Max VRAM node shows: one entry per patched model, updated live."""

    def __init__(self, node_id: str | None, settings: Settings) -> None:
        self.node_id = node_id
        self.payload: dict = {"budget_bytes": int(settings.max_vram_gb * GIB) if settings.budget_mode == "fixed" else None,
                              "enabled": settings.enabled, "message": None, "message_level": None,
                              "models": []}
        self._index: dict[str, int] = {}

    def set(self, kind: str, engine: Engine, plan=None) -> None:
        d = engine.describe(plan)
        entry = {"kind": kind, "label": f"{kind} · {d['label']}", "stage": d["stage"],
                 "signature": d["signature"], "warnings": d["warnings"], "text": d["text"], "plan": d["plan"],
                 "verify": d.get("verify") or []}
        if kind in self._index:
            self.payload["models"][self._index[kind]] = entry
        else:
            self._index[kind] = len(self.payload["models"])
            self.payload["models"].append(entry)
        self.payload["budget_bytes"] = engine.config.budget_bytes
        self.send()

    def fail(self, message: str) -> None:
        self.payload["message"], self.payload["message_level"] = message, "error"
        self.send()

    def notice(self, message: str) -> None:
        self.payload["message"], self.payload["message_level"] = message, "notice"

    def send(self) -> None:
        if self.node_id is None:
            return
        try:
            from server import PromptServer  # ComfyUI's server; absent in plain library use
            inst = getattr(PromptServer, "instance", None)
        except Exception:
            inst = None
        if inst is not None:
            try:
                inst.send_sync(EVENT, {"node": str(self.node_id), "payload": self.payload,
                                       "prompt_id": getattr(inst, "last_prompt_id", None)})
            except Exception as e:  # a UI update must never break a run
                log.debug("vramcut: could not send plan event: %s", e)


class PatchState:
    """Shared by a patched object and all its clones (ComfyUI copies attachments by calling
    ``on_model_patcher_clone``). Owns one engine per module it runs."""

    def __init__(self, kind: str, settings: Settings, report: NodeReport, pinned: tuple[str, ...] = ()) -> None:
        self.kind, self.settings, self.report, self.pinned = kind, settings, report, pinned
        self._engines: "weakref.WeakKeyDictionary[torch.nn.Module, Engine]" = weakref.WeakKeyDictionary()

    def on_model_patcher_clone(self):
        return self

    def engine(self, module: torch.nn.Module, device, keep_buffers: bool | None = None) -> Engine:
        """The engine for ``module`` on ``device``; ``keep_buffers`` (when given) says whether it
        holds device buffers between calls until ``release``."""
        dev = torch.device(device)
        eng = self._engines.get(module)
        if eng is None or eng.executor.device != dev:
            cfg = EngineConfig(budget_bytes=self.settings.budget_bytes(dev), device=str(dev),
                               prefetch=self.settings.prefetch, residency=self.settings.residency,
                               pinned=self.pinned)
            eng = Engine(module, cfg, on_plan=lambda e, plan, sig: self.report.set(self.kind, e, plan))
            for w in eng.unitset.warnings:
                log.warning("VRAMCut %s: %s", self.kind, w)
            self._engines[module] = eng
        if keep_buffers is not None:
            eng.keep_buffers(keep_buffers)
        return eng

    @property
    def running(self) -> bool:
        return any(e.executor.running for e in self._engines.values())

    def release(self, *_args, **_kw) -> None:
        """Give back every device buffer the engines hold (ComfyUI cannot see them)."""
        for e in list(self._engines.values()):
            if not e.executor.running:
                e.keep_buffers(False)
                e.release()

    def finish(self, *_args, **_kw) -> None:
        """End of a run (ComfyUI's cleanup after sampling): release, and show on the node what
        the run did (forwards, bytes streamed, measured peak)."""
        self.release()
        for e in list(self._engines.values()):
            if e.last_plan is not None and e.stats.forwards and not e.executor.running:
                self.report.set(self.kind, e, e.last_plan)
                e.reset_stats()  # the next run reports its own

    def run(self, engine: Engine, fn, *args, sig=None, **kwargs):
        """Run through the engine. A budget that cannot hold this call is a plain error naming
        what does not fit and the smallest budget; it becomes an OOM error only where the host
        has a fallback that makes the call smaller (tiled VAE, smaller upscale tiles)."""
        try:
            if sig is None:
                return engine.run(fn, *args, **kwargs)
            return engine.run_as(sig, fn, *args, **kwargs)
        except BudgetError as e:
            fallback = _host_fallback(self.kind, fn, args)
            if fallback is False and self.kind == "VAE":
                msg = (f"VRAMCut: {e}. ComfyUI's tiled fallback would run this VAE call at the same size "
                       f"(the input is no larger than one tile), so it cannot help: raise max_vram_gb")
            else:
                msg = f"VRAMCut: {e}"
            self.report.fail(msg)
            if fallback:
                raise VRAMCutOOM(msg) from e
            raise VRAMCutError(msg) from e
        except torch.OutOfMemoryError as e:
            self.report.fail(str(e))
            raise


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


def state_of(patcher) -> PatchState | None:
    att = getattr(patcher, "attachments", None) or {}
    st = att.get(KEY)
    return st if isinstance(st, PatchState) else None


def _any_weight_on(module: torch.nn.Module, device) -> bool:
    dev = torch.device(device)
    return any(p.device == dev for p in module.parameters()) if dev.type != "cpu" else False


class VRAMCutModelPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher that never puts weights on the GPU itself: every load is a low-VRAM load
    with no weight budget, so the weights stay on the offload device for the executor to stream;
    LoRA and other weight patches are merged into them on the host as a full load would. It tells
    ComfyUI it needs the budget, not the full model size, so other models are not evicted for
    nothing. It is a plain ``ModelPatcher`` (never the host's dynamic-VRAM patcher), so newer
    ComfyUI does not offload this model on its own."""

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        st = state_of(self)
        if st is not None and st.running:
            return 0  # the executor holds the weights right now: leave them where they are
        if self.model.model_loaded_weight_memory > 0 or _any_weight_on(self.model, device_to):
            # another clone of this model left weights on the GPU: put them back first, or
            # ComfyUI would treat the model as loaded and keep them there
            self.unpatch_model(self.offload_device, unpatch_weights=True)
        super().partially_load(device_to, extra_memory=1, force_patch_weights=force_patch_weights)
        return 0

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        # One byte of weight budget: every module is set up for per-forward casting, none moved.
        # Weight patches (LoRA) are merged into the host weights once, exactly as a full load
        # merges them (same precision, same rounding), instead of being recomputed every forward.
        return super().load(device_to, lowvram_model_memory=1, force_patch_weights=True,
                            full_load=False, **kwargs)

    def model_size(self):
        real = super().model_size()
        st = state_of(self) if hasattr(self, "attachments") else None
        if st is None or st.settings.budget_mode != "fixed":
            return real
        return min(real, max(1, int(st.settings.max_vram_gb * GIB)))


def to_vramcut_patcher(patcher, state: PatchState):
    """A clone of ``patcher`` as a VRAMCutModelPatcher carrying ``state``; the original is left
    as it is. Models that the host manages with dynamic VRAM are reloaded without it."""
    is_dynamic = getattr(patcher, "is_dynamic", None)
    if callable(is_dynamic) and is_dynamic():
        try:
            clone = patcher.clone(disable_dynamic=True)
        except Exception as e:
            raise VRAMCutError(
                "this model is managed by ComfyUI's dynamic VRAM and could not be reloaded without it "
                f"({e}); start ComfyUI with --disable-dynamic-vram to use VRAMCut on it") from e
    else:
        clone = patcher.clone()
    if not isinstance(clone, comfy.model_patcher.ModelPatcher):
        raise VRAMCutError(f"cannot patch a {type(clone).__name__}")
    clone.__class__ = _patcher_class(type(clone))
    clone.attachments[KEY] = state
    for ctype, fn in ((CallbacksMP.ON_CLEANUP, state.finish), (CallbacksMP.ON_DETACH, state.release)):
        clone.remove_callbacks_with_key(ctype, KEY)
        clone.add_callback_with_key(ctype, KEY, fn)
    return clone


_CLASSES: dict[type, type] = {}


def _patcher_class(cls: type) -> type:
    """VRAMCutModelPatcher itself for plain ModelPatchers; for a subclass another pack made
    (GGUF's patcher, say), a class deriving from both, so its behaviour is kept."""
    if issubclass(cls, VRAMCutModelPatcher):
        return cls
    if cls is comfy.model_patcher.ModelPatcher:
        return VRAMCutModelPatcher
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"VRAMCut{cls.__name__}", (VRAMCutModelPatcher, cls), {})
    return _CLASSES[cls]


def plain_patcher(model: torch.nn.Module, like=None, load_device=None, offload_device=None):
    """A new plain ModelPatcher for objects the host runs without one (old upscale models)."""
    return comfy.model_patcher.ModelPatcher(
        model, load_device=load_device or getattr(like, "load_device", None) or mm.get_torch_device(),
        offload_device=offload_device or getattr(like, "offload_device", None) or mm.unet_offload_device())
