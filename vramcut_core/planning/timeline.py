"""Time: each unit's compute time, and the step time a plan predicts.

Pure (no torch, no device calls). A unit's compute time comes from the dry run's FLOP count
(``UnitMeasurement.flops``, counted by torch's ``FlopCounterMode``) divided by the matrix-product
throughput measured on this machine (``bandwidth.matmul_throughput``), or from a measured forward;
it is kept on the plan's rows (``PlanUnit.compute_s``).

``simulate`` is the timeline model: given the segments in execution order (``Step``: compute
time, copy time of a streamed segment, read time of its disk-tier units, device) and the
prefetch depth, the predicted step time and each segment's stall, the part of its copy (and
read) that the compute before it did not hide. A disk read is one more lane: the process's one
reader thread, feeding the copy (``Step.read_s``).
``predict(plan, bytes_per_s)`` applies it to a plan.

What the model covers, each checked against the executor on the simulated accelerator
(tests/core/test_sim_schedule.py): one and two slots with leading, trailing and interleaved
resident units, in a session (the first call copies the resident units) and outside one (every
call copies everything and ends when its copies have); a fixed cost per copy (``latency_s``, the
bandwidth probe's fit); a fixed cost per call (``call_s``: the executor's own work of a call on
the host, ``executor.call_seconds``, measured and cached beside the bandwidth); the reader lane
of disk-tier units; looped units (a forward that enters
a streamed group several times: ``walk``, the schedule walked entry by entry, since the slots
then hold what the passes before left there); a placement across devices (``predict_devices``:
each device's part with its own slots and streams, walked together with the hops between them,
each a peer copy at its link's measured rate, tests/core/test_sim_hops.py). The one rule: no figure here is assumed;
times come from a count over a measured throughput, or from a measurement.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from .plan import Plan, PlanUnit
from . import walk
from .schedule import schedule_of


def unit_seconds(flops: int | None, flops_per_s: float | None) -> float | None:
    """Compute seconds of ``flops`` operations at ``flops_per_s``; None when either is unknown."""
    if flops is None or not flops_per_s or flops_per_s <= 0:
        return None
    return flops / flops_per_s


def with_compute_times(units: Sequence[PlanUnit], flops: Mapping[str, int | None],
                       flops_per_s: float | None) -> list[PlanUnit]:
    """``units`` with ``compute_s`` from each unit's FLOP count (``flops[name]``, e.g. the dry run's
    ``UnitMeasurement.flops``) at the measured throughput; a unit without a count keeps None."""
    return [dataclasses.replace(u, compute_s=unit_seconds(flops.get(u.name), flops_per_s)) for u in units]


# -- the step timeline -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Step:
    """One segment of a forward as the timeline sees it, in execution order.

    ``copy_s`` is None for a resident segment, else the seconds its weights take to copy (bytes /
    host-to-device bandwidth); ``hop_s`` the seconds its input takes to reach its device from the
    previous segment's (0 on one device); ``sync`` marks a copy made when the segment is entered
    instead of prefetched (a segment a forward enters several times); ``after`` the place, among
    the streamed steps of its device, of the one whose slot its copy takes (None: ``depth + 1``
    places before it); ``read_s`` the seconds its disk-tier units take to read from their files
    (bytes / the disk's read rate), the stage before its copy; ``pieces`` (CUDA) the same read
    and copy piece by piece through the bounce buffer, in order: (read seconds, or None for a
    unit copied from RAM, copy seconds) each."""

    compute_s: float
    copy_s: float | None = None
    device: int = 0
    hop_s: float = 0.0
    sync: bool = False
    after: int | None = None  # ``schedule.Copy.after``: the streamed step whose slot its copy takes
    read_s: float | None = None  # its disk-tier units' reads (the read stage before its copy), or None
    pieces: tuple[tuple[float | None, float], ...] | None = None  # (read, copy) through the bounce buffer


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The steady step: ``step_s`` from the end of one forward to the end of the next;
    ``stalls[i]`` the seconds step ``i`` waited for its copy (the part the compute before it
    did not hide); ``copied[i]`` whether its weights moved this step (False: resident, or still in
    its slot from the step before). ``step_s`` is compute + hops + stalls, exactly."""

    step_s: float
    stalls: tuple[float, ...]
    copied: tuple[bool, ...]
    compute_s: float
    hop_s: float = 0.0
    first_s: float | None = None  # the first call of a session (resident copies first)

    @property
    def stall_s(self) -> float:
        return sum(self.stalls)


_MAX_STEPS = 256  # steps simulated at most before the steady one is taken (it comes in a few)


def simulate(steps: Sequence[Step], depth: int | Sequence[int] = 1, overlap: bool = True,
             session: bool = True, load: Mapping[int, float] | None = None,
             load_read: float = 0.0) -> Timeline:
    """The steady-state timeline of ``steps`` run again and again (one forward per sampling step).

    The model is the executor's schedule (``schedule``), one copy stream and ``depth + 1`` slots
    per device:

    * ``overlap`` False (CPU: a copy is a memory copy on the thread that computes): a streamed
      segment waits for its whole copy, which starts when the segment before it has finished.
    * Else the copies of a device's streamed segments run in execution order on its copy stream,
      wrapping to the next forward's first; a copy starts when the copy before it is done and its
      slot is free, that is when the streamed segment ``depth + 1`` places earlier on that device
      (this forward's or the last one's) has finished computing: its slot's free event, which is
      all it waits for (resident segments between never hold it back), issued by the host as the
      slot frees. One slot (``depth`` 0) is the same rule: the next group's copy runs beside the
      resident segments before it. A ``sync`` segment (looped) is copied when entered, whole.
    * A segment computes when the segment before it has finished (plus ``hop_s``, its input's
      trip from the previous device) and its copy is done.
    * ``session`` (the executor keeps its slots between forwards): a device that streams no more
      segments than it has slots copies nothing after the first forward, and the next forward's
      first copies start during this one. Without it every forward starts with nothing on the
      device, as the first of a session does: its resident segments are copied first (``load``:
      seconds per device; compute waits for them; ``load_read``: the seconds their reads from
      disk hold the reader lane), then its first streamed segment (its slot free once compute
      may start: a read into it starts then); the call ends when its copies have too (the
      buffers are released).
    * A step with ``read_s`` (disk-tier units) has a read stage on the reader lane, one for the
      process, reads one after another in the order they are issued: a read is issued when its
      slot frees (as its copy is), so it runs beside the compute before the step, and the step's
      copy (``overlap``: on the copy stream, after the copies before it) or, on CPU where the
      read fills the slot itself, the step waits for it. A ``sync`` step reads when entered,
      whole, as it copies. On CUDA (``Step.pieces``) the reader reads piece by piece through
      the two-piece bounce buffer and issues each piece's copy as its read is back: a piece's
      copy starts once its read is done, the copy before it too and the slot is free; a read
      starts once the one before it is done, the slot is free and the copy that last read its
      piece (two pieces before) is done.

    Forwards are simulated until one starts with the copy streams and slots as the one before
    started (it does within a few: then that forward repeats forever) and that one is returned;
    ``first_s`` is the first call of a session."""
    steps = list(steps)
    devices = sorted({s.device for s in steps})
    slots = {d: 1 + (depth if isinstance(depth, int) else depth[i]) for i, d in enumerate(devices)}
    lists = ([s.compute_s for s in steps], [s.copy_s for s in steps], [s.device for s in steps],
             [s.hop_s for s in steps], [s.sync for s in steps], slots, overlap)
    after = [s.after for s in steps]
    read = [s.read_s for s in steps] if any(s.read_s is not None for s in steps) else None
    pieces = [s.pieces for s in steps] if any(s.pieces for s in steps) else None
    kw = dict(after=after, read=read, load_read=load_read, pieces=pieces)
    first_s, step_s, stalls, copied = _run(*lists, session, load, **kw)
    if session:
        first_s = _run(*lists, True, load, calls=1, **kw)[0]
    return Timeline(step_s, stalls, copied, sum(s.compute_s for s in steps), sum(s.hop_s for s in steps), first_s)


def steady(compute: Sequence[float], copy: Sequence[float | None], device: Sequence[int],
           hop: Sequence[float], sync: Sequence[bool], slots: Mapping[int, int], overlap: bool = True,
           session: bool = True, load: Mapping[int, float] | None = None,
           read: Sequence[float | None] | None = None) -> tuple[float, tuple[float, ...], tuple[bool, ...]]:
    """``simulate`` on plain lists, one entry per step (``Step``'s fields) and the slots of each
    device: (step seconds, stalls, copied). The planner's searches call it directly (no objects
    built per residency tried). ``load``: seconds each device's resident copies take when a call
    begins with nothing on the device (the first of a session; every call outside one); ``read``:
    each step's read stage (``Step.read_s``), or None."""
    return _run(compute, copy, device, hop, sync, slots, overlap, session, load, read=read)[1:]


def first_call(compute: Sequence[float], copy: Sequence[float | None], device: Sequence[int],
               hop: Sequence[float], sync: Sequence[bool], slots: Mapping[int, int], overlap: bool = True,
               load: Mapping[int, float] | None = None) -> float:
    """Seconds of the first call of a session: resident copies first (compute waits for them),
    then the first streamed group's, nothing prefetched before."""
    return _run(compute, copy, device, hop, sync, slots, overlap, True, load, calls=1)[0]


def _run(compute, copy, device, hop, sync, slots, overlap, session, load, calls: int = _MAX_STEPS, after=None,
         read=None, load_read: float = 0.0, pieces=None):
    """(first call's seconds, steady call's seconds, its stalls, copied): calls simulated until one
    starts as the one before started (see ``simulate``), at most ``calls``. ``after[i]``: for a
    streamed step, the place (among its device's streamed steps) of the one whose slot its copy
    takes (``schedule.Copy.after``); None: ``slots`` places before it, cyclically. ``read[i]``:
    a streamed step's read stage (seconds on the one reader lane), or None; ``pieces[i]`` the same
    piece by piece (``Step.pieces``)."""
    n = len(compute)
    devices = set(device)
    load = load or {}
    streams = tuple(c is not None for c in copy)
    pos: list[int] = [0] * n     # a streamed step's place among its device's streamed steps
    count = {d: 0 for d in devices}
    for i in range(n):
        if streams[i]:
            pos[i] = count[device[i]]
            count[device[i]] += 1
    frees = [(after[i] if after is not None and after[i] is not None else (pos[i] - slots[device[i]]) % count[device[i]])
             if streams[i] else 0 for i in range(n)]
    held = {d: session and count[d] <= slots[d] for d in devices}
    copied = tuple(streams[i] and not held[device[i]] for i in range(n))
    # a streamed step waits for its whole copy: no overlap, or a copy made on entry (looped)
    waits = tuple(c and (not overlap or sync[i]) for i, c in enumerate(streams))
    # per device: when its copy stream is free, and when each of its streamed steps last finished
    # computing (its slot's free event: the next copy into that slot waits for it alone)
    copy_free = {d: 0.0 for d in devices}
    disk_free = 0.0  # when the reader lane is free (one for the process)
    bounce = [0.0, 0.0]  # when the copies that last read the two bounce pieces end (the next read's first)
    done: dict[int, list[float]] = {d: [0.0] * count[d] for d in devices}
    end = 0.0
    first_s = None
    stalls: list[float] = []
    state: tuple | None = None
    step_s = 0.0
    for k in range(calls):
        start = end
        fresh = k == 0 or not session  # nothing on the device: resident copies first
        if fresh:
            copy_free = {d: max(copy_free[d], start) + load.get(d, 0.0) for d in devices}
            disk_free = max(disk_free, start) + load_read  # the resident units' reads, first
        gate = {d: copy_free[d] if fresh else start for d in devices}  # compute waits for its residents
        if fresh:  # the slots are made (free) once compute may start: after the resident copies
            done = {d: [gate[d]] * count[d] for d in devices}
        # a forward is fixed by the copy streams and slots as they stand when it starts (relative
        # to its start): when they stand as they did one forward ago, that forward repeats forever
        now = tuple(round(t - start, 12) for d in sorted(devices) for t in [copy_free[d], *done[d]])
        now += tuple(round(max(t - start, 0.0), 12) for t in (disk_free, *bounce))
        if now == state and not fresh:
            return first_s, step_s, tuple(stalls), copied
        state = None if fresh else now  # (a fresh call is no steady one)
        stalls = []
        moved = streams if fresh else copied  # a call that begins empty copies every group
        for i in range(n):
            d = device[i]
            ready = end + hop[i]
            if ready < gate[d]:
                ready = gate[d]
            rd = read[i] if read is not None and moved[i] else None
            read_end = 0.0
            if rd is not None and not sync[i] and not (overlap and pieces is not None and pieces[i]):
                read_end = disk_free = max(disk_free, done[d][frees[i]]) + rd  # issued as its slot frees
            if not moved[i]:
                begin = ready
            elif overlap and not sync[i] and pieces is not None and pieces[i]:
                # the reader: each piece read once the slot is free, its bounce piece too, then copied
                issue = done[d][frees[i]]
                disk_free, t, bounce = _through(pieces[i], issue, disk_free, max(copy_free[d], issue), bounce)
                copy_free[d] = t
                begin = ready if ready > t else t
            elif waits[i]:
                at = max(ready, copy_free[d])
                if rd is not None and sync[i]:  # read when entered, then copied
                    read_end = disk_free = max(at, disk_free) + rd
                begin = max(at, read_end) + copy[i] if overlap or sync[i] else max(at + copy[i], read_end)
                copy_free[d] = begin
            else:
                copy_start = max(copy_free[d], done[d][frees[i]], read_end)
                copy_end = copy_start + copy[i]
                copy_free[d] = copy_end
                begin = ready if ready > copy_end else copy_end
            end = begin + compute[i]
            if streams[i]:
                done[d][pos[i]] = end
            stalls.append(begin - ready)
        if not session:  # released after the call: it waits for every copy issued
            end = max(end, *copy_free.values())
        step_s = end - start
        if first_s is None:
            first_s = step_s
    return first_s, step_s, tuple(stalls), copied


def known(units: Sequence[PlanUnit]) -> bool:
    """Does every unit a forward enters have its compute time?"""
    return all(u.compute_s is not None for u in units if u.entered)


def plan_steps(plan: Plan, bytes_per_s: float, device: int = 0, latency_s: float = 0.0,
               reads: Mapping[str, int] | None = None, disk_bytes_per_s: float | None = None,
               read_copied: bool = True, piece_bytes: int | None = None) -> list[Step]:
    """The steps of ``plan``'s segments a forward enters: their units' compute time (all passes)
    and, for a streamed segment, its bytes per forward over ``bytes_per_s`` plus ``latency_s`` per
    copy (one per unit and pass: each unit is copied from its own host master). A segment entered
    several times (a looped unit: a segment of its own) is copied on each entry, not prefetched.
    ``reads``: the bytes one pass reads of each disk-tier unit, at ``disk_bytes_per_s``: the
    segment's read stage (``Step.read_s``); ``read_copied`` False where the read fills the slot
    itself (CPU): those units then copy nothing; ``piece_bytes`` (CUDA) the bounce buffer's
    piece: a disk-tier unit is read and copied in pieces of it (``Step.pieces``), each copy with
    its ``latency_s``."""
    if not known(plan.units):
        raise ValueError("the plan's units have no compute times (PlanUnit.compute_s)")
    if not bytes_per_s or bytes_per_s <= 0:
        raise ValueError(f"bytes_per_s must be a positive rate, got {bytes_per_s!r}")
    reads = reads or {}
    if reads and (not disk_bytes_per_s or disk_bytes_per_s <= 0):
        raise ValueError(f"disk_bytes_per_s must be a positive rate, got {disk_bytes_per_s!r}")
    copies = iter(schedule_of(plan).copies)  # the streamed segments entered, in order
    out = []
    for seg in plan.segments:
        us = [plan.units[i] for i in seg.units if plan.units[i].entered]
        if not us:
            continue
        compute = sum(u.compute_s for u in us)
        if seg.resident:
            out.append(Step(compute, None, device))
            continue
        c = next(copies)
        copy = sum(u.weight_bytes * u.calls / bytes_per_s + latency_s * u.calls for u in us
                   if read_copied or u.name not in reads)
        on_disk = [u for u in us if u.name in reads]
        read = sum(reads[u.name] * u.calls for u in on_disk) / disk_bytes_per_s if on_disk else None
        parts = None
        if on_disk and piece_bytes and read_copied and not c.on_entry:
            parts = tuple(p for u in us for p in _pieces(u, reads.get(u.name), piece_bytes, bytes_per_s,
                                                         disk_bytes_per_s, latency_s))
            copy = sum(c for _, c in parts)
        out.append(Step(compute, copy, device, sync=c.on_entry, after=c.after, read_s=read, pieces=parts))
    return out


def _pieces(u: PlanUnit, read: int | None, piece: int, bytes_per_s: float, disk_bytes_per_s: float,
            latency_s: float, passes: int | None = None) -> list[tuple[float | None, float]]:
    """A unit's (read, copy) seconds piece by piece through the bounce buffer (its read bytes
    spread over its pieces as its bytes are), for each of its ``passes`` (its calls); one copy
    from RAM where it is not read."""
    passes = u.calls if passes is None else passes
    if read is None:
        return [(None, u.weight_bytes / bytes_per_s + latency_s)] * passes
    n = u.weight_bytes
    one = [((min(lo + piece, n) - lo) * read / max(n, 1) / disk_bytes_per_s,
            (min(lo + piece, n) - lo) / bytes_per_s + latency_s) for lo in range(0, n, piece)]
    return one * passes


def _through(parts, issue: float, disk_free: float, t: float, bounce: list,
             serial: bool = False) -> tuple[float, float, list]:
    """(read, copy) ``parts`` through the two-piece bounce buffer, reads from ``issue`` on, copies
    from ``t`` on: (the reader lane free, the last copy's end, the bounce pieces' last copy ends).
    ``serial``: each read after the copy before it (the host waits for both: CPU)."""
    for r, c in parts:
        if r is None:
            t += c
            continue
        disk_free = max(disk_free, issue, bounce[0], t if serial else 0.0) + r
        t = max(t, disk_free) + c
        bounce = [bounce[1], t]
    return disk_free, t, bounce


def _load_chain(plan: Plan, bytes_per_s: float, latency_s: float, reads: Mapping[str, int] | None,
                disk_bytes_per_s: float | None, piece_bytes: int | None, overlap: bool = False) -> tuple[float, float]:
    """(copies' end, reads' end) of ``plan``'s resident units when a call begins empty: one after
    another, each copied after its read where it is in ``reads`` (``overlap``, CUDA: piece by
    piece, a read beside the copy before it; else each read after the copy before it)."""
    reads = reads or {}
    parts = [p for u in (plan.units[i] for s in plan.segments if s.resident for i in s.units)
             for p in _pieces(u, reads.get(u.name), piece_bytes or 1 << 62, bytes_per_s, disk_bytes_per_s or 1.0,
                              latency_s, passes=1)]
    disk_free, t, _ = _through(parts, 0.0, 0.0, 0.0, [0.0, 0.0], serial=not overlap)
    return t, disk_free


def load_seconds(plan: Plan, bytes_per_s: float, latency_s: float = 0.0, reads: Mapping[str, int] | None = None,
                 disk_bytes_per_s: float | None = None, piece_bytes: int | None = None, overlap: bool = False) -> float:
    """Seconds the copies of ``plan``'s resident units take when a call begins with nothing on the
    device (one copy per unit, entered or not: the executor places every resident unit). A unit
    in ``reads`` (its host copy on disk) is read first, at ``disk_bytes_per_s``: its copy after its
    read; ``overlap`` (CUDA) through the bounce buffer of ``piece_bytes`` pieces, the next read
    beside this copy, else the next read after it."""
    return _load_chain(plan, bytes_per_s, latency_s, reads, disk_bytes_per_s, piece_bytes, overlap)[0]




def predict(plan: Plan, bytes_per_s: float, overlap: bool = True, session: bool = True,
            latency_s: float = 0.0, reads: Mapping[str, int] | None = None,
            disk_bytes_per_s: float | None = None, piece_bytes: int | None = None,
            call_s: float = 0.0) -> Timeline:
    """The steady step time ``plan`` predicts, and its first call's: its segments through
    ``simulate`` with its slots (two: prefetch depth 1; one: depth 0). ``overlap`` False for CPU
    (copies synchronous; a disk read fills the slot itself); ``latency_s`` the fixed cost of one
    copy; ``reads`` the bytes of each disk-tier unit read per pass at ``disk_bytes_per_s`` (a
    resident one is read when a call begins empty, before its copy); ``piece_bytes`` the bounce
    buffer's piece (CUDA: reads and copies piece by piece; None: the one of the plan's tiers, or
    a piece per unit); ``call_s`` the executor's own fixed cost of a call
    (``executor.call_seconds``, measured): on CUDA host work before the call issues anything (the
    schedule walked with it, ``walk``), on CPU (everything on one thread) added to each call."""
    if piece_bytes is None and overlap and reads:
        t = plan.tiers
        piece_bytes = t.bounce_bytes // 2 if t is not None and t.bounce_bytes else 1 << 62  # (BOUNCE_PIECES)
    steps = plan_steps(plan, bytes_per_s, latency_s=latency_s, reads=reads, disk_bytes_per_s=disk_bytes_per_s,
                       read_copied=overlap, piece_bytes=piece_bytes if overlap else None)
    if overlap and not reads and (call_s or walk.looped(plan)):  # walked entry by entry
        calls = walk.call_times(plan, bytes_per_s, session, latency_s, call_s)
        return _walked(calls, steps, session and schedule_of(plan).held)
    copies, lane = _load_chain(plan, bytes_per_s, latency_s, reads, disk_bytes_per_s, piece_bytes, overlap)
    tl = simulate(steps, max(plan.slots - 1, 0), overlap, session, {0: copies}, lane)
    if not call_s:
        return tl
    return dataclasses.replace(tl, step_s=tl.step_s + call_s, first_s=tl.first_s and tl.first_s + call_s)


def _walked(calls: list[tuple[float, tuple[float, ...]]], steps: Sequence[Step], held: bool) -> Timeline:
    """The ``Timeline`` of calls walked entry by entry (``walk``): its stalls are the steady
    call's streamed entries', in the order they ran (a looped group once per pass); ``held``:
    every group stays in its slot (nothing is copied after the first call)."""
    step_s, stalls = calls[-1]
    return Timeline(step_s, stalls, tuple(s.copy_s is not None and not held for s in steps),
                    sum(s.compute_s for s in steps), sum(s.hop_s for s in steps), calls[0][0])


def predict_devices(plans: Sequence[Plan], hops: Sequence[tuple[int, int, str, int]], bytes_per_s: float,
                    links: Mapping[tuple[int, int], tuple[float, float]], session: bool = True,
                    latency_s: float = 0.0, call_s: float = 0.0) -> Timeline:
    """The steady call of a forward placed on several devices, and its first: ``plans[d]`` device
    d's part (in execution order, each with its own slots, copy stream and compute stream), ``hops``
    the activations that cross between them, ``(source, destination, unit, bytes)`` as the plan
    JSON lists them (``runtime.hops``: the unit they are moved for, "output" for the forward's
    output moved home), each a peer copy of its link's ``links[(source, destination)]``:
    ``(bytes_per_s, latency_s)``, the device-to-device figures ``bandwidth.device_to_device``
    measures. Walked entry by entry (``walk``): a device's copies overlap the other devices'
    compute, a hop waits for both devices' compute queued before it; ``call_s`` as ``predict``'s,
    once per device's executor."""
    secs = []
    for a, b, unit, n in hops:
        rate, lat = links[(a, b)]
        if not rate or rate <= 0:
            raise ValueError(f"the link {a}->{b} needs a positive rate, got {rate!r}")
        secs.append((a, b, unit, lat + n / rate))
    steps = [s for p in plans for s in plan_steps(p, bytes_per_s, latency_s=latency_s)]
    calls = walk.walk(list(plans), walk.across(plans, secs), bytes_per_s, session, latency_s, call_s=call_s)
    return Timeline(calls[-1][0], calls[-1][1], tuple(s.copy_s is not None for s in steps),
                    sum(s.compute_s for s in steps), sum(h[3] for h in secs), calls[0][0])
