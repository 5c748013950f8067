"""The dry run: each unit's activation bytes before any weight moves.

``trace_units(module, units, fn, args, kwargs)`` runs ``fn`` (a forward of ``module``) once on
fake tensors (``FakeTensorMode``: shapes, dtypes and devices, no storage) at the real input
shapes, with every unit tensor replaced by a fake of itself on the compute device, and counts
the live activation bytes with torch's ``MemTracker`` (every storage an operator creates, freed
when it dies: temporaries inside one module, an attention's scores, a GELU's intermediate,
included). Units are entered the way the executor's measuring forward enters them (a pre-hook
on every module that reads a unit's tensors), so each figure means what ``UnitMeasurement``
means there: live bytes at entry, the most live bytes until the next unit is entered, how many
separate entries. The planner takes the result exactly like measurements.

The same run counts each unit's floating-point operations with torch's ``FlopCounterMode``
(matrix products, convolutions, attention: the operators that decide compute time; elementwise
operators are not counted). A unit's ``flops`` are what ran from its entry until the next unit's
entry, all passes together (what ran before the first unit goes to the first unit), so the units'
counts add up to the forward's. ``timeline.unit_seconds`` turns them into seconds with the
throughput ``bandwidth.matmul_throughput`` measured on this machine.

A host that merges weight patches (a LoRA) into each unit's device copy as it arrives passes
its hook (``on_loaded``, as the executor takes it): it runs on the fakes at the unit's first
entry, where the executor runs it, so what it allocates (a dequantised weight, the patch's delta,
the patched copy before it is quantised again) counts as that unit's activations, and the number
a refusal names holds them. A hook that cannot run on fakes fails the dry run like any operator.

The one rule: the user's model is never changed. Fake weights are set into the registries the
units record and the originals put back in ``finally``; attributes and registrations the fake
forward adds or replaces are undone too. A forward that cannot run on fakes (a data-dependent
operator, a tensor subclass without fake support) gives no figures and a reason: the engine
falls back to measuring with a real forward (``source`` "measured").
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from ..model import quant
from .meters import UnitMeasurement, UnitRecorder, _PlainAlias
from ..model.tensors import is_plain_tensor
from ..model.units import Unit

TRACED = "traced"
MEASURED = "measured"

_active = threading.local()


def tracing() -> bool:
    """True inside a dry run (on this thread): a call that reaches an engine from within one (a
    host whose model calls its own patched entry point, a VAE that tiles itself) runs plainly,
    on the fakes, and plans nothing."""
    return getattr(_active, "depth", 0) > 0


@dataclasses.dataclass(frozen=True)
class TraceResult:
    """Per-unit activation figures of a dry run (``measurements``, in the order the forward entered
    the units, as ``UnitMeasurement``), or ``reason`` why there are none."""

    measurements: dict[str, UnitMeasurement] | None
    peak_bytes: int = 0       # the most live activation bytes of the whole forward
    reason: str | None = None
    seconds: float = 0.0      # wall time of the dry run
    cpu_seconds: float = 0.0  # CPU time of this process during it

    @property
    def source(self) -> str:
        return TRACED if self.measurements is not None else MEASURED


def trace_units(module: nn.Module, units: Sequence[Unit], fn: Callable, args: tuple = (),
                kwargs: dict | None = None, device: torch.device | str | None = None,
                on_loaded: Callable | None = None) -> TraceResult:
    """Dry-run ``fn(*args, **kwargs)`` on fake tensors; see the module docstring.

    ``device`` is where the forward computes (the unit weights are faked there); by default the
    device of the first tensor argument, else of the first unit tensor. Tensor arguments on that
    device count as activations for the whole forward, as the measuring forward counts them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0, c0 = time.perf_counter(), time.process_time()
    kwargs = kwargs or {}
    dev = _compute_device(device, args, kwargs, units)
    # static shapes: the figures are for these shapes exactly; non-fake inputs (a tensor a module
    # keeps as a plain attribute) are faked on first use instead of failing the run
    mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True)
    state = _ModuleState(module)
    swapped: list[tuple] = []
    hooks: list = []
    try:
        fake_args, fake_kwargs = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        _fake_weights(mode, ((u, dev) for u in units), swapped)
        _keep_fakes_in_place(module)
        flops = _flop_counter()
        tracker = _UnitTracker(dev, flops, on_loaded, {u.name: u for u in units})
        flat, _ = tree_flatten((fake_args, fake_kwargs))
        inputs = [t for t in flat if isinstance(t, torch.Tensor) and t.device.type == dev.type]
        if inputs:
            tracker.track_external(*inputs)
        for u in units:
            for m in u.hook_modules:
                hooks.append(m.register_forward_pre_hook(
                    lambda mod, _a, _n=u.name: tracker.enter(_n, mod)))
        # One root above every module the call runs: MemTracker refuses a second call of a module
        # that has no tracked parent (a video VAE calls its decoder once per frame).
        root = _Call(fn, fake_args, fake_kwargs)
        # The alias guard the CPU meter needs for GGUF weights (see measure._PlainAlias).
        _active.depth = getattr(_active, "depth", 0) + 1
        try:
            with mode, _PlainAlias(), flops, tracker:
                root()
        finally:
            _active.depth -= 1
        meas = tracker.finish(units)
        return TraceResult(meas, tracker.forward_peak, None, time.perf_counter() - t0, time.process_time() - c0)
    except Exception as e:  # any failure means "not traced": the real forward measures
        return TraceResult(None, 0, f"{type(e).__name__}: {_first_line(e)}", time.perf_counter() - t0,
                           time.process_time() - c0)
    finally:
        for h in hooks:
            h.remove()
        _restore_weights(swapped)
        state.restore()


