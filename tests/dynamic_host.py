"""A stand-in for the dynamic-VRAM patcher of newer ComfyUI hosts, for CPU tests.

ComfyUI 0.33.0 manages models with ``comfy.model_patcher.ModelPatcherDynamic`` on NVIDIA (and
ROCm >= 7.14) by default; on CPU ``ModelPatcherDynamic(...)`` returns a plain ``ModelPatcher``,
so its behaviour cannot run here. :class:`DynamicStandIn` does what that class does to
everything VRAMCut touches, read from the 0.33.0 source (``comfy/model_patcher.py``):

* ``is_dynamic()`` is True; ``clone()`` keeps the class and registers the clone in
  ``model.dynamic_patchers``; ``clone(disable_dynamic=True)`` reloads the model from its loader
  through ``cached_patcher_init`` and raises the host's ``RuntimeError`` when the loader set none
  (every reload is counted in :data:`RELOADS`);
* ``load()`` refuses ``force_patch_weights`` and ``full_load`` (the host asserts), restores the
  previous load's backups, gives each ``comfy_cast_weights`` module a virtual weight range
  ``_v`` (a :class:`VBarRange`) and its LoRA as ``weight_lowvram_function``, and force-loads the
  parameters of other modules (a new Parameter, the old one kept in ``backup``), counting them in
  ``model_loaded_weight_memory``;
* ``pin_weight_to_device`` / ``unpin_weight`` raise (pinning is deferred to ops time there);
* ``get_free_memory(device)`` adds what the host could evict from its virtual ranges
  (:data:`RECLAIMABLE` here);
* ``unpatch_model`` never unpatches weights through the plain path.

With ``_v`` on a module, ComfyUI's ``cast_bias_weight`` takes its dynamic path (on CPU: a plain
copy of the weight that ignores the module's weight functions), so a patched model whose modules
still carry ``_v`` while VRAMCut runs it gives a visibly different result with a LoRA.
"""
from __future__ import annotations

import collections

import torch

import tiny_models as tm

RECLAIMABLE = 3 << 30  # what the stand-in says its virtual ranges could give back
RELOADS: list[str] = []  # one entry per reload from a loader (clone(disable_dynamic=True))


class VBarRange:
    """The virtual weight range the host hangs on a module (``m._v``)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _base():
    tm.import_comfy()
    import comfy.model_patcher
    return comfy.model_patcher.ModelPatcher


class DynamicStandIn(_base()):
    """See the module docstring."""

    # where a force-loaded parameter goes for a load device (a simulated accelerator maps its
    # devices onto host memory: tests running on one set this to its placement)
    place = staticmethod(lambda device: device)

    def _register(self) -> None:
        if not hasattr(self.model, "dynamic_patchers"):
            self.model.dynamic_patchers = set()
        self.model.dynamic_patchers.add(id(self))
        if not hasattr(self.model, "dynamic_pins"):
            self.model.dynamic_pins = {}
        self.model.dynamic_pins.setdefault(self.load_device, {"active": False})

    def is_dynamic(self):
        return True

    def clone(self, disable_dynamic=False, model_override=None, force_deepcopy=False, **kwargs):
        if disable_dynamic:
            if self.cached_patcher_init is None:
                raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")
            RELOADS.append(type(self.model).__name__)
            fresh = self.cached_patcher_init[0](*self.cached_patcher_init[1], disable_dynamic=True)
            n = _base().clone(self)
            n.__class__ = _base()
            n.model = fresh.model
            return n
        n = super().clone()
        n._register()
        return n

    def pin_weight_to_device(self, key):
        raise RuntimeError("pin_weight_to_device invalid for dymamic weight loading")

    def unpin_weight(self, key):
        raise RuntimeError("unpin_weight invalid for dymamic weight loading")

    def unpin_all_weights(self):
        pass

    def get_free_memory(self, device):
        import comfy.model_management
        return comfy.model_management.get_free_memory(device) + RECLAIMABLE

    def memory_required(self, input_shape):
        return super().memory_required(input_shape=input_shape) * 1.3 + (1024 ** 3)

    def restore_loaded_backups(self):
        import comfy.utils
        for key in list(self.backup.keys()):
            comfy.utils.set_attr_param(self.model, key, self.backup.pop(key).weight)
        self.model.model_loaded_weight_memory = 0

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, dirty=False):
        import comfy.model_patcher
        import comfy.utils

        assert not force_patch_weights, "dynamic loading never force-patches weights"
        assert not full_load, "dynamic loading has no full load"
        self.restore_loaded_backups()
        self.model.dynamic_pins[self.load_device]["active"] = True
        for n, m in self.model.named_modules():
            params = {k: p for k, p in m.named_parameters(recurse=False)}
            if hasattr(m, "comfy_cast_weights"):
                m.comfy_cast_weights = True
                for param in ("weight", "bias"):
                    key = f"{n}.{param}" if n else param
                    fn = comfy.model_patcher.LowVramPatch(key, self.patches) if key in self.patches else None
                    setattr(m, param + "_lowvram_function", fn)
                    setattr(m, param + "_function", list(self.weight_wrapper_patches.get(key, [])))
                if not hasattr(m, "_v"):
                    m._v = VBarRange(sum(p.numel() * p.element_size() for p in params.values()))
            else:
                for param, weight in params.items():
                    key = f"{n}.{param}" if n else param
                    if key not in self.backup:
                        self.backup[key] = collections.namedtuple("Dimension", ["weight", "inplace_update"])(weight, False)
                    cast = weight.to(device=self.place(device_to))
                    comfy.utils.set_attr_param(self.model, key, cast)
                    self.model.model_loaded_weight_memory += cast.numel() * cast.element_size()
        self.model.device = device_to
        self.model.current_weight_patches_uuid = self.patches_uuid

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        assert not force_patch_weights
        self.unpatch_model(self.offload_device, unpatch_weights=False)
        self.patch_model(load_weights=False)
        self.load(device_to)
        return None

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        return 0

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        super().unpatch_model(device_to=None, unpatch_weights=False)


def make_dynamic(patcher, loader=None):
    """A dynamic clone of ``patcher`` sharing its module, as the host's loaders make them.
    ``loader``: a function the host would call to reload the model (``cached_patcher_init``), or
    None for loaders that set none (upscale models, CLIP vision, TAESD, custom loaders)."""
    n = patcher.clone()
    n.__class__ = DynamicStandIn
    n._register()
    n.cached_patcher_init = (loader, ()) if loader is not None else None
    return n


def dynamic_modules(module: torch.nn.Module) -> list[str]:
    """Names of the modules carrying the host's dynamic-VRAM state."""
    return [n for n, m in module.named_modules() if any(a in m.__dict__ for a in ("_v", "_v_block", "_prefetch"))]
