"""Unit hooks: which module calls tell the executor that a unit runs.

Owns the forward pre-hooks it registers (and removes them when its executor is collected), and
what measuring forwards learnt about containment: whether every call of a unit's modules ran
inside a call of one of the unit's roots. The one rule: a hook holds the executor weakly (a
dropped executor, and its pinned masters, are never kept alive by the module) and does nothing
outside one of the executor's forwards. May call torch hooks and the executor's ``_enter``.
"""
from __future__ import annotations

import weakref
from typing import Callable

from ..model.units import Unit


class UnitHooks:
    """The pre-hooks of one executor's units, as few as each forward needs.

    A measuring forward hooks every module that reads a unit's tensors (it records entry order,
    the modules each unit ran, and activations per unit), and watches whether every call of a
    unit's modules happened inside a call of one of the unit's roots. Any other forward hooks
    only streamed units (entering a resident unit does nothing but what the previous streamed
    unit's entry already did), and of a streamed unit only its roots when every measuring
    forward saw it contained that way; else (a UNet's timestep-embed sequential calls its
    children directly, a unit never measured) every module. Kept while buffers are held;
    replaced when the set to hook changes."""

    def __init__(self, units: Callable[[str], Unit], owner) -> None:
        self._unit = units
        self._owner = weakref.ref(owner)  # hooks must not keep a dropped executor (and its pinned masters) alive
        self._hooks: list = []
        self._hooked: tuple | None = None
        self.contained: dict[str, bool] = {}  # unit -> every module call seen ran inside a root's call
        self._roots_active: dict[str, int] = {}
        self._uncontained: set[str] = set()
        weakref.finalize(self, _remove_all, self._hooks)  # collected without release: hooks go

    def install(self, plan, measuring: bool, resident: set[str]) -> None:
        if measuring:
            self._roots_active.clear()
            self._uncontained.clear()
            spec: tuple = ("measure",) + tuple(u.name for u in plan.units)
        else:
            spec = ("run",) + tuple((u.name, self.contained.get(u.name, False))
                                    for u in plan.units if u.name not in resident)
        if self._hooked == spec:
            return
        self.remove()
        self._hooked = spec
        hooks, ref = self._hooks, self._owner
        active, uncontained = self._roots_active, self._uncontained
        for pu in plan.units:
            name = pu.name
            unit = self._unit(name)
            if measuring:
                roots = frozenset(id(m) for _, m in unit.roots)

                def pre_m(mod, _args, _name=name, _roots=roots, _ref=ref):
                    ex = _ref()
                    if ex is None:
                        return
                    if ex.running and id(mod) not in _roots and not active.get(_name):
                        uncontained.add(_name)  # a module of the unit ran outside its roots
                    ex._enter(_name, mod)

                def root_in(_mod, _args, _name=name, _ref=ref):
                    ex = _ref()
                    if ex is not None and ex.running:
                        active[_name] = active.get(_name, 0) + 1

                def root_out(_mod, _args, _out, _name=name, _ref=ref):
                    ex = _ref()
                    if ex is not None and ex.running and active.get(_name):
                        active[_name] -= 1

                for m in unit.hook_modules:
                    hooks.append(m.register_forward_pre_hook(pre_m))
                for _, r in unit.roots:
                    hooks.append(r.register_forward_pre_hook(root_in))
                    hooks.append(r.register_forward_hook(root_out, always_call=True))
                continue
            if name in resident:
                continue

            def pre(mod, _args, _name=name, _ref=ref):
                ex = _ref()
                if ex is not None:
                    ex._enter(_name, mod)

            mods = [m for _, m in unit.roots] if self.contained.get(name) else unit.hook_modules
            for m in mods:
                hooks.append(m.register_forward_pre_hook(pre))

    def learn(self, order: list[str]) -> None:
        """After a measuring forward: a unit stays root-entered only if every measuring forward
        that entered it saw each of its module calls inside a call of one of its roots."""
        for n in order:
            ok = bool(self._unit(n).roots) and n not in self._uncontained
            self.contained[n] = self.contained.get(n, True) and ok

    def remove(self) -> None:
        _remove_all(self._hooks)
        self._hooked = None


def _remove_all(hooks: list) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()
