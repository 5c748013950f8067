"""Weight patches (LoRA and the like) merged into a unit's device copy as it arrives, exactly as
the host merges them on a full load, so the host keeps one unpatched copy of every weight; and
the host's per-forward patch functions of those weights, kept out of VRAMCut's forwards. Owns
nothing between calls; the one rule: a weight is patched once, by the host or on the device,
never both. May call ComfyUI's lora, float, model_patcher and model_management.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref

import torch

import comfy.float
import comfy.lora
import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils

from ..vramcut_core import is_plain_tensor, quant_parts
from .errors import VRAMCutError


def _string_to_seed(key: str) -> int:
    f = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed
    return f(key)


def _changes_shape(patches, weight, key: str) -> bool:
    """Whether a weight's patches give it another shape (a padded token table: a "diff" with
    ``pad_weight``). A device copy has the original's shape, so those are never merged into one:
    ComfyUI 0.38's low-VRAM load merges them on the host (the original kept in ``backup``),
    older hosts pad the weight per forward."""
    calc = getattr(comfy.lora, "calculate_shape", None)
    if calc is not None:
        return tuple(calc(patches, weight, key)) != tuple(weight.shape)
    # hosts without it (0.3.64) know one shape-changing patch: the padded "diff"
    for p in patches:
        v = p[1]
        if (isinstance(v, tuple) and len(v) == 2 and v[0] == "diff" and len(v[1]) > 1
                and v[1][1].get("pad_weight") and v[1][0].shape != weight.shape):
            return True
    return False


def merge_shape_changing_on_host(patcher) -> None:
    """At load: weights whose patches change their shape are merged on the host, the original
    kept in the patcher's ``backup`` (put back when the host unpatches), as ComfyUI 0.38's
    low-VRAM load does itself. Older hosts patch those per forward, padding at the weight's own
    precision, which a full load does not; and a device copy has the original's shape, so they
    can never be merged into one. Costs one host copy of each such weight (a padded token
    table), as on 0.38."""
    for key, patches in list(getattr(patcher, "patches", {}).items()):
        if key in patcher.backup:
            continue
        try:
            weight, _, _ = comfy.model_patcher.get_key_weight(patcher.model, key)
        except Exception:  # a key the model does not have: the host ignores it too
            continue
        if weight is None or not _changes_shape(patches, weight, key):
            continue
        owner, _, param = key.rpartition(".")
        m = comfy.utils.get_attr(patcher.model, owner) if owner else patcher.model
        fns = getattr(m, f"{param}_function", None)
        if fns:  # the host's per-forward patch of this weight: merged now instead
            setattr(m, f"{param}_function", [f for f in fns if not isinstance(f, comfy.model_patcher.LowVramPatch)])
        patcher.patch_weight_to_device(key)


def mergeable_patch_keys(patcher) -> frozenset[str]:
    """Weight-patch keys (LoRA and the like) VRAMCut merges into the device copy of the unit.
    Where the host's merge can return the merged weight (newer hosts), every weight the executor
    holds as a plain tensor or takes apart (quantized: the host requantizes, its parts replace
    the device parts); on older hosts, plain weights with no host conversion. Patches that
    change a weight's shape, and the rest, keep the host's own patching."""
    keys = []
    returns = DeviceMerge.host_returns_weight(patcher)
    for key, patches in getattr(patcher, "patches", {}).items():
        try:
            weight, set_func, convert_func = comfy.model_patcher.get_key_weight(patcher.model, key)
        except Exception:  # a key the model does not have: the host ignores it too
            continue
        if weight is None or _changes_shape(patches, weight, key):
            continue
        plain = is_plain_tensor(weight)
        if returns and (plain or quant_parts(weight) is not None):
            keys.append(key)
        elif plain and set_func is None and convert_func is None:
            keys.append(key)
    return frozenset(keys)


class DeviceMerge:
    """The ``on_loaded`` hook of one call (``Engine.run(..., on_loaded=...)``): merges a patcher's
    weight patches into a unit's device copy, exactly as the host merges them when it loads a
    model fully on that device (same function where the host exposes it, same compute precision
    and rounding), so the host keeps one unpatched copy of each weight and nothing is merged on
    the CPU."""

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
            if is_plain_tensor(live):
                live.data.copy_(self.merged(key, live.data))
                continue
            # a quantized weight: the host requantizes the merged weight; its parts replace the
            # device copy's parts (same layout, recalculated scales)
            dst, src = quant_parts(live), quant_parts(self.merged(key, live))
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
