"""The budgeted segment plan.

Pure data and free functions (no torch): ``PlanUnit`` rows in execution order go in, a ``Plan``
comes out. The pipeline is: base plan (one segment per unit) -> choose residency under the budget
-> merge the resident runs into segments. ``make_plan`` adds the finer cut (a unit too large for
the budget is split into its children and planning starts again); ``min_budget`` is the smallest
budget for which it returns a plan, the number a ``BudgetError`` offers (``budget.budget_error`` writes
every such message).

The peak a plan promises is::

    resident weights + window (slots x slot size) + activation reserve

where the window is the segment running plus the one being prefetched (two slots) and the
activation reserve is the most live activation bytes any unit saw in a measured forward (cut
tensors and skip connections included). The plan minimises its cost within the budget: bytes
streamed per forward first, then transfers per forward.

* Residency. Units are made resident in a fixed priority order (units that must stay resident
  first, units a measured forward never ran last, largest first, ties by execution order), as
  many as fit after reserving a window of slots each the size of the largest unit left
  streaming. Then, in the room that
  window leaves, small units (at most ``SMALL_SHARE`` of the spare room, smallest first) that
  would each be a transfer of their own are kept resident too: each removes a transfer and
  streams fewer bytes. The spare room is ``budget - resident - activation reserve``.
* Slot size. A slot is at least the largest streamed unit and grows to ``WINDOW_SHARE`` of the
  spare room where the room allows, so that several units share one transfer.
* Merged streamed segments. Adjacent streamed units (in execution order) are merged greedily into
  one segment while it fits the slot: one copy, one event, one wait. Units a forward never enters
  and looped units (entered more than once per forward) stay segments of their own.

A larger budget never streams more bytes, and at equal streamed bytes never needs more transfers.
It can need more transfers when it streams fewer bytes (a 100 MiB unit and four 10 MiB units:
119 MiB streams 140 MiB in 2 transfers through one slot; 125 MiB keeps the 100 MiB unit resident
and streams 40 MiB in 4).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from .budget import BudgetError, budget_error, gib_text, gib_to_bytes

WINDOW_SHARE = 1 / 4   # a slot grows to this share of the spare room (more units per transfer)
SMALL_SHARE = 1 / 64   # a unit this small against the spare room is kept resident first when that
                       # removes a transfer
NO_PREFETCH = "budget leaves no room for prefetch: each streamed segment is copied, then run"


@dataclasses.dataclass(frozen=True)
class PlanUnit:
    """One unit as the planner sees it. ``peak_bytes``/``entry_bytes`` are None when the
    activations were not measured; ``entered`` is False for a unit a measured forward never ran
    (the encoder during a VAE decode): it is never prefetched and never counted as streamed."""

    name: str
    weight_bytes: int
    peak_bytes: int | None = None
    entry_bytes: int | None = None
    keep_resident: bool = False
    entered: bool = True
    calls: int = 1  # times a forward enters it; a streamed unit is copied that often
    # seconds of compute per forward, all passes together; None when not known (then residency
    # is chosen by bytes, never by time: see ``timeline``)
    compute_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Segment:
    """A contiguous run of units (indices into ``Plan.units``) loaded together."""

    units: tuple[int, ...]
    resident: bool
    weight_bytes: int
    activation_bytes: int | None
    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    prefetch: bool = True   # two streaming slots: the next unit is copied while one computes
    residency: bool = True  # keep as many units resident as fit
    block_bytes: int = 1    # the device allocator's block size: a grown slot is a multiple of it
                            # (unit figures come rounded), so the plan's figures are the allocator's


@dataclasses.dataclass(frozen=True)
class PlanTime:
    """What a plan predicts per forward (``timeline.predict``): ``predicted_s`` for the plan,
    ``resident_s`` for every unit resident (its compute alone), ``source`` of the units' compute
    times: "flops" (the dry run's count over the measured throughput) or "measured" (a real
    forward timed each unit); ``bound_s`` the least step any residency under the budget can reach
    under the model (``bound.lower_bound``): the plan is within ``gap`` of the fastest."""

    predicted_s: float
    resident_s: float
    source: str
    bound_s: float | None = None

    @property
    def gap(self) -> float | None:
        """``predicted_s / bound_s - 1``: how far the plan may be from the fastest residency."""
        if self.bound_s is None or self.bound_s <= 0:
            return None
        return max(self.predicted_s / self.bound_s - 1.0, 0.0)


@dataclasses.dataclass(frozen=True)
class Refit:
    """Why a plan was made again for a new budget (free memory moved): the new and old budgets."""

    reason: str
    budget_bytes: int
    previous_budget_bytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
    budget_bytes: int
    units: tuple[PlanUnit, ...]
    segments: tuple[Segment, ...]
    slots: int            # 0 (all resident), 1 (no room for prefetch) or 2
    slot_bytes: int
    measured: bool
    split: tuple[str, ...] = ()       # units that were cut finer to fit
    warnings: tuple[str, ...] = ()
    # where the activation figures came from before the first forward: "traced" (a dry run on
    # fake tensors) or "measured" (a real forward measured them; the dry run could not run)
    source: str | None = None
    time: PlanTime | None = None      # the predicted step, where compute times and bandwidth are known
    refit: Refit | None = None        # planned again because the budget moved (free memory)
    tiers: object | None = None       # under a RAM budget: each unit's host tier (``tiers.Tiers``)

    @property
    def resident_bytes(self) -> int:
        return sum(s.weight_bytes for s in self.segments if s.resident)

    @property
    def window_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def activation_reserve_bytes(self) -> int | None:
        return activation_reserve(self.units) if self.measured else None

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.window_bytes + (self.activation_reserve_bytes or 0)

    @property
    def streamed_bytes_per_forward(self) -> int:
        return sum(self.units[i].weight_bytes * self.units[i].calls for s in self.segments
                   if not s.resident for i in s.units if self.units[i].entered)

    @property
    def transfers_per_forward(self) -> int:
        """Copies per forward: one per streamed segment a forward enters, once per pass for a
        looped unit (it is a segment of its own)."""
        return sum(max(self.units[i].calls for i in s.units if self.units[i].entered)
                   for s in self.segments if not s.resident
                   and any(self.units[i].entered for i in s.units))

    @property
    def streamed_groups(self) -> tuple[tuple[str, ...], ...]:
        """The units of each streamed segment a forward enters (copied together), in the order
        they are fetched."""
        return tuple(g for s in self.segments if not s.resident
                     for g in [tuple(self.units[i].name for i in s.units if self.units[i].entered)] if g)

    @property
    def resident_units(self) -> tuple[str, ...]:
        return tuple(self.units[i].name for s in self.segments if s.resident for i in s.units)

    @property
    def streamed_order(self) -> tuple[str, ...]:
        """Units that stream, in the order they are fetched."""
        return tuple(self.units[i].name for s in self.segments if not s.resident
                     for i in s.units if self.units[i].entered)

    def segment_name(self, seg: Segment) -> str:
        first, last = self.units[seg.units[0]].name, self.units[seg.units[-1]].name
        return first if first == last else f"{first} … {last}"


REFIT_MARGIN = 0.10  # a budget this much above the one a plan was made for plans again (no churn below)
# a budget that fell below the plan's peak plans again this much below it, so that further small
# drops (another program taking memory a little at a time) keep the new plan
REFIT_DOWN_MARGIN = 0.05


def refit_budget(budget: int, previous: int, margin: float = REFIT_DOWN_MARGIN) -> int:
    """The budget to plan for when the budget moves from ``previous`` to ``budget``: a fall
    plans ``margin`` below the new budget (hysteresis on the way down), a rise plans for it."""
    return max(1, int(budget * (1 - margin))) if budget < previous else budget


def refit_reason(plan: Plan, budget: int, margin: float = REFIT_MARGIN) -> str | None:
    """Why ``plan`` must be made again for a new ``budget`` (free memory moved), or None when it
    is kept: it is kept while the budget still holds its peak and is not more than ``margin``
    above the budget it was made for (or nothing streams: more room cannot make it faster), so
    a budget that wobbles by a few MiB never re-plans."""
    if budget < plan.peak_bytes:
        return f"the budget fell to {gib_text(budget)} GiB, below the plan's peak {gib_text(plan.peak_bytes)} GiB"
    # a plan made below the budget (``refit_budget``'s margin) counts from the budget it was made under
    made_for = max(plan.budget_bytes, plan.refit.budget_bytes if plan.refit is not None else 0)
    if budget > made_for * (1 + margin) and plan.streamed_order:
        return (f"the budget grew to {gib_text(budget)} GiB, more than {margin:.0%} above the "
                f"{gib_text(made_for)} GiB the plan was made for")
    return None


def activation_reserve(units: Sequence[PlanUnit]) -> int:
    return max((u.peak_bytes or 0 for u in units), default=0)


class _Infeasible(Exception):
    def __init__(self, index: int | None, need: int) -> None:
        self.index, self.need = index, need


def _tightest(units: Sequence[PlanUnit]) -> tuple[int, int, int]:
    """(what must stay resident, one slot, activations): the smallest footprint of ``units``."""
    required = sum(u.weight_bytes for u in units if u.keep_resident)
    slot = max((u.weight_bytes for u in units if not u.keep_resident and u.entered), default=0)
    return required, slot, activation_reserve(units)


def _plan_error(units: Sequence[PlanUnit], index: int | None, budget: int, detail: str,
                min_budget_bytes: int | None) -> BudgetError:
    """The error for ``units`` (cut as fine as they go) not fitting ``budget``: what does not fit
    (activations or weights) and the smallest budget that works (exact when the activations are
    known: it is what ``make_plan`` needs)."""
    required, slot, act = _tightest(units)
    measured = all(u.peak_bytes is not None for u in units)
    if measured and act > required + slot:
        unit = max(units, key=lambda u: u.peak_bytes or 0).name
        return budget_error(unit, budget, kind="activations", weight_bytes=required + slot, activation_bytes=act,
                            min_budget_bytes=min_budget_bytes, exact=measured)
    name = units[index].name if index is not None else "units that must stay resident"
    w = units[index].weight_bytes if index is not None else required
    return budget_error(name, budget, kind="weights", weight_bytes=w, activation_bytes=act if measured else None,
                        min_budget_bytes=min_budget_bytes, exact=measured, detail=detail)


def _priority(units: Sequence[PlanUnit]) -> list[int]:
    return sorted(range(len(units)), key=lambda i: (not units[i].keep_resident, not units[i].entered,
                                                  -units[i].weight_bytes, i))


def _mergeable(u: PlanUnit) -> bool:
    """Can the unit share a streamed segment with its neighbours? Not when a forward never enters
    it (it is never loaded) or enters it more than once (it is copied on every pass)."""
    return u.entered and u.calls == 1 and not u.keep_resident


def _lone(units: Sequence[PlanUnit], resident: set[int], i: int) -> bool:
    """Would streamed unit ``i`` be a segment of its own (no streamed neighbour to merge with)?"""
    return all(not (0 <= j < len(units)) or j in resident or not _mergeable(units[j]) for j in (i - 1, i + 1))


def _small_residents(units: Sequence[PlanUnit], resident: set[int], room: int, spare: int) -> set[int]:
    """Small units kept resident in ``room`` bytes, smallest first: each would be a transfer of its
    own, so keeping it removes a transfer and streams fewer bytes. Taken while they fit (a prefix
    of the smallest-first order: a larger room keeps a superset)."""
    small = sorted((units[i].weight_bytes, i) for i in range(len(units))
                   if i not in resident and _mergeable(units[i])
                   and units[i].weight_bytes <= spare * SMALL_SHARE and _lone(units, resident, i))
    out: set[int] = set()
    for w, i in small:
        if w > room:
            break  # smallest first: nothing later fits either
        out.add(i)
        room -= w
    return out


def choose_residency(units: Sequence[PlanUnit], budget: int, options: PlanOptions
                     ) -> tuple[set[int], int, int]:
    """Resident unit indices, slot count and slot size for the budget.

    Raises ``_Infeasible`` with the unit that does not fit when even the tightest plan (the units that
    must stay resident, one slot) is over the budget.
    """
    n = len(units)
    act = activation_reserve(units)
    order = _priority(units)
    n_required = sum(1 for u in units if u.keep_resident)
    # suffix max of weights in priority order: the slot size when the first k are resident
    suffix = [0] * (n + 1)
    prefix = [0] * (n + 1)
    for j in range(n):
        prefix[j + 1] = prefix[j] + units[order[j]].weight_bytes

    for j in range(n - 1, -1, -1):  # a unit the forward never enters is never loaded: no slot for it
        suffix[j] = max(suffix[j + 1], units[order[j]].weight_bytes if units[order[j]].entered else 0)

    def need(k: int, slots: int) -> int:
        s = suffix[k]
        return prefix[k] + (slots * s if k < n else 0) + act

    last = n if options.residency else n_required
    slots = 2 if options.prefetch else 1
    best = None
    tight = False
    for k in range(n_required, last + 1):
        if need(k, slots) <= budget:
            best = k
    if options.residency and need(n, 0) <= budget:
        best = n  # everything resident
    if best is None and slots == 2 and need(n_required, 1) <= budget:
        slots, best, tight = 1, n_required, True  # no room for prefetch, nothing else resident
    if best is None:
        if n_required and prefix[n_required] + act > budget:
            big = max(range(n), key=lambda i: (units[i].keep_resident, units[i].weight_bytes))
            raise _Infeasible(big if units[big].keep_resident else None, prefix[n_required] + act)
        streamed = order[n_required:]
        big = max(streamed, key=lambda i: (units[i].entered, units[i].weight_bytes))
        raise _Infeasible(big, need(n_required, 1))
    resident = set(order[:best])
    if best == n:
        return resident, 0, 0
    spare = budget - prefix[best] - act
    room = spare - slots * suffix[best]  # what the smallest window leaves (less than the next unit)
    if options.residency and not tight:
        extra = _small_residents(units, resident, room, spare)
        resident |= extra
        room -= sum(units[i].weight_bytes for i in extra)
    base = max((units[i].weight_bytes for i in range(n) if i not in resident and units[i].entered), default=0)
    if not base:
        return resident, slots, 0  # nothing a forward enters streams
    grown = min(int(spare * WINDOW_SHARE), (room + slots * suffix[best]) // slots)
    grown -= grown % options.block_bytes
    return resident, slots, max(base, grown)


def merge_streamed(units: Sequence[PlanUnit], resident: set[int], slot_bytes: int) -> list[tuple[list[int], bool]]:
    """Segments in execution order, as (unit indices, resident): resident runs merged, adjacent
    streamed units merged greedily while the segment fits ``slot_bytes`` (next fit: the fewest
    segments for a run, and never more for a larger slot)."""
    segs: list[tuple[list[int], bool]] = []
    cur: list[int] = []
    cur_res: bool | None = None
    cur_bytes = 0
    for i, u in enumerate(units):
        res = i in resident
        if res:
            if cur and cur_res:
                cur.append(i)
                continue
        elif (cur and cur_res is False and _mergeable(u) and _mergeable(units[cur[-1]])
              and cur_bytes + u.weight_bytes <= slot_bytes):
            cur.append(i)
            cur_bytes += u.weight_bytes
            continue
        if cur:
            segs.append((cur, bool(cur_res)))
        cur, cur_res, cur_bytes = [i], res, u.weight_bytes
    if cur:
        segs.append((cur, bool(cur_res)))
    return segs


def build_plan(units: Sequence[PlanUnit], budget: int, options: PlanOptions = PlanOptions(),
               split: Sequence[str] = (), warnings: Sequence[str] = ()) -> Plan:
    """Plan ``units`` (in execution order) under ``budget`` bytes; raises ``_Infeasible``."""
    if not units:
        return Plan(budget, (), (), 0, 0, False, tuple(split), tuple(warnings))
    resident, slots, slot_bytes = choose_residency(units, budget, options)
    return plan_from_residency(units, budget, options, resident, slots, slot_bytes, split, warnings)


def plan_from_residency(units: Sequence[PlanUnit], budget: int, options: PlanOptions, resident: set[int],
                        slots: int, slot_bytes: int, split: Sequence[str] = (), warnings: Sequence[str] = ()
                        ) -> Plan:
    """The plan with this residency and window: resident runs merged, streamed units merged into
    ``slot_bytes`` (``merge_streamed``). The caller has checked that it fits ``budget``."""
    measured = all(u.peak_bytes is not None for u in units)
    fixed = sum(units[i].weight_bytes for i in resident) + slots * slot_bytes

    def seg_of(idx: list[int], res: bool) -> Segment:
        w = sum(units[i].weight_bytes for i in idx)
        a = max((units[i].peak_bytes for i in idx), default=0) if measured else None
        return Segment(tuple(idx), res, w, a, fixed + (a or 0))

    segs = [seg_of(idx, res) for idx, res in merge_streamed(units, resident, slot_bytes)]
    notes = list(warnings)
    if options.prefetch and slots == 1:
        notes.append(NO_PREFETCH)
    return Plan(budget, tuple(units), tuple(segs), slots, slot_bytes, measured, tuple(split), tuple(notes))


def measuring_plan(units: Sequence[PlanUnit], budget: int, slot_bytes: int, split: Sequence[str] = (),
                   warnings: Sequence[str] = ()) -> Plan:
    """The plan of a measuring forward: the units that must stay resident resident, every other
    unit streamed through one slot of ``slot_bytes``, nothing prefetched. Units larger than the slot stay in the plan
    (a forward that never enters them never needs them); the executor stops a forward that
    enters one."""
    segs: list[Segment] = []
    run: list[int] = []
    resident = sum(u.weight_bytes for u in units if u.keep_resident)
    streams = any(not u.keep_resident for u in units)
    fixed = resident + (slot_bytes if streams else 0)

    def seg_of(idx: list[int], res: bool) -> Segment:
        return Segment(tuple(idx), res, sum(units[i].weight_bytes for i in idx), None, fixed)

    for i, u in enumerate(units):
        if u.keep_resident:
            run.append(i)
            continue
        if run:
            segs.append(seg_of(run, True))
            run = []
        segs.append(seg_of([i], False))
    if run:
        segs.append(seg_of(run, True))
    return Plan(budget, tuple(units), tuple(segs), 1 if streams else 0, slot_bytes if streams else 0,
                False, tuple(split), tuple(warnings))


def make_plan(units: list[PlanUnit], budget: int, options: PlanOptions = PlanOptions(),
              split_unit: Callable[[str], list[PlanUnit] | None] | None = None,
              warnings: Sequence[str] = ()) -> Plan:
    """``build_plan`` with the finer cut: while a unit cannot fit, replace it by its parts
    (``split_unit(name)`` returns them, or None when it cannot be cut). Raises ``BudgetError``
    with the smallest budget for which this call would return a plan (``min_budget``)."""
    if not (isinstance(budget, int) and budget > 0):
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
    plan = _plan_or_failure(units, budget, options, split_unit, warnings)
    if isinstance(plan, Plan):
        return plan
    cut, index, detail = plan
    raise _plan_error(cut, index, budget, detail, min_budget(units, options, split_unit)) from None


def _plan_or_failure(units: Sequence[PlanUnit], budget: int, options: PlanOptions,
                     split_unit: Callable[[str], list[PlanUnit] | None] | None, warnings: Sequence[str] = ()
                     ) -> "Plan | tuple[list[PlanUnit], int | None, str]":
    """The plan, or (units as finely cut as they went, the index that does not fit, why)."""
    split: list[str] = []
    units = list(units)
    while True:
        try:
            return build_plan(units, budget, options, split, warnings)
        except _Infeasible as e:
            parts = None
            if e.index is not None and split_unit is not None and not units[e.index].keep_resident:
                parts = split_unit(units[e.index].name)
            if not parts:
                detail = "cannot be cut finer"
                if e.index is None or units[e.index].keep_resident:
                    detail = "it must stay resident"
                return units, e.index, detail
            split.append(units[e.index].name)
            units[e.index:e.index + 1] = parts


def min_budget(units: Sequence[PlanUnit], options: PlanOptions = PlanOptions(),
               split_unit: Callable[[str], list[PlanUnit] | None] | None = None) -> int | None:
    """The smallest budget in bytes for which ``make_plan(units, budget, options, split_unit)``
    returns a plan, such that its ``max_vram_gb`` text (``gib_text``, rounded up at the widget's
    precision) read back as bytes plans too. None when no budget works.

    Found by bisection over bytes: a plan that fits a budget fits any larger one (the finer cut
    splits the same units in the same order whatever the budget, and every need is a sum that
    does not depend on it). The answer and its rounded text are checked by planning at them, so a
    break of that order could only make the number larger, never one that fails."""
    feasible = lambda b: isinstance(_plan_or_failure(units, b, options, split_unit), Plan)  # noqa: E731
    hi = 2 * sum(u.weight_bytes for u in units) + activation_reserve(units) + 1
    if not feasible(hi):
        return None
    lo = 0  # infeasible (budgets are positive)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    for _ in range(1000):  # the widget's value must plan too: step up one rounding unit at a time
        if feasible(gib_to_bytes(gib_text(hi))):
            return hi
        hi = gib_to_bytes(gib_text(hi)) + 1
    return None
