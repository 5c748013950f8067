"""Binding: pointing a unit's tensors at their device copies and back, nothing else.

Owns the record of what is swapped in (unit -> tensor index -> host master) and, for an
all-resident plan held between forwards, the undo list and the module guard that a finalizer
uses to point the module back at its masters. Plain tensors swap ``.data``; subclass tensors are
replaced at every reference; quantized tensors are rebuilt around their device parts (the layer
sees a new object of the same type, its metadata intact). The one rule: after a forward, an
error, an interrupt or the executor's collection, the module holds the same Parameter objects,
pointing at their masters. May call torch, ``quant``, ``tensors``, ``units``, ``layout`` and
``device_memory``'s ``DeviceCopy``.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from ..model import quant
from ..model.tensors import is_plain_tensor
from ..model.units import Unit
from .device_memory import DeviceCopy
from .layout import Layout


class Binding:
    """The pointer swaps of one executor's units."""

    def __init__(self, units: Callable[[str], Unit], layout: Callable[[str], Layout]) -> None:
        self._unit, self._layout = units, layout
        self.swapped: dict[str, dict[int, torch.Tensor]] = {}  # unit -> index -> host tensor
        self.held = None              # the plan whose weights stay swapped in between forwards
        self._undo: list = []         # (unit tensor, host master, plain): a finalizer's restore list
        self._guard: list = []        # the module's pre-hook while weights are held
        # Collected while it held weights: the module points at its masters again.
        weakref.finalize(self, _undo_held, self._undo, self._guard)

    def host(self, name: str, i: int) -> torch.Tensor:
        """The host master of tensor ``i`` of unit ``name`` (what it points at when not swapped)."""
        saved = self.swapped.get(name)
        if saved is not None and i in saved:
            return saved[i]
        t = self._unit(name).tensors[i].tensor
        return t.data if is_plain_tensor(t) else t

    def swap_in(self, name: str, dc: DeviceCopy) -> None:
        if name in self.swapped:
            return
        unit = self._unit(name)
        saved: dict[int, torch.Tensor] = {}
        other = self._layout(name).other
        for i, dev in dc.views.items():
            ut = unit.tensors[i]
            if i not in other:
                saved[i] = ut.tensor.data
                ut.tensor.data = dev
            else:
                saved[i] = ut.tensor
                new = dev
                if isinstance(ut.tensor, nn.Parameter) and not isinstance(dev, nn.Parameter):
                    new = nn.Parameter(dev, requires_grad=ut.tensor.requires_grad)
                for r in ut.refs:
                    r.set(new)
        for i, views in dc.parts.items():  # quantized: a new object around the device parts
            ut = unit.tensors[i]
            saved[i] = ut.tensor
            new = quant.rebuild(ut.tensor, views)
            if isinstance(ut.tensor, nn.Parameter):
                # not nn.Parameter(new): on a subclass that detaches it, and comfy-kitchen's detach
                # clones the scales, reading a slot the copy stream may still be writing into
                # memory the budget does not count
                new = quant.as_parameter(new)
            for r in ut.refs:
                r.set(new)
        self.swapped[name] = saved

    def swap_in_buffers(self, memory, loaded: Callable[[str, DeviceCopy], None]) -> None:
        """Point every unit the device buffers hold at its copy; ``loaded`` runs for resident ones."""
        for name, (_, dc) in memory.resident.items():
            self.swap_in(name, dc)
            loaded(name, dc)
        for s in memory.slots:
            for n, dc in s.copies.items():
                self.swap_in(n, dc)

    def swap_out(self, name: str) -> None:
        saved = self.swapped.pop(name, None)
        if saved is None:
            return
        unit = self._unit(name)
        lay = self._layout(name)
        other = lay.other
        for i, host in saved.items():
            ut = unit.tensors[i]
            if i not in other and i not in lay.quant:
                ut.tensor.data = host
            else:
                for r in ut.refs:
                    r.set(host)

    def restore_all(self) -> None:
        for name in list(self.swapped):
            self.swap_out(name)

    def resume(self, plan, fresh: bool) -> bool:
        """A forward of the held plan (``fresh``: not measuring, masters unchanged) swaps nothing;
        any other forward first points the held tensors back."""
        if self.held is None:
            return False
        if self.held is plan and fresh:
            return True
        self.drop_held()
        return False

    def hold(self, plan, module: nn.Module | None, on_foreign: Callable[[], None]) -> None:
        """Keep the swaps of ``plan`` between forwards. ``on_foreign`` (held weakly) runs before
        any forward of ``module``; it drops the hold unless the forward is the executor's."""
        self.held = plan
        undo = self._undo
        undo.clear()
        for name, saved in self.swapped.items():
            unit, lay = self._unit(name), self._layout(name)
            for i, host in saved.items():
                undo.append((unit.tensors[i], host, i not in lay.other and i not in lay.quant))
        if module is not None:
            ref = weakref.WeakMethod(on_foreign)

            def guard(_mod, _args, _ref=ref):
                fn = _ref()
                if fn is not None:
                    fn()

            self._guard.append(module.register_forward_pre_hook(guard))

    def drop_held(self) -> None:
        """Point every held tensor back at its master."""
        if self.held is None:
            return
        self.held = None
        self._undo.clear()
        for h in self._guard:
            h.remove()
        self._guard.clear()
        self.restore_all()


def _undo_held(undo: list, guard: list) -> None:
    """A binding collected while it held weights: the module points at its masters again."""
    for h in guard:
        h.remove()
    guard.clear()
    for ut, host, plain in undo:
        if plain:
            ut.tensor.data = host
        else:
            for r in ut.refs:
                r.set(host)
    undo.clear()
