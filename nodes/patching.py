"""Patched clones of MODEL, CLIP, VAE, upscale models and CLIP vision.

Each returns a new object that runs its network through a VRAMCut engine; the object passed in
(and every other clone of it) behaves exactly as before. The networks are shared with the
original, as ComfyUI clones always share them: VRAMCut changes nothing on them outside a call,
and inside a call it only points parameters at device copies and back.
"""
from __future__ import annotations

import contextlib
import copy

import torch

import comfy.sd
import comfy.model_patcher
from comfy.patcher_extension import WrappersMP

from ..vramcut_core import find_units
from .compiler import compiler_off
from .devices import CFG_SPLIT_REFUSED, multigpu_clones
from .gpu import held_bytes
from .patcher import plain_patcher, to_vramcut_patcher
from .report import NodeReport
from .state import KEY, PatchState, Settings, VRAMCutError


# ----------------------------------------------------------------------------------------------
# MODEL


class _ApplyModelWrapper:
    """APPLY_MODEL wrapper: the diffusion model's forward runs segmented. The engine keeps its
    device buffers for the whole sampling run; ON_CLEANUP (end of sampling, Cancel included)
    releases them."""

    def __init__(self, state: PatchState) -> None:
        self.state = state

    def __call__(self, executor, *args, **kwargs):
        base_model = executor.class_obj
        module = base_model.diffusion_model
        patcher = getattr(base_model, "current_patcher", None)
        device = getattr(patcher, "load_device", None) or _device_of_inputs(args, kwargs)
        engine = self.state.engine(module, device, keep_buffers=True)
        engine.hold_weights(self.state.in_run)  # weights held between steps only inside a run
        return self.state.run(engine, executor, *args, patcher=patcher, **kwargs)


class _OuterSampleWrapper:
    """OUTER_SAMPLE wrapper: the host's model compiler stays off for the whole sampling run of a
    model VRAMCut runs (``compiler.compiler_off``), put back as it was after it, errors and
    Cancel included. With devices, a model that ComfyUI's MultiGPU CFG Split has copied onto the
    other GPUs since the node ran is refused here, before the host loads anything."""

    def __init__(self, state: PatchState | None = None) -> None:
        self.state = state

    def __call__(self, executor, *args, **kwargs):
        guider = getattr(executor, "class_obj", None)
        if (self.state is not None and self.state.settings.devices is not None
                and multigpu_clones(getattr(guider, "model_patcher", None))):
            self.state.report.fail(CFG_SPLIT_REFUSED)
            raise VRAMCutError(CFG_SPLIT_REFUSED)
        with compiler_off():
            return executor(*args, **kwargs)


class _CondBatchWrapper:
    """CALC_COND_BATCH wrapper for hosts whose sampler asks ``model_management`` for free memory
    (ComfyUI 0.3.x) when it decides whether cond and uncond run as one batch: it batches when
    ``memory_required(batch) * 1.5`` is below that figure, and the weights the engines hold
    between steps count there as used. They are the engines' to give back, so for that decision
    the model's need is told less by what they hold: the same answer as ``free + held``, which
    newer hosts get by asking the patcher (``VRAMCutModelPatcher.get_free_memory``)."""

    def __init__(self, state: PatchState) -> None:
        self.state = state

    def __call__(self, executor, model, *args, **kwargs):
        held = held_bytes(self.state)
        if not held:
            return executor(model, *args, **kwargs)
        less = held / 1.5
        with _wrapped(model, "memory_required",
                      lambda required: lambda *a, **k: max(0, required(*a, **k) - less)):
            return executor(model, *args, **kwargs)


