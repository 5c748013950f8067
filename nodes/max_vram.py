"""The Max VRAM nodes and the Preview shape node, in ComfyUI's V3 node API (``comfy_api.latest``).

The one rule: what a saved workflow stores is the node's contract. Node ids, input names, their
order (``widgets_values`` is positional), types, defaults and the output order stay as they were
in the V1 classes (inputs added since, like ``preview_shape``, are optional and come last), and
the ``ui`` payload key the web extension reads stays ``"vramcut"``.
"""
from __future__ import annotations

import logging

from comfy_api.latest import ComfyExtension, io

from ..vramcut_core import BudgetError, TraceUnavailable
from .report import NodeReport
from .state import MODES, Settings, VRAMCutError
from .patching import patch_clip, patch_clip_vision, patch_model, patch_upscale_model, patch_vae
from .preview import SHAPE_TYPE, CannotPreview, Shape, preview, traced_at
from .devices import DEVICES_TYPE, Devices, default_text

ShapeIO = io.Custom(SHAPE_TYPE)
DevicesIO = io.Custom(DEVICES_TYPE)

log = logging.getLogger("vramcut")

UI_KEY = "vramcut"  # the key web/vramcut.js reads in the node's executed output


def _budget_inputs() -> list:
    """The five widgets both nodes share, in the order saved workflows store their values
    (``widgets_values``): the order and the names are the workflow format, never change them."""
    return [
        io.Float.Input(
            "max_vram_gb", default=6.0, min=0.0, max=1024.0, step=0.05, round=0.001,
            tooltip="VRAM budget in GiB for each connected model's weights and activations. "
                    "0 turns VRAMCut off in both modes (the inputs pass through unchanged). With 'free "
                    "VRAM minus reserve' it caps the budget."),
        io.Combo.Input(
            "budget_mode", options=list(MODES), default="fixed",
            tooltip="fixed: use max_vram_gb. free VRAM minus reserve: when a model first runs, take "
                    "the GPU's free memory less reserve_gb, at most max_vram_gb."),
        io.Float.Input(
            "reserve_gb", default=1.0, min=0.0, max=1024.0, step=0.05, round=0.001,
            tooltip="With 'free VRAM minus reserve': GiB left free for other programs and ComfyUI."),
        io.Boolean.Input(
            "prefetch", default=True,
            tooltip="Copy the next streamed block to the GPU while the current one computes "
                    "(two streaming slots). Off: one slot, copy then compute; smaller, slower."),
        io.Boolean.Input(
            "residency", default=True,
            tooltip="Keep as many blocks on the GPU as fit the budget, so fewer bytes stream each "
                    "step. Off: every block streams (the least VRAM for weights)."),
    ]


def _settings(kw) -> Settings:
    return Settings(kw["max_vram_gb"], kw["budget_mode"], kw["reserve_gb"], kw["prefetch"], kw["residency"],
                    devices=kw.get("devices"), max_ram_gb=kw.get("max_ram_gb") or 0.0).validate()


def _preview_input() -> list:
    """The optional inputs after the model inputs (appended last, in the order they were added:
    saved workflows keep their values where they were)."""
    return [ShapeIO.Input("preview_shape", optional=True,
                          tooltip="Connect 'Preview shape (VRAMCut)' to see, before anything runs, the plan "
                                  "with activations at that width, height, frames and batch (a dry run "
                                  "on fake tensors: no weight moves). Without it the node shows the "
                                  "weights-only estimate until the first real run."),
            DevicesIO.Input("devices", optional=True,
                            tooltip="Connect 'Devices (VRAMCut)' to place each model's blocks across several "
                                    "GPUs, each under its own budget (they replace max_vram_gb and budget_mode; "
                                    "0 still turns VRAMCut off). Without it: one GPU, max_vram_gb's budget."),
            io.Float.Input("max_ram_gb", default=0.0, min=0.0, max=4096.0, step=0.5, round=0.001, optional=True,
                           tooltip="RAM budget in GiB for each connected model's weights in host memory. What "
                                   "does not fit is read from its file on disk at every step (the checkpoint "
                                   "itself where it holds the weights as loaded, else a cache file VRAMCut "
                                   "writes once). 0: no RAM budget (the weights that stream stay in RAM).")]


def _preview(kind: str, patched, shape: Shape, report: NodeReport) -> str | None:
    """Put the traced plan of ``patched`` at ``shape`` on the node; what went wrong otherwise
    (the weights estimate stays drawn)."""
    at = traced_at(kind, shape)
    try:
        engine, plan = preview(kind, patched, shape)
    except (CannotPreview, TraceUnavailable) as e:
        refused = report.deferred.get(kind)
        if refused is not None:  # no preview to ask: the weights' refusal stands
            msg = f"{kind}: {refused}"
            log.warning("VRAMCut: %s", msg)
            report.fail(msg, refused, kind=kind)
            return None
        msg = f"{kind}: no plan preview at {at} ({e}); the plan shown is the weights estimate"
        log.warning("VRAMCut: %s", msg)
        return msg
    except BudgetError as e:
        msg = f"{kind} at {at}: {e}"
        log.warning("VRAMCut: %s", msg)
        report.fail(msg, e, kind=kind)
        return None
    report.set(kind, engine, plan, traced_at=at)
    return None


