"""Measured memory: input signatures and activation meters.

Activation bytes are measured, never guessed from a factor. On CUDA the meter reads the caching
allocator's statistics; on CPU it tracks the bytes of live tensors created by operators (a
``TorchDispatchMode`` that adds each new storage and subtracts it when the storage dies), so the
same planner runs in CPU tests. Either way the executor's own weight buffers are left out: the
meter measures what the model's computation allocates.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..model.tensors import is_plain_tensor, max_abs_diff



def signature(args: tuple, kwargs: dict, max_depth: int = 4) -> tuple:
    """A hashable fingerprint of the tensors in a call: their positions, shapes and dtypes.

    Non-tensor values are left out (they do not change memory); nested lists, tuples and dicts
    are searched a few levels deep (ComfyUI passes tensors inside ``transformer_options``).
    """
    out: list = []

    def walk(path: str, v, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            out.append((path, tuple(v.shape), str(v.dtype)))
        elif depth < max_depth and isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{path}[{i}]", x, depth + 1)
        elif depth < max_depth and isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{path}.{k}", v[k], depth + 1)

    for i, a in enumerate(args):
        walk(f"arg{i}", a, 0)
    for k in sorted(kwargs):
        walk(k, kwargs[k], 0)
    return tuple(out)


def describe_signature(sig: tuple, limit: int = 3) -> str:
    """Short text for a signature: the largest tensors' shapes and dtypes."""
    big = sorted(sig, key=lambda e: -_numel(e[1]))[:limit]
    return ", ".join(f"{p} {'x'.join(map(str, s))} {d.replace('torch.', '')}" for p, s, d in big)


def verify_unpatched(sig: tuple, out, fn: Callable, args: tuple, kwargs: dict) -> dict:
    """Run ``fn`` unpatched on the same inputs; the largest |difference| from ``out``, logged."""
    res = {"signature": describe_signature(sig), "max_abs_diff": None, "equal": None, "error": None}
    try:
        ref = fn(*args, **kwargs)
        res["max_abs_diff"], res["equal"] = max_abs_diff(out, ref)
    except Exception as e:  # verification must never break the run it checks
        res["error"] = f"{type(e).__name__}: {e}"
    log = logging.getLogger("vramcut")
    if res["error"]:
        log.warning("VRAMCut verify (%s): the unpatched forward could not run: %s", res["signature"], res["error"])
    else:
        log.warning("VRAMCut verify (%s): max |segmented - unpatched| = %g (%s)", res["signature"],
                    res["max_abs_diff"], "bit-equal" if res["equal"] else "differs")
    return res


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclasses.dataclass
class UnitMeasurement:
    """What one unit did during a measured forward.

    ``entry_bytes``: live activation bytes when the unit started (the cut tensors flowing in,
    skip connections held for later units included). ``peak_bytes``: the most live activation
    bytes while it ran. ``activation_bytes`` is the part the unit itself added.
    """

    entry_bytes: int
    peak_bytes: int
    calls: int = 1  # separate entries in one forward (a video VAE runs its decoder per frame)
    modules: frozenset = frozenset()  # ids of the unit's modules that ran
    # floating-point operations from its entry until the next unit's, all passes together; None
    # where nothing counted them (only the dry run does, see ``trace``)
    flops: int | None = None
    # the dry run, where the host merges weight patches into a unit's copy at its entry: the most
    # live bytes a part of the unit cut finer may need (see ``trace``); None: the unit's own peak
    part_peak_bytes: int | None = None

    @property
    def activation_bytes(self) -> int:
        return max(0, self.peak_bytes - self.entry_bytes)


def joint_measurements(runs: list[dict[str, UnitMeasurement]]) -> dict[str, UnitMeasurement] | None:
    """One measurement per unit for forwards of several input shapes that enter the same units in
    the same order: the most live bytes and calls any of them saw, so one plan made from it fits
    each of them. None when the shapes run different units (an encode and a decode)."""
    if not runs:
        return None
    order = list(runs[0])
    if any(list(r) != order for r in runs[1:]):
        return None
    return {n: UnitMeasurement(max(r[n].entry_bytes for r in runs), max(r[n].peak_bytes for r in runs),
                               max(r[n].calls for r in runs), frozenset().union(*(r[n].modules for r in runs)),
                               _most(r[n].flops for r in runs),
                               max((r[n].part_peak_bytes for r in runs if r[n].part_peak_bytes is not None), default=None))
            for n in order}


def _most(values) -> int | None:
    """The largest of counts that are all known, else None."""
    values = list(values)
    return None if any(v is None for v in values) else max(values, default=None)