def _device_of_inputs(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    raise VRAMCutError("cannot tell the compute device of this model call")


def patch_model(model, settings: Settings, report: NodeReport):
    """A patched clone of a ComfyUI ModelPatcher (MODEL). With devices, a model ComfyUI's MultiGPU
    CFG Split has copied onto other GPUs is refused: both would use those GPUs. (Without devices
    each copy runs under the budget on its own GPU, as before.)"""
    if settings.devices is not None and multigpu_clones(model):
        raise VRAMCutError(CFG_SPLIT_REFUSED)
    state = PatchState("MODEL", settings, report)
    clone = to_vramcut_patcher(model, state)
    clone.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, KEY)
    clone.add_wrapper_with_key(WrappersMP.APPLY_MODEL, KEY, _ApplyModelWrapper(state))
    clone.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, KEY)
    clone.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, KEY, _OuterSampleWrapper(state))
    if not hasattr(comfy.model_patcher.ModelPatcher, "get_free_memory"):  # the sampler asks the process
        clone.remove_wrappers_with_key(WrappersMP.CALC_COND_BATCH, KEY)
        clone.add_wrapper_with_key(WrappersMP.CALC_COND_BATCH, KEY, _CondBatchWrapper(state))
    engine = state.engine(clone.model.diffusion_model, clone.load_device)
    report.weights("MODEL", engine)
    return clone


# ----------------------------------------------------------------------------------------------
# Calls on shared modules: wrapped for the duration of one call only


@contextlib.contextmanager
def _wrapped(obj, name: str, make):
    """Set ``obj.<name>`` to ``make(original)`` for the block; the instance attribute is removed
    (or the previous one put back) afterwards, whatever happens."""
    had = name in obj.__dict__
    prev = obj.__dict__.get(name)
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        if had:
            setattr(obj, name, prev)
        else:
            delattr(obj, name)


def _token_signature(tokens) -> tuple:
    """Text encoders are planned per token shape: the encoders and their batch x length."""
    items = sorted(tokens.items()) if isinstance(tokens, dict) else [("", tokens)]
    return tuple((f"tokens.{k}" if k else "tokens", (len(v), max((len(x) for x in v), default=0)), "tokens")
                 for k, v in items)


# ----------------------------------------------------------------------------------------------
# CLIP


class VRAMCutCLIP(comfy.sd.CLIP):
    """A ComfyUI CLIP whose text encoders run segmented; stays patched through ``clone()``."""

    _vramcut: PatchState

    def clone(self, *args, **kwargs):
        n = super().clone(*args, **kwargs)
        n.__class__ = VRAMCutCLIP
        n._vramcut = self._vramcut
        return n

    @contextlib.contextmanager
    def _segmented(self):
        if self.__dict__.get("_vramcut_active"):  # scheduled encodes call encode_from_tokens
            yield
            return
        state = self._vramcut
        engine = state.engine(self.cond_stage_model, self.patcher.load_device)
        patcher = self.patcher

        def make(orig):
            def encode_token_weights(token_weight_pairs, *a, **kw):
                return state.run(engine, orig, token_weight_pairs, *a, sig=_token_signature(token_weight_pairs),
                                 patcher=patcher, **kw)
            return encode_token_weights

        self._vramcut_active = True
        try:
            with engine.session(), _wrapped(self.cond_stage_model, "encode_token_weights", make):
                yield
        finally:
            self._vramcut_active = False

    def encode_from_tokens(self, tokens, *args, **kwargs):
        with self._segmented():
            return super().encode_from_tokens(tokens, *args, **kwargs)

    def encode_from_tokens_scheduled(self, tokens, *args, **kwargs):
        with self._segmented():
            return super().encode_from_tokens_scheduled(tokens, *args, **kwargs)

    if hasattr(comfy.sd.CLIP, "generate"):  # newer hosts: text generation with LLM encoders
        def generate(self, *args, **kwargs):
            self._vramcut.outside("text generation (CLIP.generate)")
            return super().generate(*args, **kwargs)


