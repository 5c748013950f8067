"""The shared state of one Max VRAM node's patches: the settings and the budget they give, the
payload the node shows (live plan events), and ``PatchState``, shared by a patched object and
all its clones, which owns one engine per module it runs and turns budget errors into the
node's message. The one rule: a budget that cannot hold a call is a clear error naming what
does not fit (an out-of-memory error only where the host has a smaller fallback). May call the
engine's public face, ``lora`` (device merges), ``gpu`` (the host's own GPU use) and ``compiler``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import weakref

import torch

import comfy.model_management as mm

from ..vramcut_core import (GIB, BudgetError, Engine, EngineConfig, cost_to_json, gib_text, host_to_device,
                            signature)
from .compiler import compiler_off
from .devices import Devices, device_name
from .errors import VRAMCutError, VRAMCutOOM
from .gpu import host_hooks, may_page_lock
from .lora import DeviceMerge

log = logging.getLogger("vramcut")

KEY = "vramcut"            # wrapper / callback / attachment key
EVENT = "vramcut.plan"     # server event the web extension listens to
MODES = ("fixed", "free VRAM minus reserve")

__all__ = ["KEY", "EVENT", "MODES", "VRAMCutError", "VRAMCutOOM", "Settings", "NodeReport", "PatchState", "Previewed",
           "inputs_text", "state_of"]


@dataclasses.dataclass(frozen=True)
class Settings:
    max_vram_gb: float
    budget_mode: str = "fixed"
    reserve_gb: float = 1.0
    prefetch: bool = True
    residency: bool = True
    devices: Devices | None = None  # the Devices node's budgets, one per device; None: max_vram_gb's

    def validate(self) -> "Settings":
        for name in ("max_vram_gb", "reserve_gb"):
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
                raise VRAMCutError(f"free VRAM {free / GIB:.3f} GiB minus reserve {self.reserve_gb:.3f} GiB leaves no budget")
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


def _budget_figures(error: Exception | None) -> dict:
    """The budget that would work, where the error knows it (the node offers it as the fix):
    ``min_budget_bytes`` (the smallest budget, or a lower bound: ``min_budget_exact``) and
    ``need_bytes`` (what one unit alone needs)."""
    out = {}
    if getattr(error, "device_budgets", None):   # with devices the fix is each device's budget
        return {"device_budgets": [list(p) for p in error.device_budgets], "min_budget_exact": error.exact}
    for key in ("min_budget_bytes", "need_bytes"):
        v = getattr(error, key, None)
        if isinstance(v, int) and v > 0:
            out[key] = v
    if "min_budget_bytes" in out:
        out["min_budget_exact"] = bool(getattr(error, "exact", False))
    return out


def _size(shape: tuple) -> str:
    """The spatial size of a latent or an image (the last two dimensions): "64×64"."""
    return "×".join(str(s) for s in shape[-2:])


def inputs_text(kind: str, sig: tuple) -> str | None:
    """The call's inputs as a user knows them ("latent 64×64, batch 2 · text 77 tokens · 20
    steps"), from the engine's signature (tensor paths, shapes, dtypes): the adapter knows which
    argument of each model's call is which; the engine's own description stays generic. None
    when nothing is recognised."""
    by = {p: shape for p, shape, _ in sig}
    parts = []
    if kind == "CLIP":
        n = max((shape[1] for p, shape, _ in sig if p.startswith("tokens") and len(shape) == 2), default=None)
        return f"text {n} tokens" if n else None
    x = by.get("arg0") or by.get("x") or by.get("samples")
    if x is not None and len(x) >= 3:
        # a VAE decodes a latent and encodes an image (three channels)
        what = {"MODEL": "latent", "VAE": "image" if x[1] == 3 else "latent"}.get(kind, "image")
        frames = f", {x[2]} frames" if len(x) == 5 else ""
        parts.append(f"{what} {_size(x)}{frames}, batch {x[0]}")
    if kind == "MODEL":
        ctx = by.get("c_crossattn") or by.get("context") or by.get("arg3") or by.get("arg2")
        if ctx is not None and len(ctx) == 3:
            parts.append(f"text {ctx[1]} tokens")
        sigmas = next((shape for p, shape, _ in sig if p.endswith("sample_sigmas")), None)
        if sigmas and sigmas[0] > 1:
            parts.append(f"{sigmas[0] - 1} steps")
    return " · ".join(parts) or None


class NodeReport:
    """The payload one Max VRAM node shows: one entry per patched model, updated live."""

    def __init__(self, node_id: str | None, settings: Settings) -> None:
        self.node_id = node_id
        self.payload: dict = {"budget_bytes": int(settings.max_vram_gb * GIB) if settings.budget_mode == "fixed" else None,
                              "enabled": settings.enabled, "message": None, "message_level": None,
                              "models": []}
        if settings.devices is not None:  # the header names each device's budget (only with devices)
            self.payload["devices"] = settings.devices.to_json()
        self._index: dict[str, int] = {}

    def set(self, kind: str, engine: Engine, plan=None, traced_at: str | None = None) -> None:
        """Show ``plan`` (the engine's latest by default) as ``kind``'s entry; ``traced_at``: the
        plan is a preview's, traced at that shape (stage "traced", the label the node draws)."""
        d = engine.describe(plan)
        # the answer line's cost: measured after a run, estimated from this machine's bandwidth before
        d["plan"]["cost"] = cost_to_json(d["plan"], host_to_device(engine.device))
        _per_device_answer(d["plan"])
        sig = engine.last_signature if d["signature"] else None
        entry = {"kind": kind, "label": f"{kind} · {d['label']}", "stage": d["stage"],
                 "signature": d["signature"], "inputs": inputs_text(kind, sig) if sig else None,
                 "warnings": d["warnings"], "text": d["text"], "plan": d["plan"],
                 "verify": d.get("verify") or []}
        if traced_at is not None:
            entry.update(stage="traced", traced_at=traced_at)
        t = time_answer(d["plan"].get("time"))
        if t is not None:
            entry["time"] = t
        if isinstance(d["plan"].get("refit"), dict):
            entry["refit"] = d["plan"]["refit"]
        if kind in self._index:
            self.payload["models"][self._index[kind]] = entry
        else:
            self._index[kind] = len(self.payload["models"])
            self.payload["models"].append(entry)
        self.payload["budget_bytes"] = engine.config.budget_bytes
        self.send()

    def fail(self, message: str, error: Exception | None = None, kind: str | None = None) -> None:
        """The node's state becomes the error; ``kind``: the model whose call was refused (its
        entry is marked ``refused`` and carries its own smallest budget, so the node does not show
        the plan drawn before the run). With several refused models the node's message is each
        one's, and its figure the largest: each model gets the whole budget in turn, so that one
        number makes every connected model fit."""
        figures = _budget_figures(error)
        entry = self.payload["models"][self._index[kind]] if kind in self._index else None
        if entry is None:
            self.payload["message"], self.payload["message_level"] = message, "error"
            self.payload.update(figures)
            self.send()
            return
        for key in ("min_budget_bytes", "need_bytes", "min_budget_exact", "device_budgets"):
            entry.pop(key, None)
        entry.update(refused=True, message=message, **figures)
        refused = [m for m in self.payload["models"] if m.get("refused")]
        self.payload["message"], self.payload["message_level"] = "; ".join(m["message"] for m in refused), "error"
        for key in ("min_budget_bytes", "need_bytes", "min_budget_exact", "device_budgets"):
            self.payload.pop(key, None)
        mins = [m["min_budget_bytes"] for m in refused if "min_budget_bytes" in m]
        needs = [m["need_bytes"] for m in refused if "min_budget_bytes" not in m and "need_bytes" in m]
        if mins:
            self.payload["min_budget_bytes"] = max(mins)
            # the smallest for all only when each one's is the smallest for it
            self.payload["min_budget_exact"] = not needs and all(m.get("min_budget_exact") for m in refused)
        if needs:
            self.payload["need_bytes"] = max(needs)
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


def _per_device_answer(plan: dict) -> None:
    """With the plan placed across devices (its "devices", contract of the plan JSON): the answer
    line's verdict is every device within its own budget, and the hops per call join it."""
    devices = plan.get("devices")
    if not isinstance(devices, list) or not devices:
        return
    cost = plan.setdefault("cost", {})
    cost["fits"] = all(int(d.get("peak_bytes") or 0) <= int(d.get("budget_bytes") or 0) for d in devices)
    cost["devices"] = len(devices)
    cost["hops_per_call"] = plan.get("hops_per_call")
    cost["hop_bytes_per_call"] = plan.get("hop_bytes_per_call")


def time_answer(time: dict | None) -> dict | None:
    """The node's time line from the plan's "time" (seconds per call): before a call, the time the
    plan is predicted to add over all-resident and the ratio; after one, the measured time and
    the prediction's error ((predicted - measured) / measured). None where nothing was predicted."""
    if not isinstance(time, dict):
        return None
    pred, res = time.get("predicted_s"), time.get("resident_s")
    if not isinstance(pred, (int, float)) or not isinstance(res, (int, float)):
        return None
    out = {"predicted_s": float(pred), "resident_s": float(res), "added_s": max(0.0, float(pred) - float(res)),
           "ratio": float(pred) / float(res) if res > 0 else None, "source": time.get("source"),
           "measured_s": None, "error": None}
    meas = time.get("measured_s")
    if isinstance(meas, (int, float)) and meas > 0:
        out["measured_s"] = float(meas)
        err = time.get("error")
        out["error"] = float(err) if isinstance(err, (int, float)) else (float(pred) - float(meas)) / float(meas)
    return out


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
                               keep_resident=self.keep_resident, pin_memory=may_page_lock(), keep_file_backed=self.fast_disk)
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
        """End of a run (ComfyUI's cleanup after sampling): release, and show on the node what
        the run did (forwards, bytes streamed, measured peak)."""
        self.release()
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
                plan = engine.preview_as(signature(args, kwargs) if sig is None else sig, fn, *args, **kwargs)
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
                msg = (f"VRAMCut: {e}. ComfyUI's tiled fallback would run this VAE call at the same size "
                       f"(the input is no larger than one tile), so it cannot help: raise max_vram_gb")
            else:
                msg = f"VRAMCut: {e}"
            self.report.fail(msg, e, kind=self.kind)
            # the error panel leads with the fix, the number the node shows
            lead = msg
            to = "to" if getattr(e, "exact", False) else "to at least"  # "at least": a lower bound only
            if getattr(e, "device_budgets", None):   # the devices replace max_vram_gb: name each one
                lead = f"Devices: set {to} {', '.join(f'{d}={gib_text(b)}' for d, b in e.device_budgets)}. {msg}"
            elif getattr(e, "min_budget_bytes", None) and self.settings.devices is None:
                lead = f"Max VRAM: set max_vram_gb {to} {gib_text(e.min_budget_bytes)}. {msg}"
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
