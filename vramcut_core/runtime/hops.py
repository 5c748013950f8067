"""Hops: the tensors that cross from one device to another while a forward runs on several.

Owns the hooks that move a unit's inputs onto the device that computes it (and, where the rule
says so, its outputs back to the home device), the per-forward cache of tensors already moved,
and the count of what moved. A move is ``tensor.to(device)``: between two CUDA devices torch runs
the copy on the source device's current stream after an event barrier with the destination's
current stream, and makes the destination's current stream wait on an event after the copy, so
the consumer never reads the hop before its copy and the host never waits (no host sync).

Two rules, chosen per placement by a dry run on fake devices (``devices.check_hops``):

* ``KEEP``: a unit's outputs stay on its device; the next unit moves what it reads that is
  elsewhere. Cheap for a chain of blocks (a DiT's residual stream crosses once per cut); wrong
  for a model whose code between units mixes a unit's output with a tensor of another device.
* ``HOME``: a unit off the home device returns its outputs home; outer code only ever sees
  home tensors (a UNet's skip connections, concatenated outside any block). Always correct.

A unit's arguments are moved in place: a tensor inside a list or dict the caller passed (ComfyUI's
``transformer_options``, a patch's cache) is replaced in that same container for as long as the
unit computes and put back when it returns, so whatever the unit writes into its containers (a
new key, an appended item, a counter) is what the caller sees after it, exactly as on one device.
Only a tuple, which nobody can write into, is rebuilt. With the home rule, a tensor the unit wrote
into a caller's container is moved home when the unit returns, as its outputs are.

A unit is entered when the first of its modules is called from outside the unit (a UNet calls
a block's children directly, never the block): a per-unit depth counts its modules' calls, so
only the outermost call moves anything. A tensor read by several units (Flux's ``vec``, ``pe``)
moves once per forward and destination, unless it was written in place since (its version).

While a unit on another CUDA device than the current one computes, that device is current
(``torch.cuda.device``, entered at the unit's outermost call and left at its end, errors
included): what the model's code makes on "the" CUDA device (``device="cuda"``, a stream or
generator taken without naming a device) is made where the unit computes, as on one GPU. The
dry run on fake devices does not switch (``current=False``): fake tensors need no current device.

The one rule: hooks are removed in ``finally`` (``remove``), and outside an installed forward
nothing is moved. May call torch hooks and ``device_memory``'s placement seam.
"""
from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch
from torch.utils._pytree import tree_map

from . import device_memory

KEEP = "keep"
HOME = "home"


def _device_of(t: torch.Tensor) -> torch.device:
    """Where a tensor lives (a seam: the simulated accelerator reports its own devices)."""
    return t.device


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # an asynchronous peer copy, ordered by torch with events on both devices' current streams
    return t.to(device_memory._placement(device), non_blocking=True, copy=True)