def _input_embedding_units(cond_stage_model: torch.nn.Module) -> tuple[str, ...]:
    """Units holding the encoders' input embeddings stay resident: the encoders read the
    embedding's device before any of their modules runs, to place the tokens."""
    where = {id(m): q for q, m in cond_stage_model.named_modules()}
    names = []
    for m in cond_stage_model.modules():
        get = getattr(m, "get_input_embeddings", None)
        if callable(get):
            try:
                emb = get()
            except Exception:  # an encoder without one
                continue
            if id(emb) in where:
                names.append(where[id(emb)])
    return tuple(dict.fromkeys(names))


def patch_clip(clip, settings: Settings, report: NodeReport):
    """A patched clone of a ComfyUI CLIP."""
    base = clip.clone()
    state = PatchState("CLIP", settings, report)
    base.patcher = to_vramcut_patcher(base.patcher, state)
    base.cond_stage_model = base.patcher.model
    base.__class__ = VRAMCutCLIP
    base._vramcut = state
    emb_paths = _input_embedding_units(base.cond_stage_model)
    state.keep_resident = tuple(u.name for u in find_units(base.cond_stage_model).units
                         if any(p == q or p.startswith(q + ".") for p in emb_paths for q, _ in u.roots))
    engine = state.engine(base.cond_stage_model, base.patcher.load_device)
    report.weights("CLIP", engine)
    return base


# ----------------------------------------------------------------------------------------------
# VAE


# The first-stage model's entry points the host calls: plain decode/encode, and on newer hosts
# the tiled ones of VAEs that tile themselves (``handles_tiling``: ``_decode_tiled_owned``).
_VAE_ENTRY_POINTS = ("decode", "encode", "decode_tiled", "encode_tiled")


class VRAMCutVAE(comfy.sd.VAE):
    """A ComfyUI VAE whose encoder and decoder run segmented, activation-aware: a call whose
    activations the budget cannot hold raises an out-of-memory error, and ComfyUI's own fallback
    retries it tiled."""

    _vramcut: PatchState

    @contextlib.contextmanager
    def _segmented(self):
        if self.__dict__.get("_vramcut_active"):  # decode's tiled fallback calls decode_tiled_*
            yield
            return
        state = self._vramcut
        fsm = self.first_stage_model
        engine = state.engine(fsm, self.patcher.load_device)
        patcher = self.patcher

        def make(orig):
            def call(*a, **kw):
                if engine.running:  # an entry point calling another (decode_tiled -> decode)
                    return orig(*a, **kw)
                return state.run(engine, orig, *a, patcher=patcher, **kw)
            return call

        self._vramcut_active = True
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(engine.session())
                for name in _VAE_ENTRY_POINTS:
                    if callable(getattr(fsm, name, None)):
                        stack.enter_context(_wrapped(fsm, name, make))
                yield
        finally:
            self._vramcut_active = False

    def decode(self, *args, **kwargs):
        with self._segmented():
            return super().decode(*args, **kwargs)

    def decode_tiled(self, *args, **kwargs):
        with self._segmented():
            return super().decode_tiled(*args, **kwargs)

    def encode(self, *args, **kwargs):
        with self._segmented():
            return super().encode(*args, **kwargs)

    def encode_tiled(self, *args, **kwargs):
        with self._segmented():
            return super().encode_tiled(*args, **kwargs)

    if hasattr(comfy.sd.VAE, "prepare_decode"):  # newer hosts: VAEs whose nodes call the model directly
        def prepare_decode(self, *args, **kwargs):
            self._vramcut.outside("a decode through the model's own entry point (VAE.prepare_decode)")
            return super().prepare_decode(*args, **kwargs)


def _copy_as(obj, cls):
    new = cls.__new__(cls)
    new.__dict__.update(obj.__dict__)
    return new


