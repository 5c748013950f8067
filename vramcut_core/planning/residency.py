"""Residency chosen by time: under the same budget, the units kept resident (and how the streamed
ones merge) that give the shortest predicted step, not the most resident bytes.

Pure (no torch). ``plan.build_plan`` keeps as many bytes resident as fit (largest first); that
minimises the bytes streamed, not the time: a streamed segment costs only the part of its copy
that the compute before it does not hide (``timeline.simulate``). ``by_time(plan, bytes_per_s)``
starts from that plan and searches residencies that fit the same budget, each planned with
``plan.plan_from_residency`` and timed with ``timeline.predict``:

1. seeds from a dynamic programme over the forward's units in execution order (``_stalls_dp``):
   which units stream, minimising their stalls plus a price per resident byte, where a streamed
   unit's copy hides behind the compute since its slot freed (two slots: since the streamed unit
   before it began, plus the carry that one's copy left; one slot: since it ended), path by
   path; the price is bisected to where the residency fits, for each size of the largest
   streamed unit and each slot count. And, for each count m, m units streamed spread evenly over
   the forward's compute time.
2. where at most ``EXACT_FREE`` units may stream, every residency (``every_residency``): exact
   under the model over the windows below up to ``EXACT_ALL`` units; above, each residency in
   its "base" window and the ``EXACT_KEPT`` fastest in every window (on 200 random models of 8 to
   12 units, tests/core/test_residency.py: within 5 % of trying every residency in every window;
   0.7 % at worst when written).
3. local improvement from the ``SEEDS_IMPROVED`` fastest: add or drop one unit, or move a
   streamed unit's place to a resident unit's (nearest first), while that shortens the step
   (first improvement, at most ``MAX_MOVES`` residencies timed per seed), each timed in every
   window. Above ``EXACT_FREE`` units this is a heuristic; its gap is bounded by
   ``bound.lower_bound`` (the least step any residency under the budget can reach under the
   model: the compute, the copies the copy stream must carry; ``PlanTime.gap`` on the plan): on
   the Flux-like 59-unit model of bench/bench_plan.py 5.7 % at 6 GiB, 2.6 % at 8 GiB, 0 at 12 GiB
   (the bound counts no stall, so it is loosest where copies are about as long as the compute).
   At 8 GiB the local pass given 3000 moves instead of ``MAX_MOVES`` (2 s of planning) reaches
   the bound: the 2.6 % there are the search's; at 6 GiB it finds nothing faster.
4. for each residency the window has two slots or one (both tried), each the size of the largest
   streamed unit, the count-based rule's grown size or all the room (``WINDOWS``), whichever is
   faster (merging more units into one copy hides less of it). Residencies are timed by
   ``_Search.window_time``, ``timeline.steady`` on plain lists (the plan is built once, for the
   answer), with ``latency_s`` per unit copied.

Planning time (bench/bench_plan.py, one CPU core): a Flux-like 59-unit model (Flux.1-dev's count)
0.27-0.29 s, 116 units 0.48-0.69 s (0.07 and 0.15 s before both slot counts and every window
were tried for each residency).

Under a RAM budget (``reads``): the streamed units read from their files are timed with their
reads (the reader lane, ``timeline.predict``'s ``reads``; or added whole where reads are not
hidden); ``joint.fastest`` iterates this search and ``tiers.choose`` to a fixed point.

The one rule: the answer is never slower than the count-based plan under the model (that plan is
the first candidate, and only a strictly faster one replaces it); ties keep fewer bytes streamed,
then fewer transfers. Without compute times for every unit a forward enters, or without a
bandwidth, the count-based plan comes back unchanged.
"""
from __future__ import annotations

from itertools import chain
from typing import Callable, Mapping, Sequence

from .plan import (NO_PREFETCH, WINDOW_SHARE, Plan, PlanOptions, PlanUnit, activation_reserve, make_plan,
                   _mergeable, plan_from_residency)
from .timeline import known, predict, steady

DP_PRICES = 12       # prices of a resident byte tried per largest streamed size (bisection)
SEEDS_IMPROVED = 2   # the fastest seeds the local pass starts from
MAX_MOVES = 400      # residencies the local pass times at most per seed
WINDOWS = ("base", "grown", "room")  # the slot sizes tried for a residency (``_Search.timed``)
_EPS = 1e-12
EXACT_FREE = 12     # at most this many units free to stream: every residency is timed
EXACT_ALL = 10      # ... in every window up to this many (exact); above, the fastest in one window
EXACT_KEPT = 32     # ... of which this many are timed in every window