def _flop_counter():
    """torch's FLOP counter, silent, with its own attention formula also for the CPU kernel (a dry
    run on CPU dispatches ``_scaled_dot_product_flash_attention_for_cpu``, which torch's registry
    does not list; its count is the same as the flash kernel's)."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count

    def cpu_attention(query_shape, key_shape, value_shape, *_args, out_shape=None, **_kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)  # torch's formula, on shapes

    cpu_sdpa = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    extra = {cpu_sdpa: cpu_attention} if cpu_sdpa is not None and cpu_sdpa not in flop_registry else {}
    return FlopCounterMode(display=False, custom_mapping=extra)


def _first_line(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return s[0][:200] if s else ""


def _compute_device(device, args, kwargs, units) -> torch.device:
    if device is not None:
        return torch.device(device)
    flat, _ = tree_flatten((args, kwargs))
    for t in flat:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            return t.device
    for u in units:
        for ut in u.tensors:
            return ut.tensor.device
    return torch.device("cpu")


def _fake_weights(mode, placed, swapped: list) -> None:
    """Point every tensor of each ``(unit, device)`` of ``placed`` at a fake of it on that device,
    recording ``(ref, original)`` in ``swapped`` as it goes (so ``_restore_weights`` puts back what
    was swapped, also after a failure part-way)."""
    for u, dev in placed:
        for ut in u.tensors:
            fake = _fake_weight(mode, ut.tensor, dev)
            for r in ut.refs:
                swapped.append((r, r.get()))
                r.set(fake)


def _restore_weights(swapped: list) -> None:
    for r, orig in reversed(swapped):
        r.set(orig)


def _fake_weight(mode, t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A fake of ``t`` on ``dev`` that the model reads as it reads ``t``.

    A plain tensor keeps its type (a Parameter stays one). A quantized weight is faked part by
    part (``quant.parts``: the plain tensors holding its stored bytes), so the forward dequantizes
    it through its own code and the trace counts what that allocates. A wrapper subclass
    (comfy-kitchen's ``QuantizedTensor``) is rebuilt around the fake parts, as the executor
    rebuilds it around device copies. A plain subclass that keeps its bytes in its own storage
    (ComfyUI-GGUF's ``GGMLTensor``) cannot be a fake tensor and its own type at once: its fake is
    the raw bytes with the same attributes (``tensor_type``, ``tensor_shape``, ``patches``), which
    is all its dequantizing code reads; code that checks the type instead fails, and the trace
    with it. A format that cannot be taken apart has no fake: the trace fails with its name."""
    def fake_of(x: torch.Tensor) -> torch.Tensor:
        f = mode.from_tensor(x)
        if f.device != dev:
            with mode:
                f = f.to(dev)
        return f

    if is_plain_tensor(t):
        if type(t) is nn.Parameter:
            return nn.Parameter(fake_of(t.data), requires_grad=t.requires_grad)
        return fake_of(t)
    ps = quant.parts(t)
    if ps is None:
        raise TypeError(f"weights in {quant.format_name(t)} have no fake form")
    fakes = [fake_of(p) for p in ps]
    if quant.kind(t) == quant.FLATTEN:
        return quant.rebuild(t, fakes)
    (stand_in,) = fakes
    stand_in.__dict__.update(t.__dict__)
    return stand_in


def _keep_fakes_in_place(module: nn.Module) -> None:
    """Let a forward move a module to where its weights already are (HunyuanVideo 1.5 calls
    ``self.cond_type_embedding.to(txt.device)``): on real weights that is a no-op, but
    ``Module._apply`` swaps a fake parameter for its converted self even when nothing changes, and
    the swap fails on the weak references the fake mode keeps. Each module gets an instance-level
    ``_apply`` that leaves its tensors alone when the conversion returns every one of them as it
    is, and converts as usual otherwise; ``_ModuleState.restore`` removes it with the run."""
    for m in module.modules():
        def _apply(fn, recurse=True, _m=m, _orig=m._apply):
            if recurse:
                for c in _m.children():
                    c._apply(fn)
            own = [t for t in (*_m._parameters.values(), *_m._buffers.values()) if t is not None]
            with torch.no_grad():
                if all(fn(t) is t for t in own):
                    return _m
            return _orig(fn, recurse=False)
        m._apply = _apply