def _apply(unique_id, kw, pairs, shape: Shape | None = None):
    """Patch each (kind, value, fn) that is connected, and with a ``shape`` show each one's
    traced plan at it; returns the results and the ui payload."""
    report = NodeReport(unique_id, Settings(0.0))
    try:
        settings = _settings(kw)
    except VRAMCutError as e:
        report.fail(str(e))
        log.error("VRAMCut: %s", e)
        raise
    report = NodeReport(unique_id, settings)
    report.previewing = shape is not None
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
    elif shape is not None:
        notes = [_preview(kind, v, shape, report) for (kind, _, _), v in zip(pairs, out) if v is not None]
        if any(notes) and report.payload["message_level"] != "error":
            report.notice("; ".join(n for n in notes if n))
    report.send()
    return out, report.payload


def _schema(node_id: str, display_name: str, description: str, model_inputs: list, outputs: list) -> io.Schema:
    """Both nodes: the budget widgets first (saved workflows store their values in this order),
    then the model inputs, then the preview shape; an output node, so a plan preview runs with
    nothing downstream."""
    return io.Schema(node_id=node_id, display_name=display_name, category="VRAMCut", description=description,
                     inputs=_budget_inputs() + model_inputs + _preview_input(), outputs=outputs,
                     hidden=[io.Hidden.unique_id], is_output_node=True)


def _execute(node_cls, budget: dict, pairs, shape: Shape | None) -> io.NodeOutput:
    # ComfyUI runs a node through a clone of its class that holds the hidden inputs.
    hidden = getattr(node_cls, "hidden", None)
    out, payload = _apply(getattr(hidden, "unique_id", None), budget, pairs, shape)
    return io.NodeOutput(*out, ui={UI_KEY: [payload]})


MAX_VRAM_DESCRIPTION = (
    "Run MODEL, CLIP and VAE under one VRAM budget: each model's forward is cut at block boundaries, as many "
    "blocks stay on the GPU as fit, the rest stream in while the previous block computes. The plan is drawn on "
    "the node and updates when sampling, encoding or decoding measures the real shapes. Results are tested "
    "bit-equal to the unpatched model's on CPU and on a simulated GPU; VRAMCUT_VERIFY=1 checks them on yours.")

EXTRAS_DESCRIPTION = ("Max VRAM for upscale models and CLIP vision encoders: the same block-level budgeted "
                      "execution as the Max VRAM node.")


def _sockets(table) -> tuple[list, list]:
    """The model inputs and the patched outputs of a Max VRAM node, from (type, name, what the
    input takes, what the output gives) rows."""
    return ([t.Input(name, optional=True, tooltip=takes) for t, name, takes, _ in table],
            [t.Output(display_name=name, tooltip=f"{gives} (None when not connected)") for t, name, _, gives in table])