class UnitRecorder:
    """What a forward did per unit, recorded one way for the dry run (``trace``) and the measuring
    forward (``runtime.measuring``), so traced and measured figures cannot drift apart: the live
    activation bytes at each entry of a unit (the largest, when a unit is entered again after
    another one ran: a decoder run once per frame), the most live bytes while it ran, how many
    separate entries, and which of its modules ran. The caller reads the bytes from its meter."""

    def __init__(self) -> None:
        self.meas: dict[str, UnitMeasurement] = {}   # in entry order
        self.current: str | None = None
        self._modules: set[int] = set()

    def saw(self, module) -> None:
        """A module of the running unit was called (which parts of a unit ran: for finer cuts)."""
        self._modules.add(id(module))

    def enter(self, name: str, live: int) -> None:
        """Unit ``name`` starts with ``live`` activation bytes (first entry, or one more pass)."""
        m = self.meas.get(name)
        if m is None:
            self.meas[name] = UnitMeasurement(live, live)
        else:
            m.calls += 1
            m.entry_bytes = max(m.entry_bytes, live)
        self.current = name

    def leave(self, peak: int) -> None:
        """The running unit ends, having seen at most ``peak`` live activation bytes."""
        if self.current is not None:
            m = self.meas[self.current]
            m.peak_bytes = max(m.peak_bytes, peak)
        self.current = None

    def finish(self, hook_modules: Callable[[str], list], peak: int | None = None) -> dict[str, UnitMeasurement]:
        """The figures by unit, in entry order; ``peak`` closes the unit still running, and
        ``hook_modules(name)`` lists a unit's modules (those that ran are kept)."""
        if peak is not None:
            self.leave(peak)
        for n, m in self.meas.items():
            m.modules = frozenset(id(x) for x in hook_modules(n) if id(x) in self._modules)
        return dict(self.meas)


class OverBudget(RuntimeError):
    """Stops a measuring forward before it passes the budget (the engine re-plans or explains).

    ``kind`` is "weights" (a unit the forward entered is larger than the measuring slot) or
    "activations" (weights on the device plus live activation bytes would pass the budget)."""

    def __init__(self, kind: str, unit: str | None, weight_bytes: int, activation_bytes: int,
                 budget_bytes: int) -> None:
        self.kind, self.unit = kind, unit
        self.weight_bytes, self.activation_bytes, self.budget_bytes = weight_bytes, activation_bytes, budget_bytes
        super().__init__(f"{kind} over budget in unit {unit!r}: weights {weight_bytes} B + "
                         f"activations {activation_bytes} B > {budget_bytes} B")


class Meter:
    """Live and peak activation bytes. Subclasses read them from a backend."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def live(self) -> int:
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def peak(self) -> int:
        raise NotImplementedError


def _has_storage(a) -> bool:
    """A tensor with a storage of its own: not meta, not sparse, not a wrapper subclass (a
    quantized weight whose bytes are its inner tensors, counted when they are created)."""
    if not isinstance(a, torch.Tensor) or a.is_meta or a.layout != torch.strided:
        return False
    return is_plain_tensor(a) or not hasattr(a, "__tensor_flatten__")


class _LiveBytesMode(TorchDispatchMode):
    """Counts the storages that operators create and that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self.check = None  # called with the live bytes after each new storage (may raise)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in, _ = tree_flatten((args, kwargs))
        in_ptrs = {a.untyped_storage().data_ptr() for a in flat_in if _has_storage(a)}
        flat_out, _ = tree_flatten(out)
        for t in flat_out:
            if not _has_storage(t):
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in in_ptrs or ptr in self._seen or ptr == 0:
                continue  # a view or an in-place result: no new memory
            n = st.nbytes()
            self._seen.add(ptr)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._freed, ptr, n)
            if self.check is not None:
                self.check(self.live)
        return out

    def _freed(self, ptr: int, n: int) -> None:
        self._seen.discard(ptr)
        self.live -= n


class _PlainAlias(TorchFunctionMode):
    """Keeps ``torch.Tensor(subclass_tensor)`` a plain tensor while the dispatch mode above is
    active. Without a mode that constructor never reaches Python; with one it runs ``aten.alias``
    through the subclass's ``__torch_function__``, which turns the result back into the
    subclass and then calls its ``__init__`` without the metadata it requires (ComfyUI-GGUF's
    ``GGMLTensor`` does exactly this call on every layer output)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.alias.default:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class CPUMeter(Meter):
    """Live tensor bytes on CPU, tracked per operator (slow; used for measured forwards)."""

    def __init__(self, check=None) -> None:
        self._mode: _LiveBytesMode | None = None
        self._alias: _PlainAlias | None = None
        self._check = check  # called with the live bytes at every new storage (may raise)

    def start(self) -> None:
        self._alias = _PlainAlias()
        self._alias.__enter__()
        self._mode = _LiveBytesMode()
        self._mode.check = self._check
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self._alias is not None:
            self._alias.__exit__(None, None, None)
            self._alias = None

    def paused(self):
        """Context in which the executor's own copies and allocations are not counted."""
        from torch.utils._python_dispatch import _disable_current_modes
        return _disable_current_modes()

    def live(self) -> int:
        return self._mode.live if self._mode else 0

    def reset_peak(self) -> None:
        if self._mode:
            self._mode.peak = self._mode.live

    def peak(self) -> int:
        return self._mode.peak if self._mode else 0


class CUDAMeter(Meter):
    """The caching allocator's allocated bytes, less the executor's own buffers. A unit's peak
    is also taken in reserved bytes (blocks the allocator could not reuse: fragmentation, other
    streams' pools), the larger of the two: reserved is what other programs lose."""

    def __init__(self, device: torch.device, own_bytes) -> None:
        self.device = device
        self._own = own_bytes  # callable: bytes the executor holds on the device now
        self._reserved0 = 0

    def start(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        # reserved before the forward, less the executor's own: activations reuse it first
        self._reserved0 = torch.cuda.memory_reserved(self.device) - self._own()

    def stop(self) -> None:
        pass

    def live(self) -> int:
        return max(0, torch.cuda.memory_allocated(self.device) - self._own())

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        own = self._own()
        return max(0, torch.cuda.max_memory_allocated(self.device) - own,
                   torch.cuda.max_memory_reserved(self.device) - own - self._reserved0)
