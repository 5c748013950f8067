"""Residency chosen by time: under the same budget, the units kept resident (and how the streamed
ones merge) that give the shortest predicted step, not the most resident bytes.

Pure (no torch). ``plan.build_plan`` keeps as many bytes resident as fit (largest first); that
minimises the bytes streamed, not the time: a streamed segment costs only the part of its copy
that the compute before it does not hide (``timeline.simulate``). ``by_time(plan, bytes_per_s)``
starts from that plan and searches residencies that fit the same budget, each planned with
``plan.plan_from_residency`` and timed with ``timeline.predict``:

1. seeds: the count-based plan; for each count m, m units streamed spread evenly over the
   forward's compute time (the rest resident, where that fits); and a greedy one: from what must
   stay resident, add the unit that saves the most predicted seconds per byte (of at most
   ``GREEDY_TRIES`` tried per step), while one saves time and fits;
2. local improvement from the best seed: add, drop, or swap one unit for another while that
   shortens the step (first improvement, at most ``MAX_EVALS`` residencies timed);
3. for each residency the window has two slots where they fit (else one, as the count-based
   rule), each the size of the largest streamed unit, today's grown size or all the room, whichever is
   faster
   (merging more units into one copy hides less of it).

The one rule: the answer is never slower than the count-based plan under the model (that plan is
the first candidate, and only a strictly faster one replaces it); ties keep fewer bytes streamed,
then fewer transfers. Without compute times for every unit a forward enters, or without a
bandwidth, the count-based plan comes back unchanged.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .plan import (NO_PREFETCH, WINDOW_SHARE, Plan, PlanOptions, PlanUnit, activation_reserve, make_plan,
                   plan_from_residency)
from .timeline import known, predict

MAX_EVALS = 800     # residencies timed at most per plan (the local pass stops there)
GREEDY_TRIES = 16   # units the greedy seed tries per step (a spread sample where there are more)
_EPS = 1e-12


def by_time(plan: Plan, bytes_per_s: float | None, options: PlanOptions = PlanOptions(),
            overlap: bool = True, session: bool = True) -> Plan:
    """The fastest plan under ``plan``'s budget over its units (see the module docstring);
    ``plan`` itself when it cannot be beaten or timed."""
    units = plan.units
    if (not bytes_per_s or bytes_per_s <= 0 or not units or not known(units) or not options.residency
            or not plan.streamed_order):
        return plan
    search = _Search(plan, bytes_per_s, options, overlap, session)
    return search.run()


def make_fastest_plan(units: list[PlanUnit], budget: int, options: PlanOptions = PlanOptions(),
                      bytes_per_s: float | None = None, split_unit: Callable[[str], list[PlanUnit] | None] | None = None,
                      warnings: Sequence[str] = (), overlap: bool = True, session: bool = True) -> Plan:
    """``plan.make_plan`` (the finer cut, ``BudgetError`` when nothing fits), then ``by_time``."""
    return by_time(make_plan(units, budget, options, split_unit, warnings), bytes_per_s, options, overlap, session)


def step_time(plan: Plan, bytes_per_s: float, overlap: bool = True, session: bool = True) -> float:
    return predict(plan, bytes_per_s, overlap, session).step_s


class _Search:
    def __init__(self, plan: Plan, bps: float, options: PlanOptions, overlap: bool, session: bool) -> None:
        self.base, self.bps, self.options, self.overlap, self.session = plan, bps, options, overlap, session
        self.units = plan.units
        self.budget = plan.budget_bytes
        self.act = activation_reserve(self.units) if plan.measured else 0
        self.must = frozenset(i for i, u in enumerate(self.units) if u.pinned)
        # units whose residency changes the time: entered, free to stream
        self.free = [i for i, u in enumerate(self.units) if u.entered and not u.pinned]
        self.warnings = tuple(w for w in plan.warnings if w != NO_PREFETCH)
        self.memo: dict[frozenset, tuple[tuple, Plan] | None] = {}
        self.evals = 0

    def key(self, p: Plan) -> tuple:
        return (step_time(p, self.bps, self.overlap, self.session), p.streamed_bytes_per_forward,
                p.transfers_per_forward)

    def better(self, a: tuple, b: tuple) -> bool:
        if a[0] < b[0] - _EPS * max(1.0, b[0]):
            return True
        return abs(a[0] - b[0]) <= _EPS * max(1.0, b[0]) and a[1:] < b[1:]

    def timed(self, res: frozenset) -> tuple[tuple, Plan] | None:
        """The fastest window for residency ``res``, or None when none fits."""
        if res in self.memo:
            return self.memo[res]
        self.evals += 1
        units = self.units
        w = sum(units[i].weight_bytes for i in res)
        base = max((units[i].weight_bytes for i in range(len(units)) if i not in res and units[i].entered), default=0)
        best = None
        for slots in ((2, 1) if self.options.prefetch else (1,)):
            spare = self.budget - w - self.act
            room = spare // slots
            if base > room:
                continue
            sizes = {base} if not base else {base, max(base, min(int(spare * WINDOW_SHARE), room)), room}
            for sb in sorted(sizes):
                p = plan_from_residency(units, self.budget, self.options, set(res), slots, sb,
                                        self.base.split, self.warnings)
                k = self.key(p)
                if best is None or self.better(k, best[0]):
                    best = (k, p)
            break  # one slot only where two do not fit (as the count-based rule)
        if base == 0 and best is None and w + self.act <= self.budget:
            p = plan_from_residency(units, self.budget, self.options, set(res), 0, 0, self.base.split, self.warnings)
            best = (self.key(p), p)
        self.memo[res] = best
        return best

    def run(self) -> Plan:
        start = (self.key(self.base), self.base)
        best = start
        seeds = [self.spread(m) for m in range(1, len(self.free) + 1)]
        seeds.append(self.greedy())
        for t in seeds:
            if t is not None and self.better(t[0], best[0]):
                best = t
        best = self.improve(best)
        return best[1] if best[1] is not self.base and self.better(best[0], start[0]) else self.base

    def spread(self, m: int) -> tuple[tuple, Plan] | None:
        """``m`` units streamed, spread evenly over the forward's compute time (each streamed copy
        then has about the same compute before it to hide behind); the rest resident."""
        free = self.free
        total = sum(self.units[i].compute_s for i in free) or 1.0
        picks, acc, k = set(), 0.0, 0
        for i in free:
            c = self.units[i].compute_s
            while k < m and (k + 0.5) * total / m < acc + c:
                picks.add(i)
                k += 1
            acc += c
        return self.timed(self.must | frozenset(i for i in free if i not in picks))

    def greedy(self) -> tuple[tuple, Plan] | None:
        res = self.must
        cur = self.timed(res)
        while cur is not None and self.evals < MAX_EVALS:
            pick = None
            out = [i for i in self.free if i not in res]
            if len(out) > GREEDY_TRIES:  # a sample spread over the forward, shifted every round
                shift = self.evals % len(out)
                out = [out[(shift + j * len(out) // GREEDY_TRIES) % len(out)] for j in range(GREEDY_TRIES)]
            for i in out:
                t = self.timed(res | {i})
                if t is None:
                    continue
                gain = (cur[0][0] - t[0][0]) / max(1, self.units[i].weight_bytes)
                if gain > 0 and (pick is None or gain > pick[0]):
                    pick = (gain, i, t)
            if pick is None:
                break
            res, cur = res | {pick[1]}, pick[2]
        return cur

    def improve(self, best: tuple[tuple, Plan]) -> tuple[tuple, Plan]:
        res = frozenset(i for s in best[1].segments if s.resident for i in s.units if i in self.free) | self.must
        improved = True
        while improved and self.evals < MAX_EVALS:
            improved = False
            out = [i for i in self.free if i not in res]
            ins = [i for i in self.free if i in res]
            moves = [res | {i} for i in out] + [res - {r} for r in ins] + \
                    [(res - {r}) | {i} for r in ins for i in out]
            for cand in moves:
                if self.evals >= MAX_EVALS:
                    break
                t = self.timed(frozenset(cand))
                if t is not None and self.better(t[0], best[0]):
                    best, res, improved = t, frozenset(cand), True
                    break
        return best