def _patched_copy(obj, cls, kind: str, model_attr: str, settings: Settings, report: NodeReport):
    """A copy of ``obj`` as ``cls`` with a VRAMCut patcher, for host objects that have no
    ``clone()`` (VAE, CLIP vision); ``model_attr`` names the attribute holding the network."""
    state = PatchState(kind, settings, report)
    new = _copy_as(obj, cls)
    new.patcher = to_vramcut_patcher(obj.patcher, state)
    setattr(new, model_attr, new.patcher.model)
    new._vramcut = state
    engine = state.engine(new.patcher.model, new.patcher.load_device)
    report.weights(kind, engine)
    return new


def patch_vae(vae, settings: Settings, report: NodeReport):
    """A patched copy of a ComfyUI VAE."""
    return _patched_copy(vae, VRAMCutVAE, "VAE", "first_stage_model", settings, report)


# ----------------------------------------------------------------------------------------------
# Upscale models and CLIP vision


def patch_upscale_model(upscale_model, settings: Settings, report: NodeReport):
    """A patched copy of a spandrel model descriptor (UPSCALE_MODEL). ComfyUI moves the
    descriptor to the GPU before upscaling; the copy keeps its weights where they are and
    streams them, and a budget too small for a tile makes ComfyUI retry with smaller tiles."""
    state = PatchState("UPSCALE_MODEL", settings, report)
    module = upscale_model.model
    patcher = getattr(upscale_model, "patcher", None) or plain_patcher(module)
    new = copy.copy(upscale_model)
    new.__class__ = _upscale_class(type(upscale_model))
    new._vramcut = state
    new.patcher = to_vramcut_patcher(patcher, state)
    new._vramcut_device = new.patcher.load_device
    engine = state.engine(module, new.patcher.load_device)
    report.weights("UPSCALE_MODEL", engine)
    return new


_UPSCALE: dict[type, type] = {}


def _upscale_class(cls):
    if getattr(cls, "_is_vramcut", False):
        return cls
    if cls not in _UPSCALE:
        def to(self, *args, **kwargs):
            dev = next((a for a in list(args) + list(kwargs.values())
                        if isinstance(a, (str, torch.device))), None)
            if dev is not None:
                self._vramcut_device = torch.device(dev)
                if self._vramcut_device.type == "cpu":
                    self._vramcut.release()  # ComfyUI 0.3.x moves the model back when done
            return self  # the weights stay on the host; the engine streams them

        def __call__(self, *args, **kwargs):
            # Called once per tile: the engine keeps its buffers between tiles, until the model
            # is moved back to the CPU or its patcher is cleaned up or detached.
            state = self._vramcut
            dev = self._vramcut_device if self._vramcut_device.type != "cpu" else self.patcher.load_device
            engine = state.engine(self.model, dev, keep_buffers=True)
            return state.run(engine, super(new_cls, self).__call__, *args, patcher=self.patcher, **kwargs)

        new_cls = type(f"VRAMCut{cls.__name__}", (cls,), {"to": to, "__call__": __call__, "_is_vramcut": True})
        _UPSCALE[cls] = new_cls
    return _UPSCALE[cls]


class _ClipVisionMixin:
    def encode_image(self, *args, **kwargs):
        state = self._vramcut
        engine = state.engine(self.model, self.patcher.load_device)

        patcher = self.patcher

        def make(orig):
            def forward(*a, **kw):
                return state.run(engine, orig, *a, patcher=patcher, **kw)
            return forward

        with engine.session(), _wrapped(self.model, "forward", make):
            return super().encode_image(*args, **kwargs)


_CV: dict[type, type] = {}


def patch_clip_vision(clip_vision, settings: Settings, report: NodeReport):
    """A patched copy of a ComfyUI CLIP vision model (CLIP_VISION)."""
    cls = type(clip_vision)
    if not issubclass(cls, _ClipVisionMixin):
        cls = _CV.setdefault(cls, type(f"VRAMCut{cls.__name__}", (_ClipVisionMixin, cls), {}))
    return _patched_copy(clip_vision, cls, "CLIP_VISION", "model", settings, report)