def by_time(plan: Plan, bytes_per_s: float | None, options: PlanOptions = PlanOptions(),
            overlap: bool = True, session: bool = True, latency_s: float = 0.0,
            reads: Mapping[str, int] | None = None, disk_bytes_per_s: float | None = None,
            read_lane: bool = True) -> Plan:
    """The fastest plan under ``plan``'s budget over its units (see the module docstring);
    ``plan`` itself when it cannot be beaten or timed. ``reads``: the bytes one pass reads of
    each unit that is read from its file when it streams (its host tier is the disk), at
    ``disk_bytes_per_s``: timed on the reader lane (``read_lane``, ``timeline.predict``'s
    ``reads``) or, where reads are not hidden, added to the step whole."""
    units = plan.units
    if (not bytes_per_s or bytes_per_s <= 0 or not units or not known(units) or not options.residency
            or not plan.streamed_order):
        return plan
    if reads and (not disk_bytes_per_s or disk_bytes_per_s <= 0):
        raise ValueError(f"disk_bytes_per_s must be a positive rate, got {disk_bytes_per_s!r}")
    search = _Search(plan, bytes_per_s, options, overlap, session, latency_s, reads or {}, disk_bytes_per_s,
                     read_lane)
    return search.run()


def make_fastest_plan(units: list[PlanUnit], budget: int, options: PlanOptions = PlanOptions(),
                      bytes_per_s: float | None = None, split_unit: Callable[[str], list[PlanUnit] | None] | None = None,
                      warnings: Sequence[str] = (), overlap: bool = True, session: bool = True) -> Plan:
    """``plan.make_plan`` (the finer cut, ``BudgetError`` when nothing fits), then ``by_time``."""
    return by_time(make_plan(units, budget, options, split_unit, warnings), bytes_per_s, options, overlap, session)


def step_time(plan: Plan, bytes_per_s: float, overlap: bool = True, session: bool = True,
              latency_s: float = 0.0, reads: Mapping[str, int] | None = None,
              disk_bytes_per_s: float | None = None, read_lane: bool = True) -> float:
    """The predicted steady step of ``plan``; with ``reads`` (see ``by_time``) its streamed
    units' reads on the reader lane, or added whole (``read_lane`` False)."""
    out = set(plan.streamed_order) if reads else ()
    streamed = {u.name: reads[u.name] for u in plan.units if u.name in out and u.entered and u.name in reads}
    if not streamed:
        return predict(plan, bytes_per_s, overlap, session, latency_s).step_s
    if read_lane:
        return predict(plan, bytes_per_s, overlap, session, latency_s, streamed, disk_bytes_per_s).step_s
    calls = {u.name: u.calls for u in plan.units}
    return (predict(plan, bytes_per_s, overlap, session, latency_s).step_s
            + sum(b * calls[n] for n, b in streamed.items()) / disk_bytes_per_s)


