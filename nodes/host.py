"""What VRAMCut needs from ComfyUI, in one place: the patcher subclass that keeps every weight
off the GPU, the shared per-patch state, budgets, weight patches merged on the device, and the
live plan events.

The one rule: a patched model shares its module and its host weights with the model it was made
from (one host copy, never a reload from disk), and while it is loaded nothing of the host's own
offloading (low-VRAM casts of streamed weights, dynamic VRAM's virtual weights and prefetch)
touches those weights; when it is unloaded the module is handed back as the host left it.

Extension points used exist in ComfyUI 0.3.6x and in the newer releases (detected by presence):
``ModelPatcher`` subclassing (``clone()`` keeps the class), ``attachments`` (copied to clones),
``add_wrapper_with_key`` / ``add_callback_with_key``, ``CallbacksMP.ON_CLEANUP`` / ``ON_DETACH``;
on newer hosts ``is_dynamic()``, ``get_free_memory()`` and ``lora_compute_dtype()``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import math
import weakref

import torch

import comfy.float
import comfy.lora
import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils
from comfy.patcher_extension import CallbacksMP

from ..vramcut_core import BudgetError, Engine, EngineConfig
from ..vramcut_core import executor as executor_module
from ..vramcut_core import quant
from ..vramcut_core import bandwidth
from ..vramcut_core.report import cost_to_json
from ..vramcut_core.tensors import GIB, fmt_bytes
from . import streams

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

    def budget_bytes(self, device: torch.device, free_memory=None) -> int:
        """The budget in bytes on ``device``: fixed, or the device's free memory less the reserve.
        ``free_memory(device)`` is what the host could give (its own patcher's answer, which on
        dynamic-VRAM hosts includes what it would evict); the device's free memory otherwise."""
        if self.budget_mode == "fixed":
            b = int(self.max_vram_gb * GIB)
        else:
            free = int((free_memory or mm.get_free_memory)(device))
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
        # the answer line's cost: measured after a run, estimated from this machine's bandwidth before
        d["plan"]["cost"] = cost_to_json(d["plan"], bandwidth.host_to_device(engine.config.device))
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

    def fail(self, message: str, error: Exception | None = None) -> None:
        self.payload["message"], self.payload["message_level"] = message, "error"
        # the budget that would work, when the error knows it (the node offers it as the fix)
        for key, attr in (("min_budget_bytes", "min_budget_bytes"), ("need_bytes", "need_bytes")):
            v = getattr(error, attr, None)
            if isinstance(v, int) and v > 0:
                self.payload[key] = v
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
        self._patches: "weakref.WeakKeyDictionary[Engine, object]" = weakref.WeakKeyDictionary()
        self._resolved: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # budget taken at first run
        self.free_memory = None  # the host's answer to "how much could you free", where it has one
        self.in_run = False      # between the host's ON_PRE_RUN and ON_CLEANUP (a sampling run)
        self.teardown_pending = False  # the host tore the model down during a forward: release after it

    def on_model_patcher_clone(self):
        return self

    def engine(self, module: torch.nn.Module, device, keep_buffers: bool | None = None) -> Engine:
        """The engine for ``module`` on ``device``; ``keep_buffers`` (when given) says whether it
        holds device buffers between calls until ``release``."""
        dev = torch.device(device)
        eng = self._engines.get(module)
        if eng is None or eng.executor.device != dev:
            cfg = EngineConfig(budget_bytes=self.settings.budget_bytes(dev, self.free_memory), device=str(dev),
                               prefetch=self.settings.prefetch, residency=self.settings.residency,
                               pinned=self.pinned, pin_memory=host_pinning())
            eng = Engine(module, cfg, on_plan=lambda e, plan, sig: self.report.set(self.kind, e, plan))
            eng.executor.alloc_context = host_allocation_pause()
            streams.attach(eng, dev)
            for w in eng.unitset.warnings:
                log.warning("VRAMCut %s: %s", self.kind, w)
            self._engines[module] = eng
        if keep_buffers is not None:
            eng.keep_buffers(keep_buffers)
        return eng

    @property
    def running(self) -> bool:
        return any(e.executor.running for e in self._engines.values())

    def begin_run(self, *_args, **_kw) -> None:
        """Start of a sampling run (ON_PRE_RUN): until its cleanup, a model planned all resident
        keeps its weights swapped in between steps (no hooks, no pointer swaps per step). Outside
        a run (a node calling the model directly) they go back after every call."""
        self.in_run = True

    def release(self, *_args, **_kw) -> None:
        """Give back every device buffer the engines hold (ComfyUI cannot see them)."""
        self.in_run = False
        for e in list(self._engines.values()):
            if not e.executor.running:
                e.keep_buffers(False)
                e.release()

    def before_teardown(self) -> bool:
        """The host is about to detach or unpatch the model (and move it to its offload device):
        the engines give their device copies back first, nothing copied back (the host masters
        are the truth), so the host's move finds every weight on the host. While a forward runs
        on the weights nothing is taken from under it: False, and the engines let go when it
        ends."""
        if self.running:
            self.teardown_pending = True
            return False
        self.release()
        return True

    def outside(self, path: str) -> None:
        """Say on the node (and once in the log) that a call path runs outside the budget."""
        msg = (f"{self.kind}: {path} runs outside VRAMCut's budget: ComfyUI streams this model's "
               "weights layer by layer itself (results are the same; memory and speed are ComfyUI's)")
        if self.report.payload.get("message") != msg:
            log.warning("VRAMCut: %s", msg)
        self.report.notice(msg)
        self.report.send()

    def finish(self, *_args, **_kw) -> None:
        """End of a run (ComfyUI's cleanup after sampling): release, and show on the node what
        the run did (forwards, bytes streamed, measured peak)."""
        self.release()
        for e in list(self._engines.values()):
            if e.last_plan is not None and e.stats.forwards and not e.executor.running:
                self.report.set(self.kind, e, e.last_plan)
                e.reset_stats()  # the next run reports its own

    def run(self, engine: Engine, fn, *args, sig=None, patcher=None, **kwargs):
        """Run through the engine, merging ``patcher``'s weight patches into each unit's device
        copy as it arrives. A budget that cannot hold this call is a plain error naming what does
        not fit and the smallest budget; it becomes an OOM error only where the host has a
        fallback that makes the call smaller (tiled VAE, smaller upscale tiles)."""
        if self.settings.budget_mode != "fixed" and engine not in self._resolved and not engine.executor.running:
            # "free VRAM minus reserve" is what is free when the model first runs (ComfyUI has
            # made room for it by then), not when the node ran
            self._resolved.add(engine)
            engine.set_budget(self.settings.budget_bytes(torch.device(engine.config.device), self.free_memory))
        merge = DeviceMerge.for_call(patcher, engine.module)
        key = merge.key if merge is not None else None
        if self._patches.get(engine, key) != key and not engine.executor.running:
            engine.release()  # held device copies were merged with other patches
        self._patches[engine] = key
        engine.executor.on_loaded = merge
        try:
            with merge.host_patches_off() if merge is not None else contextlib.nullcontext():
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
            self.report.fail(msg, e)
            if fallback:
                raise VRAMCutOOM(msg) from e
            raise VRAMCutError(msg) from e
        except torch.OutOfMemoryError as e:
            self.report.fail(str(e))
            raise
        finally:
            engine.executor.on_loaded = None
            if self.teardown_pending and not self.running:
                self.teardown_pending = False
                self.release()


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