class VRAMCutMaxVRAM(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return _schema("VRAMCutMaxVRAM", "Max VRAM (VRAMCut)", MAX_VRAM_DESCRIPTION, *_sockets((
            (io.Model, "model", "diffusion model to run under the budget", "the patched MODEL"),
            (io.Clip, "clip", "text encoder(s) to run under the budget", "the patched CLIP"),
            (io.Vae, "vae", "VAE to run under the budget (decode and encode)", "the patched VAE"))))

    @classmethod
    def execute(cls, max_vram_gb, budget_mode, reserve_gb, prefetch, residency,
                model=None, clip=None, vae=None, preview_shape=None, devices=None, max_ram_gb=0.0) -> io.NodeOutput:
        budget = dict(max_vram_gb=max_vram_gb, budget_mode=budget_mode, reserve_gb=reserve_gb,
                      prefetch=prefetch, residency=residency, devices=devices, max_ram_gb=max_ram_gb)
        return _execute(cls, budget, [("MODEL", model, patch_model), ("CLIP", clip, patch_clip),
                                      ("VAE", vae, patch_vae)], preview_shape)


class VRAMCutMaxVRAMExtras(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return _schema("VRAMCutMaxVRAMExtras", "Max VRAM for upscale / CLIP vision (VRAMCut)", EXTRAS_DESCRIPTION,
                       *_sockets(((io.UpscaleModel, "upscale_model", "ESRGAN-family upscale model",
                                   "the patched upscale model"),
                                  (io.ClipVision, "clip_vision", "CLIP vision encoder", "the patched CLIP vision model"))))

    @classmethod
    def execute(cls, max_vram_gb, budget_mode, reserve_gb, prefetch, residency,
                upscale_model=None, clip_vision=None, preview_shape=None, devices=None,
                max_ram_gb=0.0) -> io.NodeOutput:
        budget = dict(max_vram_gb=max_vram_gb, budget_mode=budget_mode, reserve_gb=reserve_gb,
                      prefetch=prefetch, residency=residency, devices=devices, max_ram_gb=max_ram_gb)
        return _execute(cls, budget, [("UPSCALE_MODEL", upscale_model, patch_upscale_model),
                                      ("CLIP_VISION", clip_vision, patch_clip_vision)], preview_shape)


def _helper_schema(node_id: str, display_name: str, description: str, inputs: list, output) -> io.Schema:
    """The helper nodes (Preview shape, Devices): one output that feeds a Max VRAM node."""
    return io.Schema(node_id=node_id, display_name=display_name, category="VRAMCut", description=description,
                     inputs=inputs, outputs=[output])


SHAPE_DESCRIPTION = (
    "The shape a Max VRAM node previews its plan at: connect it to 'preview_shape' and the node draws, without "
    "running anything, the plan with activations for this width, height, frames and batch, marked 'traced'. A "
    "MODEL is previewed with the positive and negative prompt batched (CFG above 1); turn cfg_batch off for CFG 1 "
    "or a distilled model.")

DEVICES_DESCRIPTION = (
    "The GPUs a Max VRAM node may place a model's blocks on, each with its own budget: connect it to 'devices'. "
    "Runs of blocks go to each GPU in the order given; only the activations crossing a cut move between GPUs. Its "
    "budgets replace the Max VRAM node's max_vram_gb (0 there still turns VRAMCut off) and budget_mode.")


class VRAMCutPreviewShape(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return _helper_schema(
            "VRAMCutPreviewShape", "Preview shape (VRAMCut)", SHAPE_DESCRIPTION, [
                io.Int.Input("width", default=1024, min=8, max=16384, step=8,
                             tooltip="image or video width in pixels, as in the empty latent node"),
                io.Int.Input("height", default=1024, min=8, max=16384, step=8,
                             tooltip="image or video height in pixels, as in the empty latent node"),
                io.Int.Input("frames", default=1, min=1, max=10000,
                             tooltip="video frames (pixel frames, as in the empty video latent node); "
                                     "1 for image models"),
                io.Int.Input("batch", default=1, min=1, max=4096,
                             tooltip="the latent batch size, as in the empty latent node"),
                # appended last (widgets_values are positional: a workflow saved before it loads
                # with its four values where they were, and this at its default)
                io.Boolean.Input("cfg_batch", default=True, optional=True,
                                 tooltip="On (CFG above 1): the MODEL is previewed as the sampler runs it, "
                                         "the positive and the negative prompt together in one call of twice "
                                         "the batch. Off for CFG 1 and distilled models (one prompt per call). "
                                         "The CLIP and the VAE are previewed at the batch alone."),
            ],
            ShapeIO.Output(display_name="preview_shape", tooltip="connect to a Max VRAM node's preview_shape"))

    @classmethod
    def execute(cls, width, height, frames, batch, cfg_batch=True) -> io.NodeOutput:
        try:
            return io.NodeOutput(Shape(width, height, frames, batch, cfg_batch).validate())
        except ValueError as e:
            raise VRAMCutError(str(e)) from None


class VRAMCutDevices(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return _helper_schema(
            "VRAMCutDevices", "Devices (VRAMCut)", DEVICES_DESCRIPTION, [
                io.String.Input("devices", default=default_text(),
                                tooltip="DEVICE=GIB, comma-separated, e.g. cuda:0=10, cuda:1=6 (by default this "
                                        "machine's devices). A budget may be 'free': the device's free VRAM less "
                                        "reserve_gb; a budget alone ('free', '8') is the main device's. ComfyUI's "
                                        "main GPU must be in the list (inputs and outputs live there)."),
                io.Float.Input("reserve_gb", default=1.0, min=0.0, max=1024.0, step=0.05, round=0.001,
                               tooltip="GiB left free on each device whose budget is 'free', for other "
                                       "programs and ComfyUI."),
            ],
            DevicesIO.Output(display_name="devices", tooltip="connect to a Max VRAM node's devices"))

    @classmethod
    def execute(cls, devices, reserve_gb) -> io.NodeOutput:
        # Checked here, before any model loads, and said on this node (its ui); the Max VRAM node
        # it feeds checks again and refuses with the same message on its own plan.
        out = Devices(devices, reserve_gb)
        try:
            out.validate()
        except VRAMCutError as e:
            log.error("VRAMCut: %s", e)
            return io.NodeOutput(out, ui={UI_KEY: [{"message": str(e)}]})
        return io.NodeOutput(out, ui={UI_KEY: [{"message": None, "devices": out.to_json()}]})


NODES = [VRAMCutMaxVRAM, VRAMCutMaxVRAMExtras, VRAMCutPreviewShape, VRAMCutDevices]


class VRAMCutExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> VRAMCutExtension:
    """ComfyUI's V3 entry point: the pack's nodes, registered under their schema ``node_id``."""
    return VRAMCutExtension()
