"""The plan preview: the activation-aware plan of a patched model at a shape the user picks,
from the engine's dry run alone (no weight copied, no real forward).

Owns the ``Shape`` and the inputs each kind of model takes at it, built from what the host
object knows: a MODEL's latent from its latent format (channels, spatial and temporal
compression), a timestep, and the conditioning its family expects (context width from the model
config, the token count the family's text encoder pads to) turned into the model's keyword
arguments by the host's own ``extra_conds``; a VAE decode at the latent of that shape; a CLIP at
its tokenized empty prompt. Each call goes through the same patched path a real call takes, with
the patch state in preview mode (``PatchState.previewing``): the engine is asked for the plan
(``Engine.preview_as``) where it would run, so the dry run's profile is cached under the very
signature the real call has. May call ComfyUI's samplers and conds, ``state`` and the engine.

The one rule: a preview leaves nothing that changes a later run but that cached profile; where
the inputs cannot be built or the dry run cannot run, the node says so and keeps the weights
estimate.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from ..vramcut_core import BudgetError, TraceUnavailable
from .patching import _wrapped
from .state import Previewed, state_of

SHAPE_TYPE = "VRAMCUT_SHAPE"  # the socket type between the shape node and the Max VRAM nodes


class CannotPreview(Exception):
    """The inputs of this model's call cannot be built at the shape (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    width: int
    height: int
    frames: int = 1
    batch: int = 1
    # With CFG above 1 the sampler runs the positive and the negative prompt as one call of twice
    # the batch (it splits them only when memory is short): a MODEL is previewed so by default.
    # False: one prompt per call (CFG 1, distilled models).
    cfg_batch: bool = True

    def validate(self) -> "Shape":
        for name in ("width", "height", "frames", "batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"preview shape: {name} must be a whole number of at least 1, got {v!r}")
        if not isinstance(self.cfg_batch, bool):
            raise ValueError(f"preview shape: cfg_batch must be true or false, got {self.cfg_batch!r}")
        return self

    @property
    def model_batch(self) -> int:
        """The batch of one diffusion-model call at this shape (cond and uncond together)."""
        return self.batch * (2 if self.cfg_batch else 1)

    @property
    def label(self) -> str:
        frames = f"×{self.frames} frames" if self.frames > 1 else ""
        return f"{self.width}×{self.height}{frames}, batch {self.batch}"


# The conditioning a family's sampler passes, per host model class (exact class names: a family
# is listed once its inputs are built and checked against a real call in the tests). ``context``
# reads the text embedding's width from the model config or the module, ``tokens`` is what the
# family's text encoder pads an empty prompt to (CLIP 77; Flux's T5 256; SD3: CLIP 77 + T5 77;
# Wan: UMT5's 512; Qwen-Image: 256, a long prompt), ``pooled`` the pooled vector's width where the family reads one.
@dataclasses.dataclass(frozen=True)
class _Conditioning:
    tokens: int
    context: Callable[[dict, torch.nn.Module], int]  # (unet_config, diffusion model) -> text width
    pooled: Callable[[dict, torch.nn.Module], int] | None = None


_FAMILIES = {
    "BaseModel": _Conditioning(77, lambda cfg, dm: cfg["context_dim"]),  # SD 1.x / 2.x
    # SDXL's label embedding is the pooled CLIP-G vector and six 256-wide size embeddings
    "SDXL": _Conditioning(77, lambda cfg, dm: cfg["context_dim"], lambda cfg, dm: cfg["adm_in_channels"] - 6 * 256),
    "Flux": _Conditioning(256, lambda cfg, dm: cfg["context_in_dim"], lambda cfg, dm: cfg["vec_in_dim"]),
    "SD3": _Conditioning(
        154, lambda cfg, dm: cfg["context_embedder_config"]["params"]["in_features"],
        lambda cfg, dm: cfg["adm_in_channels"]),
    "WAN21": _Conditioning(512, lambda cfg, dm: dm.text_embedding[0].in_features),
    # Qwen-Image's Qwen2.5-VL does not pad: 256 tokens stand for a long prompt
    "QwenImage": _Conditioning(256, lambda cfg, dm: dm.txt_in.in_features),
    # HunyuanVideo: LLaVA-Llama-3 (1.0) or Qwen2.5-VL (1.5) text, 256 tokens; 1.0 reads a pooled
    # CLIP-L vector, 1.5 none
    "HunyuanVideo": _Conditioning(256, lambda cfg, dm: dm.params.context_in_dim, lambda cfg, dm: dm.params.vec_in_dim),
    "HunyuanVideo15": _Conditioning(256, lambda cfg, dm: dm.params.context_in_dim,
                                    lambda cfg, dm: dm.params.vec_in_dim or 0),
}

# Temporal compression of 3-D latents on hosts whose latent formats do not say (ComfyUI 0.3.x).
_TEMPORAL = {"Wan21": 4, "Wan22": 4, "HunyuanVideo": 4, "Mochi": 6, "LTXV": 8}


def _latent(fmt, shape: Shape, channels: int | None = None) -> tuple[int, ...]:
    spatial = getattr(fmt, "spacial_downscale_ratio", 8)
    h, w = max(1, shape.height // spatial), max(1, shape.width // spatial)
    c = channels or fmt.latent_channels
    dims = getattr(fmt, "latent_dimensions", 2)
    if dims == 2:
        if shape.frames > 1:
            raise CannotPreview(f"an image model ({type(fmt).__name__} latents) takes no frames: set frames to 1")
        return (shape.batch, c, h, w)
    if dims == 3:
        t = getattr(fmt, "temporal_downscale_ratio", None) or _TEMPORAL.get(type(fmt).__name__)
        if t is None:
            raise CannotPreview(f"the temporal compression of {type(fmt).__name__} latents is not known")
        return (shape.batch, c, (shape.frames - 1) // t + 1, h, w)
    raise CannotPreview(f"{type(fmt).__name__} latents have {dims} dimension(s), not an image or a video")


def _model_call(patched, shape: Shape):
    """(fn, args, kwargs) of the sampler's call of the patched MODEL at ``shape``: the call the
    APPLY_MODEL wrapper sees, as ``comfy.samplers`` makes it for one positive prompt, or (with
    ``shape.cfg_batch``) for the negative and the positive batched together."""
    import comfy.patcher_extension as pe
    import comfy.samplers

    base = patched.model
    fam = _FAMILIES.get(type(base).__name__)
    if fam is None:
        raise CannotPreview(f"the preview cannot build the inputs of {type(base).__name__} models yet "
                            f"(it can for {', '.join(sorted(_FAMILIES))})")
    cfg, dm = base.model_config.unet_config, base.diffusion_model
    try:
        width = int(fam.context(cfg, dm))
        pooled = int(fam.pooled(cfg, dm)) if fam.pooled is not None else None
    except (KeyError, AttributeError, IndexError, TypeError) as e:
        raise CannotPreview(f"the text width of this {type(base).__name__} model is not in its config "
                            f"({e!r})") from None
    dev = patched.load_device
    prompts = 2 if shape.cfg_batch else 1  # cond and uncond in one call, as the sampler batches them
    shape = dataclasses.replace(shape, batch=shape.model_batch)
    x = torch.zeros(_latent(base.latent_format, shape), device=dev)
    cond = {"cross_attn": torch.zeros(1, fam.tokens, width), "model_conds": {}}
    # a text encode's conditioning always has the key; encoders without a pooled vector give None
    cond["pooled_output"] = torch.zeros(1, pooled) if pooled else None
    try:  # the host's own conditioning code, as the sampler runs it for one positive prompt
        (cond,) = comfy.samplers.encode_model_conds(base.extra_conds, [cond], x, dev, "positive",
                                                    latent_image=x, denoise_mask=None, seed=0)
        kwargs = {k: v.process_cond(batch_size=shape.batch, device=dev, area=None).concat([])
                  for k, v in cond["model_conds"].items()}
    except Exception as e:  # a family variant that wants more than a prompt (an image, a mask)
        raise CannotPreview(f"{type(base).__name__}'s conditioning could not be formed: "
                            f"{type(e).__name__}: {e}") from None
    t = torch.full((shape.batch,), float(base.model_sampling.sigma_max), device=dev)
    # the patcher's wrappers join the options as the sampler's ``prepare_model_patcher`` joins them
    options = pe.copy_nested_dicts(patched.model_options.get("transformer_options", {}))
    for name in ("wrappers", "callbacks"):
        pe.merge_nested_dicts(options.setdefault(name, {}), getattr(patched, name, {}), copy_dict1=False)
    # the sampler's sigmas are their own tensor beside the timestep it concatenates for the batch;
    # its step schedule ("sample_sigmas", steps + 1 floats) is not known here and stays out
    # (the sampler's sigmas are the latent batch's, not the batched call's)
    options.update(cond_or_uncond=[1, 0][-prompts:], uuids=[None] * prompts,
                   sigmas=t[: shape.batch // prompts].clone())
    return base.apply_model, (x, t), dict(kwargs, transformer_options=options)


def traced_at(kind: str, shape: Shape) -> str:
    """What a preview of ``kind`` was traced at, as the node says it."""
    if kind == "CLIP":  # a text encoder's call does not depend on the image shape
        return "an empty prompt"
    if kind == "MODEL":
        return f"{shape.label} (×2: cond + uncond)" if shape.cfg_batch else f"{shape.label} (CFG 1: one prompt)"
    return f"{shape.label} (decode)" if kind == "VAE" else shape.label


def preview(kind: str, patched, shape: Shape) -> tuple:
    """The traced plan of ``patched`` (a patched MODEL, CLIP or VAE) at ``shape``: (engine, plan).
    Raises ``CannotPreview`` (inputs not buildable), ``TraceUnavailable`` (the dry run could not
    run) or ``BudgetError`` (the budget cannot hold the call at this shape)."""
    state = state_of(patched if kind == "MODEL" else patched.patcher)
    state.previewing = True
    try:
        if kind == "MODEL":
            fn, args, kwargs = _model_call(patched, shape)
            fn(*args, **kwargs)
        elif kind == "VAE":
            _vae_decode(patched, shape)
        elif kind == "CLIP":
            _clip_encode(patched)
        else:
            raise CannotPreview(f"the preview does not build inputs for {kind}")
    except Previewed as p:
        return p.engine, p.plan
    finally:
        state.previewing = False
    raise CannotPreview(f"the {kind} call at this shape did not reach VRAMCut's engine")


def _vae_decode(vae, shape: Shape) -> None:
    fsm = vae.first_stage_model
    if getattr(fsm, "comfy_has_chunked_io", False):
        raise CannotPreview("this VAE decodes into a buffer the host allocates per call; not previewed")
    ratio = vae.downscale_ratio
    dim = getattr(vae, "latent_dim", 2)
    if isinstance(ratio, tuple):
        t_ratio, rh, rw = ratio
        frames = t_ratio(shape.frames) if callable(t_ratio) else math.ceil(shape.frames / t_ratio)
    else:
        frames, rh, rw = shape.frames, ratio, ratio
    if dim == 2 and shape.frames > 1:
        raise CannotPreview("an image VAE takes no frames: set frames to 1")
    if dim not in (2, 3):
        raise CannotPreview(f"a VAE with {dim}-D latents (audio) is not previewed at an image shape")
    spatial = (max(1, shape.height // rh), max(1, shape.width // rw))
    latent = (shape.batch, vae.latent_channels) + ((max(1, frames),) if dim == 3 else ()) + spatial
    samples = torch.zeros(latent, device=vae.device, dtype=vae.vae_dtype)
    with vae._segmented():
        fsm.decode(samples)


def _clip_encode(clip) -> None:
    """``encode_from_tokens`` as the text encode node calls it, the host's model load left out
    (the dry run moves no weight, so there is nothing to load)."""
    tokens = clip.tokenize("")
    with _wrapped(clip, "load_model", lambda _orig: lambda *a, **k: clip.patcher):
        clip.encode_from_tokens(tokens, return_pooled=True)


__all__ = ["SHAPE_TYPE", "CannotPreview", "Shape", "preview", "traced_at", "BudgetError", "TraceUnavailable"]