class Hops:
    """The moves of one forward on several devices. ``units``: ``(Unit, device)`` in execution
    order; ``home``: where the inputs arrive and the output returns."""

    def __init__(self, units: Sequence[tuple[object, torch.device]], home: torch.device, rule: str,
                 device_of: Callable[[torch.Tensor], torch.device] | None = None,
                 move: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None,
                 current: bool = True) -> None:
        self.units = [(u, torch.device(d)) for u, d in units]
        self.home = torch.device(home)
        self.rule = rule
        self._device_of = device_of
        self._move = move
        self._hooks: list = []
        self._depth: dict[str, int] = {}
        self._current = current
        self._entered: dict[str, object] = {}   # unit -> its device's context, while it computes
        self._slots: dict[str, list] = {}       # unit -> what it moved in the caller's containers
        self._cache: dict[tuple[int, torch.device], tuple[weakref.ref, int, torch.Tensor]] = {}
        self.moves: dict[tuple[str, str, str], int] = {}   # (src, dst, unit) -> bytes moved this forward
        self.count = 0                                       # moves this forward

    # -- what moves ------------------------------------------------------------------------

    def where(self, t: torch.Tensor) -> torch.device:
        return (self._device_of or _device_of)(t)

    def to(self, x, device: torch.device, unit: str):
        """``x`` (any nesting of tensors) with every tensor of the compute device's type that is
        elsewhere moved to ``device`` (once per forward per tensor and destination)."""
        def one(t):
            if not isinstance(t, torch.Tensor):
                return t
            src = self.where(t)
            if src.type != device.type or src == device:
                return t
            key = (id(t), device)
            hit = self._cache.get(key)
            if hit is not None and hit[0]() is t and hit[1] == t._version:
                return hit[2]
            moved = (self._move or _move)(t, device)
            # the copy lives as long as its source (a tensor the outer code keeps, read by every
            # block); the source is held weakly, so an activation that dies frees its copy too
            cache = self._cache
            self._cache[key] = (weakref.ref(t, lambda _r, k=key: cache.pop(k, None)), t._version, moved)
            k = (str(src), str(device), unit)
            self.moves[k] = self.moves.get(k, 0) + t.untyped_storage().nbytes()
            self.count += 1
            return moved
        return tree_map(one, x)

    @property
    def bytes(self) -> int:
        return sum(self.moves.values())

    # -- hooks -----------------------------------------------------------------------------

    def install(self) -> None:
        self.remove()
        self.moves, self.count = {}, 0
        home_back = self.rule == HOME
        for unit, dev in self.units:
            name = unit.name
            if home_back and dev == self.home:
                continue  # inputs arrive home and every other unit returns its outputs home
            back = home_back and dev != self.home
            for m in unit.hook_modules:
                self._hooks.append(m.register_forward_pre_hook(
                    lambda _m, a, k, _n=name, _d=dev: self._enter(_n, _d, a, k), with_kwargs=True))
                self._hooks.append(m.register_forward_hook(
                    lambda _m, _a, out, _n=name, _b=back: self._leave(_n, _b, out), always_call=True))

    def _enter(self, name: str, dev: torch.device, args, kwargs):
        d = self._depth.get(name, 0)
        self._depth[name] = d + 1
        if d:
            return None  # a call inside the unit: its inputs are where the unit computes
        if self._current and dev.type == "cuda":
            ctx = torch.cuda.device(dev)
            ctx.__enter__()
            self._entered[name] = ctx
        slots: list = []
        self._slots[name] = slots
        # the args tuple and the kwargs dict are the call's own: rebuilt/updated like any other
        seen: set = set()
        return self._in_place(args, dev, name, slots, seen), self._in_place(kwargs, dev, name, slots, seen)

    def _in_place(self, x, dev: torch.device, unit: str, slots: list, seen: set):
        """``x`` with its tensors moved to ``dev``: lists and dicts changed in place (each change
        recorded in ``slots`` to be put back), tuples rebuilt, anything else passed as it is."""
        if isinstance(x, torch.Tensor):
            return self.to(x, dev, unit)
        if isinstance(x, (list, dict)):
            if id(x) in seen:
                return x
            seen.add(id(x))
            items = x.items() if isinstance(x, dict) else enumerate(x)
            changes = []
            for k, v in items:
                nv = self._in_place(v, dev, unit, slots, seen)
                if nv is not v:
                    changes.append((k, v, nv))
            for k, v, nv in changes:
                x[k] = nv
                slots.append((x, k, v, nv))
            slots.append((x, None, None, None))   # a container the unit may write a tensor into
            return x
        if isinstance(x, tuple):
            new = [self._in_place(v, dev, unit, slots, seen) for v in x]
            if all(a is b for a, b in zip(new, x)):
                return x
            return type(x)(*new) if hasattr(x, "_fields") else type(x)(new)
        return x

    def _put_back(self, name: str, home: bool) -> None:
        """Put back what ``_enter`` moved into the caller's containers (where the unit did not
        overwrite it); with the home rule, move home any tensor the unit wrote into them."""
        slots = self._slots.pop(name, None)
        if not slots:
            return
        ours = {id(nv) for _c, k, _v, nv in slots if k is not None}
        for c, k, v, nv in reversed(slots):
            if k is None:
                continue
            if isinstance(c, dict):
                if k in c and c[k] is nv:
                    c[k] = v
            elif k < len(c) and c[k] is nv:
                c[k] = v
            else:   # the unit inserted before it: find it by identity
                for i, cur in enumerate(c):
                    if cur is nv:
                        c[i] = v
                        break
        if not home:
            return
        done = set()
        for c, k, _v, _nv in slots:
            if k is not None or id(c) in done:
                continue
            done.add(id(c))
            items = list(c.items()) if isinstance(c, dict) else list(enumerate(c))
            for key, cur in items:
                if isinstance(cur, torch.Tensor) and id(cur) not in ours:
                    src = self.where(cur)
                    if src.type == self.home.type and src != self.home:
                        c[key] = self.to(cur, self.home, name)

    def _leave(self, name: str, back: bool, out):
        d = self._depth[name] = max(0, self._depth.get(name, 1) - 1)
        if d:
            return None
        ctx = self._entered.pop(name, None)
        if ctx is not None:
            ctx.__exit__(None, None, None)
        self._put_back(name, back)
        if not back:
            return None
        return self.to(out, self.home, name)

    def output(self, out):
        """The forward's output, on the home device."""
        return self.to(out, self.home, "output")

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for ctx in reversed(list(self._entered.values())):   # a forward that ended inside a unit
            ctx.__exit__(None, None, None)
        self._entered.clear()
        for name in list(self._slots):   # the caller's containers as they were
            self._put_back(name, False)
        self._depth.clear()
        self._cache.clear()

    def summary(self) -> list[dict]:
        """This forward's hops, as the plan's JSON lists them."""
        return [{"src": s, "dst": d, "unit": u, "bytes": b} for (s, d, u), b in self.moves.items()]
