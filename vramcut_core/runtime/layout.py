"""Flat layouts: where a unit's tensors sit in one flat buffer, and typed views into it.

Owns nothing but the layout data and the per-buffer view cache (which lives and dies with the
buffer). The one rule: a layout is a pure function of the unit's tensors, the same for the host
master and every device buffer, so one copy moves a whole unit.
"""
from __future__ import annotations

import dataclasses

import torch

from ..model import quant
from ..model.tensors import align_up, is_plain_tensor, tensor_nbytes
from ..model.units import Unit


@dataclasses.dataclass
class Layout:
    """Where a unit's plain tensors sit in a flat buffer, and its subclass tensors."""

    flat: list[tuple[int, int, int]]   # (index into unit.tensors, byte offset, nbytes)
    other: list[int]                   # indices of tensors moved one by one (subclasses)
    nbytes: int                        # flat buffer size (aligned)
    other_bytes: int
    # quantized subclasses taken apart (model.quant): index -> [(offset, nbytes)] per part
    quant: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)


def layout_of(unit: Unit) -> Layout:
    flat, other, off, other_bytes = [], [], 0, 0
    qparts: dict[int, list[tuple[int, int]]] = {}
    for i, ut in enumerate(unit.tensors):
        if is_plain_tensor(ut.tensor) and ut.tensor.is_contiguous():
            n = ut.tensor.numel() * ut.tensor.element_size()
            flat.append((i, off, n))
            off = align_up(off + n)
        elif (ps := quant.parts(ut.tensor)) is not None:
            qparts[i] = []
            for p in ps:
                n = p.numel() * p.element_size()
                qparts[i].append((off, n))
                off = align_up(off + n)
        else:
            other.append(i)
            other_bytes += tensor_nbytes(ut.tensor)
    return Layout(flat, other, off, other_bytes, qparts)


def quant_views(buf: torch.Tensor, t: torch.Tensor, spans: list[tuple[int, int]], base: int = 0) -> list[torch.Tensor]:
    """Views of ``buf`` (from byte ``base``) shaped like the parts of quantized tensor ``t``."""
    return [view(buf, base + off, n, p) for (off, n), p in zip(spans, quant.parts(t))]


def view(buf: torch.Tensor, off: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """A view of ``buf`` shaped like ``like``. Made once per buffer, place and shape: slots and
    resident buffers are copied into and swapped in on every forward, and a typed view of a byte
    buffer costs microseconds. The views live with the buffer (freed with it); tensors pointed
    at one share its memory, never its metadata."""
    cache = getattr(buf, "_vramcut_views", None)
    if cache is None:
        cache = buf._vramcut_views = {}
    key = (off, n, like.dtype, like.shape, torch.is_inference_mode_enabled())  # (a view made in
    # inference mode is an inference tensor: it must not be reused for a copy outside it)
    v = cache.get(key)
    if v is None:
        v = cache[key] = buf[off:off + n].view(like.dtype).view(like.shape)
    return v
