"""What one Max VRAM node shows: ``NodeReport``, the payload (one entry per patched model, its
plan, its answer's cost and time, a refusal's smallest budget) sent live to the web extension as
plan events. The one rule: the payload carries the engine's figures as the engine gives them;
this module only names them for the user (the call's inputs, the time line) and never plans.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..vramcut_core import GIB, BudgetError, Engine, cost_to_json, host_to_device

if TYPE_CHECKING:
    from .state import Settings

log = logging.getLogger("vramcut")

EVENT = "vramcut.plan"     # server event the web extension listens to

__all__ = ["EVENT", "NodeReport", "inputs_text", "time_answer"]


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
        # a shape is connected: each model's refusal comes from its preview at that shape (the
        # weights alone would refuse with a lower bound, and stop the node before the others)
        self.previewing = False
        self.deferred: dict[str, BudgetError] = {}

    def weights(self, kind: str, engine: Engine) -> None:
        """Show ``kind``'s plan from its weights alone. A budget too small for one block is
        refused here, unless the node previews the model next: the preview's refusal (the
        smallest budget at that shape) is the one shown, this one kept for where it cannot run."""
        try:
            plan = engine.weight_plan()
        except BudgetError as e:
            if not self.previewing:
                raise
            self.deferred[kind] = e
            return
        self.set(kind, engine, plan)

    def set(self, kind: str, engine: Engine, plan=None, traced_at: str | None = None) -> None:
        """Show ``plan`` (the engine's latest by default) as ``kind``'s entry; ``traced_at``: the
        plan is a preview's, traced at that shape (stage "traced", the label the node draws)."""
        d = engine.describe(plan)
        # the answer line's cost: measured after a run, estimated from this machine's bandwidth before
        d["plan"]["cost"] = cost_to_json(d["plan"], host_to_device(engine.device, max_bytes=engine.probe_room_bytes))
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
        if isinstance(d["plan"].get("tiers"), dict):  # under max_ram_gb: RAM / disk bytes, reads per call
            entry["tiers"] = d["plan"]["tiers"]
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
        if kind is not None and kind not in self._index and kind in self.deferred:
            # refused before any plan of it was drawn: an entry that is the refusal alone
            self._index[kind] = len(self.payload["models"])
            self.payload["models"].append({"kind": kind, "label": kind, "stage": "weights", "signature": None,
                                           "inputs": None, "warnings": [], "text": "", "verify": [],
                                           "plan": {"budget_bytes": self.payload["budget_bytes"]}})
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