class _Call(nn.Module):
    def __init__(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self._call = (fn, args, kwargs)  # not a submodule: nothing of the model is registered here

    def forward(self):
        fn, args, kwargs = self._call
        return fn(*args, **kwargs)


def _tracker_base():
    from torch.distributed._tools.mem_tracker import MemTracker
    return MemTracker


class _UnitTracker(_tracker_base()):
    """MemTracker feeding the measuring forward's ``UnitRecorder``: live activation bytes
    (everything it tracks but parameters and buffers) at each unit entry, and the most of them
    until the next.

    ``_update_peak_stats`` is MemTracker's per-operator callback; it is replaced whole because its
    per-module local peaks (a walk over every module at every operator) are not used here."""

    def __init__(self, dev: torch.device, flops=None, on_loaded=None, units=None) -> None:
        super().__init__()
        self._on_loaded, self._units = on_loaded, units  # the host's hook on a fresh device copy
        self._merge_bytes: dict[str, int] = {}  # unit -> the most its hook held at once
        self._merge_peak = 0     # the running unit's peak while its hook ran
        self._kept = 0           # bytes the hook left alive: not activations (see ``_merge``)
        self._dev_type = dev.type
        self._flops = flops      # a FlopCounterMode: its total is read at each unit switch
        self._flops_seen = 0     # the total already given to a unit
        self.recorder = UnitRecorder()
        self._unit_peak = 0      # the most live bytes since the running unit was entered
        self.forward_peak = 0

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
        # no backward runs in a dry run, and a hook cannot be put on a weight that does not
        # require grad (frozen and quantized checkpoints): weights are counted, never hooked
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    def _live(self) -> int:
        from torch.distributed._tools.mem_tracker import _MemRefType

        n = 0
        for d, snap in self._curr_mem_snap.items():
            if d.type == self._dev_type:
                n += sum(v for k, v in snap.items() if k not in (_MemRefType.PARAM, _MemRefType.BUFFER, "Total"))
        return n - self._kept

    def _update_peak_stats(self, peak_state) -> None:  # noqa: ARG002 (MemTracker's signature)
        live = self._live()
        if live > self._unit_peak:
            self._unit_peak = live
        if live > self.forward_peak:
            self.forward_peak = live

    def enter(self, name: str, module: nn.Module) -> None:
        rec = self.recorder
        rec.saw(module)
        if name == rec.current:
            return
        self._leave()
        self._unit_peak = live = self._live()
        first = name not in rec.meas
        rec.enter(name, live)
        if self._flops is not None and rec.meas[name].flops is None:
            rec.meas[name].flops = 0
        if first and self._on_loaded is not None:
            self._merge(name, live)

    def _merge(self, name: str, live: int) -> None:
        """The host's hook on a fresh device copy of unit ``name`` (a LoRA merged into it), on the
        fakes, where the executor calls it: at the unit's entry, so its temporaries (a dequantised
        weight, the patch's delta, the patched copy) are this unit's activations. A part of a finer
        cut merges its own weights at its own entry, later in the unit, beside what the unit has
        computed by then: ``part_peak_bytes`` is the unit's peak without the merge plus the most
        the merge held at once."""
        self._on_loaded(self._units[name])
        self._merge_bytes[name] = self._unit_peak - live
        self._merge_peak = self._unit_peak
        # What the hook leaves alive is the host's, not the forward's: the patch's own tensors,
        # which the fake mode fakes on first use and keeps (a real merge writes into the copy and
        # leaves nothing on the device).
        self._kept += max(0, self._live() - live)
        self._unit_peak = self._live()

    def _leave(self) -> None:
        rec = self.recorder
        if rec.current is not None and self._flops is not None:  # what ran since the last switch
            total = self._flops.get_total_flops()                 # (before the first: too)
            rec.meas[rec.current].flops += total - self._flops_seen
            self._flops_seen = total
        merged = self._merge_bytes.get(rec.current, 0) if rec.current is not None else 0
        if merged:
            m = rec.meas[rec.current]
            m.part_peak_bytes = max(m.part_peak_bytes or 0, self._unit_peak + merged)
        rec.leave(max(self._unit_peak, self._merge_peak))
        self._merge_peak = 0

    def finish(self, units: Sequence[Unit]) -> dict[str, UnitMeasurement]:
        self._leave()
        by_name = {u.name: u for u in units}
        return self.recorder.finish(lambda n: by_name[n].hook_modules)


class _ModuleState:
    """What a fake forward may change on the modules (registries, plain attributes): taken before,
    put back after, so that no fake tensor and no side effect of the dry run stays in the model."""

    def __init__(self, module: nn.Module) -> None:
        self._saved = [(m, dict(m._parameters), dict(m._buffers), dict(vars(m))) for m in module.modules()]

    def restore(self) -> None:
        for m, params, bufs, attrs in self._saved:
            for store, old in ((m._parameters, params), (m._buffers, bufs)):
                if store.keys() != old.keys() or any(store[k] is not v for k, v in old.items()):
                    store.clear()
                    store.update(old)
            now = vars(m)
            for k in [k for k in now if k not in attrs]:
                del now[k]
            for k, v in attrs.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v


_MISSING = object()
