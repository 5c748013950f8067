"""The plan across devices: contiguous runs of units placed on devices, each under its own budget.

Pure data and free functions (no torch), in the shape of ``plan``. ``place(units, devices)``
gives each device of ``devices`` (``(name, budget bytes)``, in the order the forward visits them)
a contiguous run of the units, possibly none, and plans each run on its device with
``plan.build_plan`` (its resident segments, its streaming slots and the activations of the units
it computes, within its budget); what fits no device's residency streams from host memory to the
device that computes it. At each boundary between devices the live activations cross the cut:
the hop's bytes are the first unit's ``entry_bytes`` on the next device (the live activation bytes
when that unit starts: the residual stream, the context, skip connections held for later units);
a unit whose activations were not measured counts 0 there, and the placement says so
(``Placement.hop_bytes_known``).

The placement chosen has the fewest host-link bytes per forward, then the fewest hops, then the
fewest hop bytes, then the shortest predicted step where ``bytes_per_s`` is given and every unit
has its compute time (each device's plan through ``timeline.predict``, summed: a device's copies
taken as hidden only behind its own compute), then the most units on the devices named first
(exact, by dynamic programming over the cut points). One device gives exactly ``plan.make_plan``'s
plan (the finer cut included). A set of budgets too small in total is refused with a
``BudgetError`` of its own (``devices_error``): the budgets given, and the smallest budgets that
work in the same proportions, per device and in all, in ``max_vram_gb``'s GiB (``budget.gib_text``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from .budget import WEIGHTS_ALONE, BudgetError, gib_given_text, gib_text, gib_to_bytes
from .plan import REFIT_MARGIN, Plan, PlanOptions, PlanUnit, _Infeasible, build_plan, make_plan, refit_reason
from .timeline import known, predict


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """One device's part: units ``first`` .. ``stop - 1`` of the placement's units, planned under
    its budget (``plan.units`` are those units; ``plan`` is None for a device given none)."""

    device: str
    budget_bytes: int
    first: int
    stop: int
    plan: Plan | None


@dataclasses.dataclass(frozen=True)
class Hop:
    """The activations crossing from ``src`` to ``dst`` before unit ``unit`` runs."""

    src: str
    dst: str
    unit: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Placement:
    units: tuple[PlanUnit, ...]
    devices: tuple[DevicePlan, ...]
    hops: tuple[Hop, ...]
    hop_bytes_known: bool = True

    @property
    def host_bytes_per_forward(self) -> int:
        return sum(d.plan.streamed_bytes_per_forward for d in self.devices if d.plan is not None)

    @property
    def hop_bytes_per_forward(self) -> int:
        return sum(h.bytes for h in self.hops)

    @property
    def used(self) -> tuple[DevicePlan, ...]:
        return tuple(d for d in self.devices if d.plan is not None)


def refit_reasons(placement: Placement, budgets: dict[str, int]) -> list[str]:
    """Why ``placement`` must be made again for new ``budgets`` (device -> bytes), one line per
    device whose part no longer holds (``plan.refit_reason``; a device given nothing: its budget
    grew past the margin while something streams); empty when every part still holds. One device
    is a placement of one (its line names no device)."""
    many = len(placement.devices) > 1
    whys = []
    for d in placement.devices:
        new = budgets[d.device] if many or d.device in budgets else next(iter(budgets.values()))
        if d.plan is not None:
            why = refit_reason(d.plan, new)
        elif new > d.budget_bytes * (1 + REFIT_MARGIN) and placement.host_bytes_per_forward:
            why = f"the budget grew to {gib_text(new)} GiB"
        else:
            why = None
        if why:
            whys.append(f"{d.device}: {why}" if many else why)
    return whys


def parse_devices(text: str, known: Callable[[str], bool] | None = None, free: bool = False
                  ) -> list[tuple[str, int | None]]:
    """``"cuda:0=8, cuda:1=6.5"`` as ``[(device, budget bytes)]`` (GiB in, bytes out).

    Strict: every entry is ``DEVICE=GIB``; a device is ``cuda:N`` (or ``cpu``), named once, and
    ``known(device)`` (when given) must accept it; a budget is a positive number of GiB, or
    ``free`` where ``free`` is True (it comes back as None: free memory less a reserve, known only
    to the caller). Raises ValueError with the entry at fault."""
    import re

    from .budget import gib_to_bytes

    out: list[tuple[str, int | None]] = []
    if not text or not text.strip():
        raise ValueError("devices: empty (write DEVICE=GIB, e.g. cuda:0=8,cuda:1=8)")
    for raw in text.split(","):
        entry = raw.strip()
        if "=" not in entry:
            raise ValueError(f"devices: {entry!r} is not DEVICE=GIB (e.g. cuda:0=8)")
        dev, _, val = (p.strip() for p in entry.partition("="))
        if not re.fullmatch(r"cuda:\d+|cpu", dev):
            raise ValueError(f"devices: unknown device {dev!r} (write cuda:N or cpu)")
        if known is not None and not known(dev):
            raise ValueError(f"devices: {dev} is not a device this host can see")
        if any(d == dev for d, _ in out):
            raise ValueError(f"devices: {dev} is named twice")
        if val.lower() == "free":
            if not free:
                raise ValueError(f"devices: {dev}=free needs the device's free memory, which is only "
                                 "known where the device is (give a number of GiB)")
            out.append((dev, None))
            continue
        try:
            out.append((dev, gib_to_bytes(val)))
        except ValueError:
            raise ValueError(f"devices: {dev}={val}: a budget is a positive number of GiB") from None
    return out


def place(units: Sequence[PlanUnit], devices: Sequence[tuple[str, int]], options: PlanOptions = PlanOptions(),
          split_unit: Callable[[str], list[PlanUnit] | None] | None = None, warnings: Sequence[str] = (),
          bytes_per_s: float | None = None, home: str | None = None, held: Sequence[int] | None = None
          ) -> Placement:
    """The placement of ``units`` (in execution order) on ``devices``; see the module docstring.
    ``bytes_per_s``: the host-to-device bandwidth, for the predicted-time tie-break. ``held[k]``:
    the activation bytes that may live on the ``home`` device while unit ``k`` computes on another
    (what the forward keeps outside the units: a UNet's skip connections, the tensors a unit's
    inputs were moved from); the home device's part holds the largest of them beside its own.
    Raises ``BudgetError`` when no placement fits, ValueError for no devices or a bad budget."""
    units = tuple(units)
    if not devices:
        raise ValueError("place: no devices")
    for name, b in devices:
        if not (isinstance(b, int) and b > 0):
            raise ValueError(f"budget of {name} must be a positive number of bytes, got {b!r}")
    if len(devices) == 1:
        (name, b), = devices
        plan = make_plan(list(units), b, options, split_unit, warnings)
        return Placement(plan.units, (DevicePlan(name, b, 0, len(plan.units), plan),), ())
    timed = bytes_per_s if bytes_per_s and bytes_per_s > 0 and known(units) else None
    found = _best(units, devices, options, warnings, timed, home, held)
    if found is None:
        raise _refusal(units, devices, options, home, held)
    return found


def _best(units: tuple[PlanUnit, ...], devices: Sequence[tuple[str, int]], options: PlanOptions,
          warnings: Sequence[str], bytes_per_s: float | None = None, home: str | None = None,
          held: Sequence[int] | None = None) -> Placement | None:
    """Dynamic programming over cut points: best[j] after each device is the best placement of
    units[:j] on the devices so far, keyed (host bytes, hops, hop bytes, predicted seconds where
    ``bytes_per_s`` is given, device order)."""
    n = len(units)
    # state: j -> (key, [DevicePlan...], last device holding units or None)
    best: dict[int, tuple[tuple, list[DevicePlan], str | None]] = {0: ((0, 0, 0, 0.0, 0), [], None)}
    for index, (name, budget) in enumerate(devices):
        nxt: dict[int, tuple[tuple, list[DevicePlan], str | None]] = {}

        def offer(j, key, parts, last):
            if j not in nxt or key < nxt[j][0]:
                nxt[j] = (key, parts, last)

        at_home = held is not None and name == home
        for i, (key, parts, last) in best.items():
            if not at_home or max(held, default=0) <= budget:
                offer(i, key, parts + [DevicePlan(name, budget, i, i, None)], last)  # this device takes none
            for j in range(i + 1, n + 1):
                try:
                    plan = build_plan(units[i:j], budget, options, (), warnings)
                except _Infeasible:
                    break  # a longer run needs at least as much
                if at_home:
                    plan = _holding(units, i, j, held, budget, options, warnings, plan)
                    if plan is None:
                        continue  # what the others' units leave here does not fit beside it (a longer run may)
                hop = 0 if last is None else 1
                hb = 0 if last is None else (units[i].entry_bytes or 0)
                # last: units on earlier devices first (the first device is where the host expects the output)
                t = predict(plan, bytes_per_s).step_s if bytes_per_s else 0.0
                k = (key[0] + plan.streamed_bytes_per_forward, key[1] + hop, key[2] + hb, key[3] + t,
                     key[4] + index * (j - i))
                offer(j, k, parts + [DevicePlan(name, budget, i, j, plan)], name)
        best = nxt
    if n not in best:
        return None
    _, parts, _ = best[n]
    hops, prev = [], None
    for d in parts:
        if d.plan is None:
            continue
        if prev is not None:
            hops.append(Hop(prev, d.device, units[d.first].name, units[d.first].entry_bytes or 0))
        prev = d.device
    known = all(units[h_i].entry_bytes is not None for h_i in (d.first for d in parts if d.plan is not None))
    return Placement(units, tuple(parts), tuple(hops), known)


def _holding(units, i: int, j: int, held: Sequence[int], budget: int, options, warnings, plan: Plan) -> Plan | None:
    """The home device's plan of ``units[i:j]`` that also holds the bytes the other devices' units
    leave on it (``place``'s ``held``): its activation reserve the larger of its own and theirs
    (raised on its first unit's figure, so the plan's peak says it); None when that does not fit."""
    away = max((h for k, h in enumerate(held) if not i <= k < j), default=0)
    first = units[i]
    if first.peak_bytes is None or away <= (plan.activation_reserve_bytes or 0):
        return plan
    run = (dataclasses.replace(first, peak_bytes=max(first.peak_bytes, away)),) + tuple(units[i + 1:j])
    try:
        return build_plan(run, budget, options, (), warnings)
    except _Infeasible:
        return None


def _refusal(units, devices, options, home=None, held=None) -> BudgetError:
    """The smallest budgets in the proportions given (found by bisection on the scale, then
    checked at the GiB text the message gives), and the error naming them."""
    fits = lambda bs: _best(units, list(zip((n for n, _ in devices), bs)), options, (), None,  # noqa: E731
                            home, held) is not None
    scaled = lambda f: [max(1, int(b * f)) for _, b in devices]  # noqa: E731
    lo, hi = 1.0, 2.0
    while not fits(scaled(hi)):
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return devices_error(devices, None, exact=False)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(scaled(mid)) else (mid, hi)
    sug = [gib_to_bytes(gib_text(b)) for b in scaled(hi)]
    while not fits(sug):  # the text read back must place too: one rounding step up at a time
        sug = [gib_to_bytes(gib_text(b + 1)) for b in sug]
    measured = all(u.peak_bytes is not None for u in units)
    return devices_error(devices, [(n, b) for (n, _), b in zip(devices, sug)], exact=measured)


def devices_error(devices: Sequence[tuple[str, int]], suggestion: Sequence[tuple[str, int]] | None, *,
                  exact: bool, bound: str = WEIGHTS_ALONE, what: str | None = None) -> BudgetError:
    """The one place the text of a refusal with devices is written: the budgets given (rounded
    down: ``budget.gib_given_text``) and the smallest that work in the same proportions, per device
    and in all, in the Devices node's form (``cuda:0=…, cuda:1=…``; ``budget.gib_text``: rounded up
    at the widget's precision, each of them places), so that a budget given never reads as the
    smallest; "at least" with ``bound`` when the activations were not measured. ``what``: what
    does not fit, where a plan said it (``BudgetError.what``). ``min_budget_bytes`` is the suggestion's total,
    and ``device_budgets`` the suggestion itself."""
    given = ", ".join(f"{n}={gib_given_text(b)}" for n, b in devices)
    total = sum(b for _, b in devices)
    if len(devices) > 1:
        msg = f"VRAM budgets {given} ({gib_given_text(total)} GiB in all) are too small"
    else:
        msg = f"VRAM budget {given} is too small"
    msg += what if what is not None else ": no placement of the units fits"
    need = None
    many = len(devices) > 1
    if suggestion is None:
        msg += " at any budgets in these proportions"
    else:
        need = sum(b for _, b in suggestion)
        per = ", ".join(f"{n}={gib_text(b)}" for n, b in suggestion)
        in_all = f"{sum(float(gib_text(b)) for _, b in suggestion):.3f} GiB in all"
        if exact and many:
            msg += f"; the smallest budgets that work for this shape, in the same proportions, are {per} ({in_all})"
        elif exact:
            msg += f"; the smallest budget that works for this shape is {per}"
        elif many:
            msg += f"; in the same proportions the budgets must be at least {per} ({in_all}; {bound})"
        else:
            msg += f"; the budget must be at least {per} ({bound})"
    err = BudgetError("devices", need or total, total, kind="weights", message=msg)
    err.min_budget_bytes, err.exact = need, exact and need is not None
    err.device_budgets = tuple(suggestion) if suggestion is not None else None
    return err


def in_devices_form(e: BudgetError, devices: Sequence[tuple[str, int]]) -> BudgetError:
    """A refusal of an engine given devices, naming each device's own smallest budget in the
    Devices node's form (never ``max_vram_gb``, the setting the devices replace): a placement's
    refusal as it is; one device's plan refused with its smallest budget on that device; a plan
    of the devices' budgets summed (the weights-only plan drawn before a run) in the devices'
    proportions, at least that. An error that knows no budget that works stays as it is."""
    if not devices or e.device_budgets is not None or e.min_budget_bytes is None:
        return e
    total = sum(b for _, b in devices)
    need = e.min_budget_bytes
    if len(devices) == 1:
        sug = [(devices[0][0], need)]
    else:   # the sum's minimum, in the same proportions: a lower bound for a placement
        sug = [(n, gib_to_bytes(gib_text(max(1, -(-need * b // total))))) for n, b in devices]
    exact = e.exact and len(devices) == 1
    return devices_error(devices, sug, exact=exact, bound=e.bound, what=e.what)