def _string_to_seed(key: str) -> int:
    f = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed
    return f(key)


def mergeable_patch_keys(patcher) -> frozenset[str]:
    """Weight-patch keys (LoRA and the like) VRAMCut merges into the device copy of the unit.
    Where the host's merge can return the merged weight (newer hosts), every weight the executor
    holds as a plain tensor or takes apart (quantized: the host requantizes, its parts replace
    the device parts); on older hosts, plain weights with no host conversion. The rest keep the
    host's own per-forward patching."""
    keys = []
    returns = DeviceMerge.host_returns_weight(patcher)
    for key in getattr(patcher, "patches", {}):
        try:
            weight, set_func, convert_func = comfy.model_patcher.get_key_weight(patcher.model, key)
        except Exception:  # a key the model does not have: the host ignores it too
            continue
        plain = type(weight) in (torch.Tensor, torch.nn.Parameter)
        if returns and (plain or quant.parts(weight) is not None):
            keys.append(key)
        elif plain and set_func is None and convert_func is None:
            keys.append(key)
    return frozenset(keys)


class DeviceMerge:
    """The executor's ``on_loaded`` hook for one call: merges a patcher's weight patches into a
    unit's device copy, exactly as the host merges them when it loads a model fully on that
    device (same function where the host exposes it, same compute precision and rounding), so
    the host keeps one unpatched copy of each weight and nothing is merged on the CPU."""

    _prefixes: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
    _host_returns: dict[type, bool] = {}  # patcher class -> patch_weight_to_device(return_weight=...)

    def __init__(self, patcher, prefix: str, keys: frozenset[str]) -> None:
        self.patcher, self.prefix, self.keys = patcher, prefix, keys
        self.key = (id(patcher.patches), getattr(patcher, "patches_uuid", None), keys)
        self.host_merges = self.host_returns_weight(patcher)

    @classmethod
    def host_returns_weight(cls, patcher) -> bool:
        """Can the host's ``patch_weight_to_device`` return the merged weight (newer hosts)?"""
        t = type(patcher)
        if t not in cls._host_returns:
            cls._host_returns[t] = "return_weight" in inspect.signature(t.patch_weight_to_device).parameters
        return cls._host_returns[t]

    @contextlib.contextmanager
    def host_patches_off(self):
        """For the duration of a VRAMCut forward, the host's per-forward LoRA functions of the
        merged weights are out of the way (put back after, if the host did not replace them)."""
        fns = getattr(self.patcher, "_vramcut_host_fns", ())
        for m, attr, _full, kept in fns:
            setattr(m, attr, kept)
        try:
            yield
        finally:
            for m, attr, full, kept in fns:
                if getattr(m, attr, None) is kept:
                    setattr(m, attr, full)

    @classmethod
    def for_call(cls, patcher, module: torch.nn.Module) -> "DeviceMerge | None":
        keys = getattr(patcher, "_vramcut_merge_keys", None)
        if not keys:
            return None
        prefix = cls._prefixes.get(module)
        if prefix is None:
            prefix = next((n for n, m in patcher.model.named_modules() if m is module), "")
            cls._prefixes[module] = prefix = prefix + "." if prefix else ""
        return cls(patcher, prefix, keys)

    def __call__(self, unit) -> None:
        for ut in unit.tensors:
            key = next((k for k in (self.prefix + r.qualname for r in ut.refs) if k in self.keys), None)
            if key is None:
                continue
            live = ut.refs[0].get()  # the device copy the unit's modules read now
            if type(live) in (torch.Tensor, torch.nn.Parameter):
                live.data.copy_(self.merged(key, live.data))
                continue
            # a quantized weight: the host requantizes the merged weight; its parts replace the
            # device copy's parts (same layout, recalculated scales)
            dst, src = quant.parts(live), quant.parts(self.merged(key, live))
            if dst is None or src is None or [(t.shape, t.dtype) for t in dst] != [(t.shape, t.dtype) for t in src]:
                raise VRAMCutError(f"cannot merge the weight patch of {key} into its quantized device copy")
            for d, s in zip(dst, src):
                d.copy_(s)

    def merged(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        p = self.patcher
        if self.host_merges:
            # the host's own merge; it reads the weight the unit's tensor points at (the device copy)
            return p.patch_weight_to_device(key, device_to=weight.device, return_weight=True)
        # hosts without return_weight (0.3.x): the same steps patch_weight_to_device takes there
        temp_dtype = mm.lora_compute_dtype(weight.device) if hasattr(mm, "lora_compute_dtype") else torch.float32
        temp = mm.cast_to_device(weight, weight.device, temp_dtype, copy=True)
        out = comfy.lora.calculate_weight(p.patches[key], temp, key)
        return comfy.float.stochastic_rounding(out, weight.dtype, seed=_string_to_seed(key))


def host_pinning() -> bool:
    """Whether the pack may page-lock host memory, within the host's own limit.

    Hosts that pin offloaded weights themselves (``comfy.model_management.MAX_PINNED_MEMORY``,
    newer releases) count what they pinned against a limit: the pack's own pins stay within
    what that limit leaves, and pin nothing where the host pins nothing (``--disable-pinned-
    memory``, or a device it does not pin for). Weights the host has already page-locked are
    copied from where they are, never registered again (the executor checks ``is_pinned``)."""
    from comfy.cli_args import args
    if getattr(args, "disable_pinned_memory", False):
        return False
    limit = getattr(mm, "MAX_PINNED_MEMORY", None)
    if limit is None:  # the host pins nothing itself (0.3.x): the executor's own cap applies
        return True
    if limit <= 0:
        return False
    executor_module.PINNED.room = lambda: int(mm.MAX_PINNED_MEMORY - getattr(mm, "TOTAL_PINNED_MEMORY", 0)
                                              - executor_module.PINNED.bytes)
    return True


def host_allocation_pause():
    """The host's context that keeps allocations out of its recorded allocation graphs (newer
    ComfyUI: ``comfy.model_prefetch.pause_malloc_graph``), or a no-op on hosts without them."""
    try:
        prefetch = importlib.import_module("comfy.model_prefetch")
    except ImportError:
        return contextlib.nullcontext
    return getattr(prefetch, "pause_malloc_graph", None) or contextlib.nullcontext


def state_of(patcher) -> PatchState | None:
    att = getattr(patcher, "attachments", None) or {}
    st = att.get(KEY)
    return st if isinstance(st, PatchState) else None


def _any_weight_on(module: torch.nn.Module, device) -> bool:
    dev = torch.device(device)
    return any(p.device == dev for p in module.parameters()) if dev.type != "cpu" else False


# What the dynamic-VRAM host (comfy-aimdo) hangs on a module it manages: its virtual weight
# range and signature, a block's range, a pending prefetch, a captured CUDA graph. While a
# VRAMCut patcher is loaded they are put aside, so the host's casts and prefetch queue see an
# ordinary low-VRAM module and never fault, prefetch or evict the weights VRAMCut streams.
DYNAMIC_MODULE_ATTRS = ("_v", "_v_signature", "_v_block", "_v_block_faulted", "_prefetch", "_comfy_graph")
_STASH = "_vramcut_dynamic_stash"


def _take_from_dynamic(model: torch.nn.Module) -> None:
    if _STASH in model.__dict__:
        return
    stash = {}
    for m in model.modules():
        attrs = {a: m.__dict__.pop(a) for a in DYNAMIC_MODULE_ATTRS if a in m.__dict__}
        if attrs:
            stash[m] = attrs
    model.__dict__[_STASH] = stash


def _give_back_to_dynamic(model: torch.nn.Module) -> None:
    stash = model.__dict__.pop(_STASH, None)
    for m, attrs in (stash or {}).items():
        for a, v in attrs.items():
            m.__dict__.setdefault(a, v)


def _host_patch_functions(patcher, keys: frozenset[str]) -> tuple:
    """For each module weight VRAMCut merges on the device: ``(module, attribute, the host's
    per-forward functions, the same without its low-VRAM patch)``. Inside a VRAMCut forward the
    second list is in place (the host would apply the same LoRA a second time); outside one the
    host's own low-VRAM path runs the module with the first, LoRA included."""
    out = []
    if not keys:
        return ()
    for n, m in patcher.model.named_modules():
        for param in ("weight", "bias"):
            fns = getattr(m, f"{param}_function", None)
            if fns and f"{n}.{param}" in keys:
                kept = [f for f in fns if not isinstance(f, comfy.model_patcher.LowVramPatch)]
                if len(kept) != len(fns):
                    out.append((m, f"{param}_function", fns, kept))
    return tuple(out)


class VRAMCutModelPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher that never puts weights on the GPU itself: every load is a low-VRAM load
    with no weight budget, so the weights stay on the offload device for the executor to stream.
    Weight patches (LoRA) are not merged on the host: the executor merges them into each unit's
    device copy as it arrives, as a full load on that device would (one host copy of each
    weight). It tells ComfyUI it needs the budget, not the full model size, so other models are
    not evicted for nothing. It is a plain ``ModelPatcher`` (never the host's dynamic-VRAM
    patcher), so newer ComfyUI does not offload this model on its own."""

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        st = state_of(self)
        if st is not None and st.running:
            return 0  # the executor holds the weights right now: leave them where they are
        if self.model.model_loaded_weight_memory > 0 or _any_weight_on(self.model, device_to):
            # another clone of this model left weights on the GPU: put them back first, or
            # ComfyUI would treat the model as loaded and keep them there
            self.unpatch_model(self.offload_device, unpatch_weights=True)
        _take_from_dynamic(self.model)
        super().partially_load(device_to, extra_memory=1, force_patch_weights=False)
        return 0

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        # One byte of weight budget: every module is set up for per-forward casting, none moved,
        # and no weight is patched on the host (no backup copy, no CPU merge).
        if getattr(self, "backup", None):
            # weights the host patched at an earlier load of this patcher (see below): put the
            # originals back first, or this load would patch them a second time
            self.unpatch_model(self.offload_device, unpatch_weights=True)
        _take_from_dynamic(self.model)
        # The host's load skips a module it finds "already lowvramed" (prev_comfy_cast_weights
        # set): its weight patches would not be set up for this patcher. A full load with forced
        # casting leaves that mark too (a GGUF text encoder after its first full load), and another
        # clone's low-VRAM state is not this patcher's: start every module clean.
        for m in self.model.modules():
            if hasattr(m, "prev_comfy_cast_weights"):
                comfy.model_patcher.wipe_lowvram_weight(m)
        out = super().load(device_to, lowvram_model_memory=1, force_patch_weights=False,
                           full_load=False, **kwargs)
        # A loader pack's patcher may patch weights on the host during the load anyway
        # (ComfyUI-GGUF forces it; the host keeps a backup of each): merging those again on the
        # device would apply their LoRA twice.
        self._vramcut_merge_keys = mergeable_patch_keys(self) - frozenset(getattr(self, "backup", {}))
        self._vramcut_host_fns = _host_patch_functions(self, self._vramcut_merge_keys)
        return out

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        st = state_of(self)
        if unpatch_weights and st is not None and not st.before_teardown():
            device_to = None  # a forward runs on the engines' device copies: move nothing under it
        try:
            return super().unpatch_model(device_to, unpatch_weights=unpatch_weights)
        finally:
            if unpatch_weights:
                _give_back_to_dynamic(self.model)

    def detach(self, unpatch_all=True):
        st = state_of(self)
        if st is not None:
            st.before_teardown()  # (the host's unpatch_model inside does it too; idempotent)
        try:
            return super().detach(unpatch_all=unpatch_all)
        finally:
            _give_back_to_dynamic(self.model)  # the host loads another clone of this model next

    def patch_hooks(self, *args, **kwargs):
        st = state_of(self)
        if st is not None:
            streams.weights_changing(st)  # hook weights are written in place: engines copy again
        return super().patch_hooks(*args, **kwargs)

    def get_free_memory(self, device):
        # weights the engines hold between forwards are theirs to give back, not used memory:
        # the host batches cond and uncond by this figure
        base = getattr(super(), "get_free_memory", None)  # a patcher method in newer hosts only
        free = base(device) if base is not None else mm.get_free_memory(device)
        st = state_of(self)
        return free + (streams.held_bytes(st) if st is not None else 0)

    def clone(self, *args, **kwargs):
        n = super().clone(*args, **kwargs)
        # A loader pack's patcher may make its clones its own class again (ComfyUI-GGUF's
        # does): keep VRAMCut on top of it, as it was on the original.
        if not isinstance(n, VRAMCutModelPatcher) and state_of(n) is not None:
            n.__class__ = _patcher_class(type(n))
        return n

    def model_size(self):
        real = super().model_size()
        st = state_of(self) if hasattr(self, "attachments") else None
        if st is None or st.settings.budget_mode != "fixed":
            return real
        return min(real, max(1, int(st.settings.max_vram_gb * GIB)))


def is_dynamic(patcher) -> bool:
    f = getattr(patcher, "is_dynamic", None)
    return bool(callable(f) and f())


def _static_class(cls: type) -> type:
    """The nearest class in ``cls``'s MRO whose patchers are not dynamic-VRAM ones."""
    plain = getattr(comfy.model_patcher.ModelPatcher, "is_dynamic", None)
    for c in cls.__mro__:
        if issubclass(c, comfy.model_patcher.ModelPatcher) and getattr(c, "is_dynamic", None) is plain:
            return c
    return comfy.model_patcher.ModelPatcher


def to_vramcut_patcher(patcher, state: PatchState):
    """A clone of ``patcher`` as a VRAMCutModelPatcher carrying ``state``; the original is left
    as it is. A model the host manages with dynamic VRAM is cloned as it always is (sharing the
    module and its weights: no reload, no second host copy) and the clone becomes a plain
    patcher, which the host's dynamic loading, eviction and prefetch leave alone."""
    dynamic = is_dynamic(patcher)
    clone = patcher.clone()
    if not isinstance(clone, comfy.model_patcher.ModelPatcher):
        raise VRAMCutError(f"cannot patch a {type(clone).__name__}")
    cls = type(clone)
    if dynamic:
        cls = _static_class(cls)
        patchers = getattr(clone.model, "dynamic_patchers", None)
        if isinstance(patchers, set):
            patchers.discard(id(clone))  # the host counts its own patchers of this model
    clone.__class__ = _patcher_class(cls)
    if hasattr(patcher, "get_free_memory"):
        # what the host could give on the device, evictions included: asked of the patcher the
        # host made (on dynamic-VRAM hosts its answer counts what it would evict)
        ref = weakref.ref(patcher)
        state.free_memory = lambda device: (ref() or mm).get_free_memory(device)
    clone.attachments[KEY] = state
    for ctype, fn in ((CallbacksMP.ON_CLEANUP, state.finish), (CallbacksMP.ON_DETACH, state.release)):
        clone.remove_callbacks_with_key(ctype, KEY)
        clone.add_callback_with_key(ctype, KEY, fn)
    if hasattr(CallbacksMP, "ON_PRE_RUN"):  # paired with ON_CLEANUP by the host's try/finally
        clone.remove_callbacks_with_key(CallbacksMP.ON_PRE_RUN, KEY)
        clone.add_callback_with_key(CallbacksMP.ON_PRE_RUN, KEY, state.begin_run)
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