class _Search:
    def __init__(self, plan: Plan, bps: float, options: PlanOptions, overlap: bool, session: bool,
                 latency_s: float = 0.0, reads: Mapping[str, int] | None = None,
                 disk_bps: float | None = None, read_lane: bool = True) -> None:
        self.base, self.bps, self.options, self.overlap, self.session = plan, bps, options, overlap, session
        self.lat = latency_s
        self.reads, self.disk_bps, self.lane = dict(reads or {}), disk_bps, read_lane
        units = self.units = plan.units
        self.budget = plan.budget_bytes
        self.act = activation_reserve(units) if plan.measured else 0
        self.must = frozenset(i for i, u in enumerate(units) if u.keep_resident)
        self.must_bytes = sum(units[i].weight_bytes for i in self.must)
        # units whose residency changes the time: entered, free to stream
        self.free = [i for i, u in enumerate(units) if u.entered and not u.keep_resident]
        self.warnings = tuple(w for w in plan.warnings if w != NO_PREFETCH)
        self.memo: dict[tuple, tuple | None] = {}
        self.c = [u.compute_s or 0.0 for u in units]
        self.w = [u.weight_bytes for u in units]
        self.wb = [u.weight_bytes * u.calls for u in units]
        self.calls = [u.calls for u in units]
        self.entered = [u.entered for u in units]
        self.mergeable = [_mergeable(u) for u in units]
        # per unit when it streams: its read (seconds, all passes; None: not read from a file) and
        # its copy (none where the read fills the slot itself: CPU, on the reader lane)
        rd = [self.reads[u.name] * u.calls / disk_bps if u.name in self.reads else None for u in units]
        self.rd = rd
        self.x = [0.0 if r is not None and not overlap and read_lane
                  else u.weight_bytes * u.calls / bps + self.lat * u.calls
                  for u, r in zip(units, rd)]
        self.evals = 0

    # -- timing one residency ----------------------------------------------------------------

    def window_time(self, res: frozenset, slots: int, slot_bytes: int) -> tuple:
        """(step seconds, bytes streamed, transfers) of residency ``res`` through ``slots`` slots of
        ``slot_bytes``: ``plan.merge_streamed``, ``timeline.plan_steps`` and ``predict`` in one pass
        without building the plan (adjacent resident segments are one step: the timeline runs them
        back to back). A test holds it equal to ``predict`` on the plan. A looped unit that streams
        (``walk.looped``): the plan built and timed as ``step_time`` times it (walked entry by entry)."""
        if self.overlap and any(self.calls[i] > 1 and self.entered[i] and i not in res for i in range(len(self.c))):
            p = self.plan_of(res, slots, slot_bytes)
            return (step_time(p, self.bps, True, self.session, self.lat, self.reads, self.disk_bps, self.lane),
                    p.streamed_bytes_per_forward, p.transfers_per_forward)
        c, wb, w, calls, entered, mergeable = self.c, self.wb, self.w, self.calls, self.entered, self.mergeable
        x, rd = self.x, self.rd
        compute: list[float] = []
        copy: list[float | None] = []
        read: list[float | None] = []
        sync: list[bool] = []
        streamed = transfers = 0
        kind = None          # the open segment: "r" resident, "s" streamed, None
        sc = 0.0             # its compute (units a forward enters)
        sb = sw = sn = 0     # streamed: bytes per forward, bytes in the slot, most calls
        sx, sr = 0.0, None   # streamed: copy seconds, read seconds (None: nothing read)
        live = False         # does a forward enter one of its units?
        last = False         # is its last unit mergeable?

        def close() -> None:
            nonlocal streamed, transfers
            if not live:
                return
            if kind == "r":
                if copy and copy[-1] is None:
                    compute[-1] += sc
                else:
                    compute.append(sc)
                    copy.append(None)
                    read.append(None)
                    sync.append(False)
            else:
                compute.append(sc)
                copy.append(sx)
                read.append(sr)
                sync.append(sn > 1)
                streamed += sb
                transfers += sn

        for i in range(len(c)):
            if i in res:
                if kind != "r":
                    close()
                    kind, sc, live = "r", 0.0, False
                if entered[i]:
                    sc += c[i]
                    live = True
                continue
            if kind == "s" and mergeable[i] and last and sw + w[i] <= slot_bytes:
                sw += w[i]
            else:
                close()
                kind, sc, sb, sw, sn, sx, sr, live = "s", 0.0, 0, w[i], 0, 0.0, None, False
            last = mergeable[i]
            if entered[i]:
                sc += c[i]
                sb += wb[i]
                sx += x[i]
                if rd[i] is not None:
                    sr = rd[i] if sr is None else sr + rd[i]
                sn = max(sn, calls[i])
                live = True
        close()
        n = len(compute)
        lane = self.lane and any(r is not None for r in read)
        t = steady(compute, copy, [0] * n, [0.0] * n, sync, {0: max(slots, 1)}, self.overlap, self.session,
                   read=read if lane else None)[0]
        if not self.lane:  # reads not hidden: each costs its time
            t += sum(r for r in read if r is not None)
        return (t, streamed, transfers)

    def timed(self, res: frozenset, kinds: tuple[str, ...] = WINDOWS) -> tuple | None:
        """(key, slots, slot size, window kind) of the fastest window for residency ``res``; None
        when none fits. Two slots where they fit (else one, as the count-based rule), each of one
        of ``kinds``: "base" the size of the largest streamed unit, "grown" the count-based rule's
        grown size, "room" all the room."""
        memo = (res, kinds)
        if memo in self.memo:
            return self.memo[memo]
        self.evals += 1
        units = self.units
        w = sum(units[i].weight_bytes for i in res)
        base = max((units[i].weight_bytes for i in self.free if i not in res), default=0)
        spare = self.budget - w - self.act
        best = None
        if base == 0:
            if spare >= 0:
                best = (self.window_time(res, 0, 0), 0, 0, kinds[0])
        else:
            for slots in ((2, 1) if self.options.prefetch else (1,)):
                room = spare // slots
                if base > room:
                    continue
                grown = min(int(spare * WINDOW_SHARE), room)
                grown = max(base, grown - grown % self.options.block_bytes)
                seen = set()
                for kind in kinds:
                    sb = {"base": base, "grown": grown, "room": room}[kind]
                    if sb in seen:
                        continue
                    seen.add(sb)
                    k = self.window_time(res, slots, sb)
                    if best is None or _better(k, best[0]):
                        best = (k, slots, sb, kind)
        self.memo[memo] = best
        return best

    def plan_of(self, res: frozenset, slots: int, slot_bytes: int) -> Plan:
        return plan_from_residency(self.units, self.budget, self.options, set(res), slots, slot_bytes,
                                   self.base.split, self.warnings)

    # -- the search ----------------------------------------------------------------------------

    def run(self) -> Plan:
        start = self.key(self.base)
        seeds = []
        for r in self.dp_seeds() + self.spread_seeds():
            t = self.timed(r)
            if t is not None:
                seeds.append((t, r))
        seeds += self.every_residency()
        if not seeds:
            return self.base
        best = None
        for t, r in sorted(seeds, key=lambda s: s[0][0])[:SEEDS_IMPROVED]:
            r = self.improve(r, None)
            t = self.timed(r)  # every window again for the residency found
            if best is None or _better(t[0], best[0][0]):
                best = (t, r)
        (key, slots, size, _), res = best
        if not _better(key, start):
            return self.base
        p = self.plan_of(res, slots, size)
        # the plan itself, timed as ``predict`` times it, must beat the count-based plan
        return p if _better(self.key(p), start) else self.base

    def key(self, p: Plan) -> tuple:
        """(step, bytes streamed, transfers) of plan ``p`` as ``predict`` times it, reads included."""
        t = step_time(p, self.bps, self.overlap, self.session, self.lat, self.reads, self.disk_bps, self.lane)
        return (t, p.streamed_bytes_per_forward, p.transfers_per_forward)

    def every_residency(self) -> list[tuple]:
        """Where few units may stream (``EXACT_FREE``), every residency that fits: up to
        ``EXACT_ALL`` of them each timed in every window (exact under the model, given the
        windows); more, each timed in its "base" window first and the ``EXACT_KEPT`` fastest then
        in every window."""
        n = len(self.free)
        if n > EXACT_FREE:
            return []
        every = [self.must | frozenset(self.free[k] for k in range(n) if mask >> k & 1) for mask in range(1 << n)]
        if n > EXACT_ALL:
            quick = [(t, r) for r in every if (t := self.timed(r, ("base",))) is not None]
            every = [r for _, r in sorted(quick, key=lambda q: q[0][0])[:EXACT_KEPT]]
        return [(t, r) for r in every if (t := self.timed(r)) is not None]

    def dp_seeds(self) -> list[frozenset]:
        """Residencies from ``_stalls_dp`` for each largest streamed size and a range of prices of
        a resident byte (bisected to where the residency fits)."""
        units, free = self.units, self.free
        out: dict[frozenset, None] = {}
        one_slot = not self.options.prefetch
        for cap in sorted({units[i].weight_bytes for i in free}):
            for slots in ((1,) if one_slot else (2, 1)):
                room = self.budget - self.act - self.must_bytes - slots * cap
                if room < 0:
                    continue
                sync = not self.overlap
                lo, hi = 0.0, 2.0 * max(units[i].calls / self.bps + (self.rd[i] or 0.0) / max(units[i].weight_bytes, 1)
                                        for i in free)
                for _ in range(DP_PRICES):
                    lam = (lo + hi) / 2
                    streamed, res_bytes = _stalls_dp(self, cap, lam, sync, room, slots)
                    if streamed is None:
                        break
                    if res_bytes <= room:
                        out[self.must | frozenset(i for i in free if i not in streamed)] = None
                        hi = lam
                    else:
                        lo = lam
        return list(out)

    def spread_seeds(self) -> list[frozenset]:
        """For each count m: m units streamed, spread evenly over the forward's compute time (each
        streamed copy then has about the same compute before it to hide behind); the rest
        resident. Only counts whose residency can fit are tried."""
        units, free = self.units, self.free
        total = sum(units[i].compute_s for i in free) or 1.0
        room = self.budget - self.act - self.must_bytes
        out = []
        for m in range(1, len(free) + 1):
            picks, acc, k = set(), 0.0, 0
            for i in free:
                c = units[i].compute_s
                while k < m and (k + 0.5) * total / m < acc + c:
                    picks.add(i)
                    k += 1
                acc += c
            if not picks:  # no compute to spread over (units that run no matrix product)
                continue
            held = sum(units[i].weight_bytes for i in free if i not in picks)
            if held + min(units[i].weight_bytes for i in picks) <= room:
                out.append(self.must | frozenset(i for i in free if i not in picks))
        return out

    def improve(self, res: frozenset, kind: str) -> frozenset:
        """Local moves from residency ``res`` while they shorten the step (its windows of ``kind``
        only): a unit made resident, a resident one streamed, or a streamed unit's place moved to a
        resident unit's, nearest first (first improvement, at most ``MAX_MOVES`` tried)."""
        kinds = (kind,) if kind is not None else WINDOWS
        best = self.timed(res, kinds)
        free = self.free
        pos = {i: k for k, i in enumerate(free)}
        tried = 0
        improved = True
        while improved and tried < MAX_MOVES:
            improved = False
            out = [i for i in free if i not in res]
            ins = [i for i in free if i in res]
            # nearest first: a place moved a unit or two, then farther ones while moves are left
            swaps = sorted((abs(pos[i] - pos[r]), i, r) for i in out for r in ins)
            moves = chain((res | {i} for i in out), (res - {r} for r in ins),
                          ((res - {r}) | {i} for _, i, r in swaps))
            for cand in moves:
                if tried >= MAX_MOVES:
                    break
                cand = frozenset(cand)
                if (cand, kinds) in self.memo:
                    continue
                tried += 1
                t = self.timed(cand, kinds)
                if t is not None and _better(t[0], best[0]):
                    best, res, improved = t, cand, True
                    break
        return res


