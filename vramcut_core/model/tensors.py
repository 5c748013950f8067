"""Byte counting and small tensor helpers shared by the engine.

Every byte figure the planner uses comes from here, so weights are counted one way everywhere.
"""
from __future__ import annotations

import decimal
import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import quant

GIB = 1024**3
MIB = 1024**2

# Offsets of tensors inside the executor's flat buffers are aligned to this many bytes, so that
# a byte view can be reinterpreted as any dtype (and CUDA kernels get aligned pointers).
ALIGN = 256


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def is_plain_tensor(t: torch.Tensor) -> bool:
    """True for ordinary dense tensors (Parameter included); False for tensor subclasses
    (quantized weights and the like), which the executor takes apart (``quant``) or, failing
    that, moves one by one with `.to()`. A dry run's fake of a plain tensor is plain too (a
    weight patch merged into a unit's copy in the dry run sees the fakes)."""
    return type(t) in _PLAIN and t.layout == torch.strided


_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor really occupies.

    Plain tensors: elements times element size (dtype-aware: fp8 is one byte). A tensor
    subclass that wraps other tensors (``__tensor_flatten__``, the convention of quantized
    weight types) is counted by its inner tensors; any other subclass by its storage.
    """
    if is_plain_tensor(t) or t.is_meta:
        return t.numel() * t.element_size()
    stored = quant.stored_nbytes(t)  # quantized formats: the bytes they are stored in
    if stored is not None:
        return stored
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        try:
            names, _ = flatten()
            return sum(tensor_nbytes(getattr(t, n)) for n in names)
        except Exception:  # a subclass whose flatten needs more context: fall back to storage
            pass
    try:
        return t.untyped_storage().nbytes()
    except Exception:
        return t.numel() * t.element_size()


def _fixed(x: float, digits: int) -> str:
    """``x`` with ``digits`` decimals as JavaScript's ``toFixed`` writes it (the node's figures):
    from the float's exact value, a tie rounded away from zero (Python's format rounds it to even:
    1.25 MiB would read 1.2 here and 1.3 on the node)."""
    return str(decimal.Decimal(x).quantize(decimal.Decimal(1).scaleb(-digits), rounding=decimal.ROUND_HALF_UP))


def fmt_bytes(n: int | None) -> str:
    """Human-readable size: GiB above 1 GiB, MiB above 1 MiB, else KiB (as ``fmtBytes`` in
    web/plan/format.js writes it)."""
    if n is None:
        return "—"
    if abs(n) >= GIB:
        return f"{_fixed(n / GIB, 2)} GiB"
    if abs(n) >= MIB:
        return f"{_fixed(n / MIB, 1)} MiB"
    if abs(n) < 1024:
        return f"{n} B"
    return f"{_fixed(n / 1024, 1)} KiB"


def fmt_seconds(s: float | None) -> str:
    """Human-readable seconds, as the node writes them (``fmtSeconds``, web/plan/format.js):
    whole seconds from 10 s, two decimals from 0.095 s, else milliseconds."""
    if s is None or not math.isfinite(s):
        return "?"
    if s >= 10:
        return f"{_fixed(s, 0)} s"
    if s >= 0.095:
        return f"{_fixed(s, 2)} s"
    if s >= 0.0005:
        return f"{_fixed(s * 1000, 0 if s >= 0.01 else 1)} ms"
    return "0 s"


def max_abs_diff(out, ref) -> tuple[float, bool]:
    """Largest |out - ref| over the tensors of two outputs of the same structure."""
    from torch.utils._pytree import tree_flatten

    a, _ = tree_flatten(out)
    b, _ = tree_flatten(ref)
    ta = [x for x in a if isinstance(x, torch.Tensor)]
    tb = [x for x in b if isinstance(x, torch.Tensor)]
    if len(ta) != len(tb):
        return float("inf"), False
    worst, equal = 0.0, True
    for x, y in zip(ta, tb):
        if x.shape != y.shape:
            return float("inf"), False
        equal = equal and torch.equal(x, y.to(x.device))
        if x.numel():
            d = (x.double() - y.to(x.device).double()).abs().max().item()
            worst = max(worst, d if d == d else float("inf"))
    return worst, equal
