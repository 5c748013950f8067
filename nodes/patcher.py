"""The patcher: the ModelPatcher subclass that keeps every weight off the GPU for the engines to
stream, and the dynamic-VRAM stash that keeps the host's own offloading away from those weights
(the per-patch state is ``state``, device merges ``lora``, the host's own GPU use ``gpu``).

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

import functools
import weakref

import torch

import comfy.model_management as mm
import comfy.model_patcher
from comfy.patcher_extension import CallbacksMP

from .gpu import held_bytes, held_on, host_fast_disk, weights_changing
from .lora import _host_patch_functions, merge_shape_changing_on_host, mergeable_patch_keys
from .state import KEY, PatchState, VRAMCutError, running_on, state_of, wait_all_copies


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
        if st is not None:
            st.loading()
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
        merge_shape_changing_on_host(self)  # (0.38's load does it itself: then nothing is left to do)
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

    def unpin_all_weights(self):
        # (newer hosts: the host page-locked the offloaded weights at load, by address)
        st = state_of(self) if hasattr(self, "attachments") else None
        pinned = getattr(self, "pinned", None)
        if st is None or not pinned:
            return super().unpin_all_weights()
        running = st if st.running else running_on(self.model)
        if running is not None:
            # a forward runs on the engines' device copies (this patch's, or another clone's of
            # the same model: clones share the host's pinned weights): the parameters point at
            # those, and the host would unpin them and leave its own page-locked tensors
            # registered. Its tensors are unpinned once the forward has ended and they are the
            # masters again.
            running.after_forward(functools.partial(_unpin_host_pins, self.model, frozenset(pinned)))
            pinned.clear()  # as the host's own unpin leaves its table (shared by clones)
            return None
        # weights held between steps point at device copies, and copies may still read the
        # host's tensors: give them back first, so the host unpins its own, with no copy reading.
        # Clones share the host's pinned weights: another patch's engine (running or not) may be
        # copying from them now, so every engine's copies land first.
        st.release()
        wait_all_copies()
        return super().unpin_all_weights()

    def is_clone(self, other):
        same = super().is_clone(other)
        st = state_of(self) if same and hasattr(self, "attachments") else None
        if st is not None and state_of(other) is st:
            # the host's load_models_gpu asks the patcher it loads whether each loaded model is
            # a clone, and detaches those that are: this patch's own clone (the same patcher, a
            # later prompt) is detached only to be loaded again
            st.reloading(other)
        return same

    def detach(self, unpatch_all=True):
        st = state_of(self)
        if st is not None:
            # (with unpatch_all the host's unpatch_model inside releases too; it is idempotent)
            st.detaching(self, unpatch_all)
        try:
            return super().detach(unpatch_all=unpatch_all)
        finally:
            _give_back_to_dynamic(self.model)  # the host loads another clone of this model next

    def patch_hooks(self, hooks=None, *args, **kwargs):
        st = state_of(self)
        if st is not None and (hooks is not None or getattr(self, "hook_backup", None)):
            # hook weights are written in place, or the originals put back: engines copy again
            # (the host's cleanup after every run calls this with no hooks and nothing to put
            # back: nothing is written, and the copies stay good for the next prompt)
            weights_changing(st)
        return super().patch_hooks(hooks, *args, **kwargs)

    def get_free_memory(self, device):
        # weights the engines hold between forwards are theirs to give back, not used memory:
        # the host batches cond and uncond by this figure
        base = getattr(super(), "get_free_memory", None)  # a patcher method in newer hosts only
        free = base(device) if base is not None else mm.get_free_memory(device)
        st = state_of(self)
        return free + (held_bytes(st) if st is not None else 0)

    def clone(self, *args, **kwargs):
        n = super().clone(*args, **kwargs)
        # A loader pack's patcher may make its clones its own class again (ComfyUI-GGUF's
        # does): keep VRAMCut on top of it, as it was on the original.
        if not isinstance(n, VRAMCutModelPatcher) and state_of(n) is not None:
            n.__class__ = _patcher_class(type(n))
        return n

    def model_size(self):
        # what ComfyUI frees on the load device before loading: the budget there, not the model
        # (with devices, that device's own budget; the others are the engines' to manage)
        real = super().model_size()
        st = state_of(self) if hasattr(self, "attachments") else None
        budget = st.settings.home_budget_bytes(self.load_device) if st is not None else None
        if budget is None:
            return real
        return min(real, max(1, budget))

    def loaded_size(self):
        # what the engines hold on the load device between prompts (resident blocks kept for the
        # next one) counts as loaded: the host then frees for this model only what it lacks of
        # its budget (``model_memory_required``: model_size - loaded_size), not the bytes it
        # already holds, so it does not unload a VAE or a text encoder for room already in use
        base = super().loaded_size()
        st = state_of(self) if hasattr(self, "attachments") else None
        if st is None:
            return base
        held = held_on(st, self.load_device)
        return base + min(held, max(0, self.model_size() - base))


def _unpin_host_pins(model: torch.nn.Module, keys: frozenset) -> None:
    """The host's unpin of ``keys`` (its ``unpin_weight`` without the patcher, which may be gone
    by the time a forward ends): each weight is found by its key and unpinned by address."""
    for key in keys:
        weight, _, _ = comfy.model_patcher.get_key_weight(model, key)
        mm.unpin_memory(weight)


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
    state.fast_disk = host_fast_disk(patcher)
    clone.attachments[KEY] = state
    for ctype, fn in ((CallbacksMP.ON_CLEANUP, state.finish), (CallbacksMP.ON_DETACH, state.detached)):
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