def _stalls_dp(self: _Search, cap: int, lam: float, sync: bool, room: int,
               slots: int = 2) -> tuple[set[int] | None, int]:
    """The streamed units minimising (stall seconds + ``lam`` x free resident bytes), by dynamic
    programming over the forward's units in execution order, where a streamed unit's stall is
    its copy less the compute since the streamed unit before it began (its copy starts when
    that one's slot frees it; all of its copy when ``sync``), and a unit streams only if it
    holds at most ``cap`` bytes. Returns (streamed unit indices, free resident bytes)."""
    units = self.units
    order = [i for i, u in enumerate(units) if u.entered]
    m = len(order)
    c = [units[i].compute_s for i in order]
    w = [0 if units[i].keep_resident else units[i].weight_bytes for i in order]
    x = [self.x[i] + (self.rd[i] or 0.0) for i in order]  # a read delays its copy: a seed counts both
    can = [not units[i].keep_resident and units[i].weight_bytes <= cap for i in order]
    loop = [sync or units[i].calls > 1 for i in order]
    inf = float("inf")
    cost = [inf] * m
    carry = [0.0] * m  # on the chosen path: copy time the next copy had before this unit began
    back = [-1] * m
    for j in range(m):
        if not can[j]:
            continue
        best, arg, h = inf, -2, 0.0
        win, held = 0.0, 0  # compute and free resident bytes strictly between i and j
        for i in range(j - 1, -2, -1):
            if held > room:
                break
            if i < 0 or can[i]:
                if i < 0:  # the first copy is made during the forward before: taken as hidden
                    prev, avail = 0.0, inf
                elif slots == 1:  # its slot frees when the streamed unit before is done
                    prev, avail = cost[i], win
                else:
                    prev, avail = cost[i], carry[i] + c[i] + win
                stall = x[j] if loop[j] else max(0.0, x[j] - avail)
                v = prev + lam * held + stall
                if v < best:
                    best, arg, h = v, i, 0.0 if loop[j] else min(max(0.0, avail - x[j]), win)
            if i >= 0:
                win += c[i]
                held += w[i]
        cost[j], back[j], carry[j] = best, arg, h
    best, last, held = inf, None, 0
    for j in range(m - 1, -1, -1):
        if can[j] and cost[j] + lam * held < best:
            best, last = cost[j] + lam * held, j
        held += w[j]
        if held > room:
            break
    if last is None:
        return None, 0
    streamed = set()
    j = last
    while j >= 0:
        streamed.add(order[j])
        j = back[j]
    res_bytes = sum(units[i].weight_bytes for i in self.free if i not in streamed)
    return streamed, res_bytes


def _better(a: tuple, b: tuple) -> bool:
    """Strictly faster (beyond float rounding), or as fast with fewer bytes streamed, then fewer
    transfers."""
    if a[0] < b[0] - _EPS * max(1.0, b[0]):
        return True
    return abs(a[0] - b[0]) <= _EPS * max(1.0, b[0]) and a[1:] < b[1:]
