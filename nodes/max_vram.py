"""The Max VRAM nodes (ComfyUI V1 node classes)."""
from __future__ import annotations

import logging

from ..vramcut_core import BudgetError
from .state import MODES, NodeReport, Settings, VRAMCutError
from .patching import patch_clip, patch_clip_vision, patch_model, patch_upscale_model, patch_vae

log = logging.getLogger("vramcut")

_BUDGET_INPUTS = {
    "max_vram_gb": ("FLOAT", {
        "default": 6.0, "min": 0.0, "max": 1024.0, "step": 0.05, "round": 0.001,
        "tooltip": "VRAM budget in GiB for each connected model's weights and activations. "
                   "0 turns VRAMCut off (the inputs pass through unchanged). With 'free VRAM minus "
                   "reserve' a value above 0 caps the budget."}),
    "budget_mode": (list(MODES), {
        "default": "fixed",
        "tooltip": "fixed: use max_vram_gb. free VRAM minus reserve: when a model first runs, take "
                   "the GPU's free memory less reserve_gb."}),
    "reserve_gb": ("FLOAT", {
        "default": 1.0, "min": 0.0, "max": 1024.0, "step": 0.05, "round": 0.001,
        "tooltip": "With 'free VRAM minus reserve': GiB left free for other programs and ComfyUI."}),
    "prefetch": ("BOOLEAN", {
        "default": True,
        "tooltip": "Copy the next streamed block to the GPU while the current one computes "
                   "(two streaming slots). Off: one slot, copy then compute; smaller, slower."}),
    "residency": ("BOOLEAN", {
        "default": True,
        "tooltip": "Keep as many blocks on the GPU as fit the budget, so fewer bytes stream each "
                   "step. Off: every block streams (the least VRAM for weights)."}),
}


def _settings(kw) -> Settings:
    return Settings(kw["max_vram_gb"], kw["budget_mode"], kw["reserve_gb"], kw["prefetch"], kw["residency"]).validate()


def _apply(unique_id, kw, pairs):
    """Patch each (kind, value, fn) that is connected; returns the results and the ui payload."""
    report = NodeReport(unique_id, Settings(0.0))
    try:
        settings = _settings(kw)
    except VRAMCutError as e:
        report.fail(str(e))
        log.error("VRAMCut: %s", e)
        raise
    report = NodeReport(unique_id, settings)
    if not settings.enabled:
        report.notice("VRAMCut is off (max_vram_gb = 0): inputs pass through")
        return [v for _, v, _ in pairs], report.payload
    out = []
    for kind, value, fn in pairs:
        if value is None:
            out.append(None)
            continue
        try:
            out.append(fn(value, settings, report))
        except (BudgetError, VRAMCutError) as e:
            msg = f"{kind}: {e}"
            report.fail(msg, e)
            log.error("VRAMCut: %s", msg)
            raise VRAMCutError(msg) from e
    if all(v is None for _, v, _ in pairs):
        report.notice("connect a model to see its plan")
    report.send()
    return out, report.payload


class VRAMCutMaxVRAM:
    DESCRIPTION = ("Run MODEL, CLIP and VAE under one VRAM budget: each model's forward is cut at "
                   "block boundaries, as many blocks stay on the GPU as fit, the rest stream in while "
                   "the previous block computes. The plan is drawn on the node and updates when "
                   "sampling, encoding or decoding measures the real shapes. Results equal the "
                   "unpatched model's.")
    CATEGORY = "VRAMCut"
    FUNCTION = "apply"
    OUTPUT_NODE = True
    RETURN_TYPES = ("MODEL", "CLIP", "VAE")
    RETURN_NAMES = ("model", "clip", "vae")
    OUTPUT_TOOLTIPS = ("the patched MODEL (None when not connected)",
                       "the patched CLIP (None when not connected)",
                       "the patched VAE (None when not connected)")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": dict(_BUDGET_INPUTS),
            "optional": {
                "model": ("MODEL", {"tooltip": "diffusion model to run under the budget"}),
                "clip": ("CLIP", {"tooltip": "text encoder(s) to run under the budget"}),
                "vae": ("VAE", {"tooltip": "VAE to run under the budget (decode and encode)"}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def apply(self, max_vram_gb, budget_mode, reserve_gb, prefetch, residency,
              model=None, clip=None, vae=None, unique_id=None):
        kw = dict(max_vram_gb=max_vram_gb, budget_mode=budget_mode, reserve_gb=reserve_gb,
                  prefetch=prefetch, residency=residency)
        out, payload = _apply(unique_id, kw, [("MODEL", model, patch_model), ("CLIP", clip, patch_clip),
                                              ("VAE", vae, patch_vae)])
        return {"ui": {"vramcut": [payload]}, "result": tuple(out)}


class VRAMCutMaxVRAMExtras:
    DESCRIPTION = ("Max VRAM for upscale models and CLIP vision encoders: the same block-level "
                   "budgeted execution as the Max VRAM node.")
    CATEGORY = "VRAMCut"
    FUNCTION = "apply"
    OUTPUT_NODE = True
    RETURN_TYPES = ("UPSCALE_MODEL", "CLIP_VISION")
    RETURN_NAMES = ("upscale_model", "clip_vision")
    OUTPUT_TOOLTIPS = ("the patched upscale model (None when not connected)",
                       "the patched CLIP vision model (None when not connected)")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": dict(_BUDGET_INPUTS),
            "optional": {
                "upscale_model": ("UPSCALE_MODEL", {"tooltip": "ESRGAN-family upscale model"}),
                "clip_vision": ("CLIP_VISION", {"tooltip": "CLIP vision encoder"}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def apply(self, max_vram_gb, budget_mode, reserve_gb, prefetch, residency,
              upscale_model=None, clip_vision=None, unique_id=None):
        kw = dict(max_vram_gb=max_vram_gb, budget_mode=budget_mode, reserve_gb=reserve_gb,
                  prefetch=prefetch, residency=residency)
        out, payload = _apply(unique_id, kw, [("UPSCALE_MODEL", upscale_model, patch_upscale_model),
                                              ("CLIP_VISION", clip_vision, patch_clip_vision)])
        return {"ui": {"vramcut": [payload]}, "result": tuple(out)}


NODE_CLASS_MAPPINGS = {
    "VRAMCutMaxVRAM": VRAMCutMaxVRAM,
    "VRAMCutMaxVRAMExtras": VRAMCutMaxVRAMExtras,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "VRAMCutMaxVRAM": "Max VRAM (VRAMCut)",
    "VRAMCutMaxVRAMExtras": "Max VRAM for upscale / CLIP vision (VRAMCut)",
}
