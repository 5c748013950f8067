"""Quantized weights as stored: tensor subclasses taken apart into plain tensors and rebuilt.

Quantized checkpoints reach the engine as tensor subclasses: a wrapper type whose real data is
a set of inner tensors (``__tensor_flatten__`` / ``__tensor_unflatten__``: ComfyUI's
comfy-kitchen ``QuantizedTensor``, fp8-scaled, int8, mxfp8, nvfp4), or a plain subclass whose
own storage holds the quantized bytes and whose Python attributes say how to read them
(ComfyUI-GGUF's ``GGMLTensor``: raw blocks plus ``tensor_type`` / ``tensor_shape`` / ``patches``).

Either way this module gives the executor the same three things, so a quantized weight lives
in a unit's flat host master and flat device buffer like any plain tensor, at its stored size:

* ``parts(t)``: the plain tensors holding its bytes (views of its own storage, nothing copied);
  None when the format cannot be taken apart (the executor then moves it as a whole).
* ``rebuild(t, views)``: a new object of ``t``'s type around ``views`` (device copies of the
  parts), metadata kept (the layout and its parameters; GGUF's type tag, shape and LoRA patches
  as they are at the time of the call).
* ``rehome_(t, views)``: point ``t``'s own parts at ``views`` (the unit's flat host master), so
  the object the model holds stays the same one.
* ``as_parameter(t)``: a rebuilt object marked as a parameter without the copy ``nn.Parameter``
  would make of a subclass.

The one rule: never copy a value here and never import the host; only storage is re-pointed.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import tensors  # (tensors imports this module: its test is read at call time)

FLATTEN = "flatten"   # wrapper subclass with __tensor_flatten__ / __tensor_unflatten__
STORAGE = "storage"   # plain subclass: its own storage holds the bytes, attributes the metadata


def kind(t: torch.Tensor) -> str | None:
    """How ``t`` is taken apart, or None (a plain tensor, or a format that cannot be)."""
    if tensors.is_plain_tensor(t) or t.is_meta:
        return None
    if hasattr(t, "__tensor_flatten__"):
        try:
            names, _ = t.__tensor_flatten__()
            inner = [getattr(t, n) for n in names]
        except Exception:
            return None
        if inner and all(isinstance(x, torch.Tensor) and tensors.is_plain_tensor(x) and x.is_contiguous()
                         and x.device == t.device for x in inner):
            return FLATTEN
        return None
    # A subclass that does not intercept dispatch computes on its own storage: that storage is
    # the weight, whatever attributes ride along.
    if (getattr(type(t), "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__
            and t.layout == torch.strided):
        with torch._C.DisableTorchFunctionSubclass():
            if t.is_contiguous():
                return STORAGE
    return None


def parts(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors holding ``t``'s bytes, in a fixed order; None if it cannot be taken apart."""
    k = kind(t)
    if k == FLATTEN:
        names, _ = t.__tensor_flatten__()
        return [getattr(t, n) for n in names]
    if k == STORAGE:
        with torch._C.DisableTorchFunctionSubclass():
            return [t.as_subclass(torch.Tensor)]
    return None


def stored_nbytes(t: torch.Tensor) -> int | None:
    """Bytes of the parts (unaligned), or None when ``t`` cannot be taken apart."""
    ps = parts(t)
    if ps is None:
        return None
    return sum(p.numel() * p.element_size() for p in ps)


def rebuild(t: torch.Tensor, views: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new object like ``t`` whose parts are ``views`` (same order as ``parts(t)``)."""
    k = kind(t)
    if k == FLATTEN:
        names, ctx = t.__tensor_flatten__()
        return type(t).__tensor_unflatten__(dict(zip(names, views)), ctx, t.size(), t.stride())
    if k == STORAGE:
        (v,) = views
        with torch._C.DisableTorchFunctionSubclass():
            new = v.as_subclass(type(t))
        # metadata as it is now (GGUF keeps a weight's LoRA patches on the weight object)
        new.__dict__.update(t.__dict__)
        return new
    raise TypeError(f"{format_name(t)} cannot be rebuilt from parts")


def as_parameter(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, marked as a parameter (``isinstance(t, nn.Parameter)``), nothing copied.

    ``nn.Parameter(t)`` on a tensor subclass returns ``t.detach()`` with this same mark, and
    comfy-kitchen's ``QuantizedTensor.detach`` clones its scales: on a device copy still being
    written by the copy stream, that clone reads the scales before they land, and it allocates
    device memory no budget counts. The mark is what ``nn.Parameter`` sets (``_is_param``)."""
    if isinstance(t, torch.nn.Parameter):
        return t
    t._is_param = True
    return t


def rehome_(t: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    """Point ``t``'s parts at ``views`` in place (host memory only: ``t`` keeps its device)."""
    k = kind(t)
    if k == FLATTEN:
        names, _ = t.__tensor_flatten__()
        for n, v in zip(names, views):
            getattr(t, n).data = v
    elif k == STORAGE:
        (v,) = views
        with torch._C.DisableTorchFunctionSubclass():
            t.data = v
    else:
        raise TypeError(f"{format_name(t)} cannot be re-pointed")


def format_name(t: torch.Tensor) -> str:
    """A short name for the format: ``QuantizedTensor/TensorCoreFP8E4M3Layout``,
    ``GGMLTensor/Q8_0``."""
    name = type(t).__name__
    detail = getattr(t, "_layout_cls", None)
    if detail is None:
        tt = getattr(t, "tensor_type", None)
        detail = getattr(tt, "name", tt)
    return f"{name}/{detail}" if detail is not None else name
