"""Transfers: the copy stream, its events, and which readers wait on which copy.

Owns the side stream copies run on (CUDA), the events of every copy (one per transfer: a
streamed segment's units are copied one after another between one wait and one event, which all
of them share; one per piece of the bounce buffer a file-backed unit passes through) and the
timing events not yet read (``CopyTimes``). Which group is copied into which slot, and when, is
the schedule walk's (``schedule_walk``); a copy here is told what to wait for. The one rule: every
stream that reads a buffer waits on the event of the copy that filled it, and a copy into a
buffer first waits on the compute stream (into a slot: the slot's free event, recorded once the
group that last held it was done), so it never overwrites weights that queued kernels still
read; every synchronisation carries a ``hazard:`` comment. The simulated accelerator's tests (tests/core/test_sim_*.py) fail without
each, but two it cannot show: ``drain``'s wait for the compute stream (the simulator runs
compute kernels at once) and the finalizer's drain (there, unpinning the masters waits for the
same copies first); both stay: on a GPU kernels queue, and masters can outlive the executor. The
finalizer blocks the host only while a copy is in flight (test_sim_switch.py checks both ways):
collection may run it inside another engine's step.
A transfer with disk reads is issued on the reader thread, its copies too, and so is every
transfer of whole units while one is there (``read_stage``: the copy stream keeps the schedule's
order; the host waits for it where the group is entered, and before it issues copies itself).
May call torch, ``device_memory`` (to count subclass bytes), ``host_memory`` (masters to copy
from), ``read_stage`` (disk-tier reads) and ``binding`` (where a tensor's master is).
"""
from __future__ import annotations

import contextlib
import functools
import time
import weakref
from typing import Callable

import torch

from ..model import quant
from ..planning.plan import Plan
from .binding import Binding
from .device_memory import DeviceCopy, DeviceMemory
from .host_memory import (PAGE_LOCKED, HostMasters, BounceBuffer, _HostMaster, host_alloc_size,
                          masters_holding, staged)
from .layout import quant_views, view
from .read_stage import Ahead, ReadStage, count, issue_transfer


class Transfers:
    """The copies of one executor's units onto the device, and their ordering."""

    def __init__(self, device: torch.device, memory: DeviceMemory, masters: HostMasters,
                 binding: Binding, units, reader_streams: Callable[[], list] | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._unit = units
        self.memory, self.masters, self.binding = memory, masters, binding
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.times = CopyTimes(device)                  # the timing events not yet read
        # the RunStats copies count in: the running call's, or the next call's while a copy for it
        # is issued (``schedule_walk``)
        self.stats = None
        self._staged_bytes = 0                          # page-locked staging of the transfer being issued
        self.reads = ReadStage(self.cuda, self.copy_stream)  # disk-tier units' reads
        # Other streams that read the weights while they are swapped in (the host's offload
        # streams, ``HostHooks.reader_streams``): each waits on the same copy events as the
        # compute stream.
        self.reader_streams = reader_streams
        # Collected without release (an interrupted run, an engine replaced): the device buffers
        # this executor's copies write go with it.
        weakref.finalize(self, _drain_cuda, self.copy_stream)

    def drain(self) -> None:
        """Before the device buffers are freed: every copy and every queued kernel has finished."""
        self.reads.wait()  # hazard: freeing a slot the reader thread still writes
        if self.cuda:
            self.copy_stream.synchronize()  # hazard: freeing slots a prefetch is still writing
            # hazard: freeing buffers that queued kernels on the compute stream still read
            torch.cuda.current_stream(self.device).synchronize()

    def wait_copies(self) -> None:
        """Block the host until every copy issued has landed (callers name the hazard)."""
        if self.cuda:
            self.reads.join_all()  # (the reader's are issued first)
            self.copy_stream.synchronize()

    def order_after_copies(self) -> None:
        """The compute stream runs after every copy issued (no host wait; callers name the hazard)."""
        self.reads.wait()  # CPU: a buffer freed after this is written by no read ahead
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def load(self, names: tuple[str, ...], buf: torch.Tensor, sync: bool, free=None) -> dict[str, DeviceCopy]:
        """Copy the weights of units ``names`` back to back into ``buf`` (subclass tensors next
        to it): one transfer. On CUDA the copies are issued one after another on the copy stream
        (from each unit's own host master) between one wait and one event, which every unit's
        copy shares. ``free``: the event recorded when the compute that last read ``buf`` was
        done (a slot's free event); the copy waits for it alone. None: for everything the compute
        stream has queued so far. A disk-tier unit's read is issued on the reader thread and,
        where ``sync`` is false (a prefetch), not waited for here: the group's
        ``DeviceCopy.ready`` holds it until the group is entered (``order_entry``). On CUDA the
        reader issues the transfer's flat copies too, after its reads (``read_stage``)."""
        mem = self.memory
        t0 = time.perf_counter()
        out: dict[str, DeviceCopy] = {}
        # hazard: a copy into a buffer the reader thread still writes (a read ahead never waited for)
        if not self.cuda:
            self.reads.wait(buf)
        self.reads.ahead = not self.cuda and not sync
        # a resident unit copies from a master only where its host copy is held in RAM (a RAM budget's)
        masters = {n: self.masters.get(n) if n not in mem.resident_names or self.masters.tiers.in_ram(n)
                   else None for n in names}
        # host buffers are made here, before the copy stream is current (no stream owns them)
        bounces = {n: self.masters.bounce(n) if masters[n] is None and self.cuda else None for n in names}
        flat: list[tuple] = []   # (unit, base, issue) of the flat copies (CUDA: the reader's where it has any)
        with mem.pause():
            compute = ev = ev_start = None
            if self.cuda:
                compute = torch.cuda.current_stream(self.device)
                # The slot may still be read by kernels queued on the compute stream (or be
                # memory the allocator just recycled from them): the copy stream waits for
                # them, or it would overwrite data in use. A slot whose group has been done
                # computing says when (its free event): kernels queued since (resident units
                # between two streamed groups) never touch it, and the copy overlaps them.
                ev = free
                if ev is None:
                    ev = torch.cuda.Event()
                    ev.record(compute)
                ev_start = torch.cuda.Event(enable_timing=True)
            base = 0
            self._staged_bytes = 0
            host, ahead = [], False   # the host's own copies; whether the reader takes the flat ones
            try:
                for name in names:
                    dc, copy, on_reader = self._copy_unit(name, buf, base, masters[name], bounces[name], compute)
                    out[name] = dc
                    (flat if copy is not None and on_reader is not False else host).append((name, base, copy))
                    ahead = ahead or bool(on_reader)
                    base += mem.layout(name).nbytes
                ahead = self.cuda and bool(flat) and (ahead or bool(self.reads.jobs))
                if not ahead:
                    host, flat = flat + host, []
                if self.cuda and host:
                    # hazard: the copy stream's work out of the schedule's order (the host's
                    # copies before a transfer still on the reader)
                    self.reads.join_all()
                stream_ctx = torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext()
                with stream_ctx:
                    if self.cuda and (host or not ahead):
                        # hazard: overwriting a slot that queued kernels (compute or host readers) still read
                        # hazard: overwriting a slot before the group that last held it is done computing
                        self.copy_stream.wait_event(ev)
                        ev_start.record(self.copy_stream)
                    for name, b, copy in host:
                        if copy is not None:
                            copy()
                        self._copy_tensors(name, buf, b, out[name], compute)
            finally:
                self.reads.ahead = False
            reading = self.reads.into(buf)
            if reading:
                for dc in out.values():
                    dc.ready = reading
            if self.cuda:
                done = torch.cuda.Event(enable_timing=True)
                owners = [o for n, m in masters.items()
                          for o in ([m] if m is not None else masters_holding(self._unit(n)))]
                staged_bytes = self._staged_bytes
                if ahead:
                    opened, reading = bool(host), any(c.func == self.reads.read_through for _, _, c in flat)
                    job = functools.partial(issue_transfer, self.copy_stream, [c for _, _, c in flat],
                                            None if opened else ev, ev_start, done, owners, staged_bytes,
                                            free if reading else None)
                    mark = self.reads.submit(job, done, (ev_start, done))
                    for dc in out.values():
                        dc.ready = mark
                else:
                    issue_transfer(self.copy_stream, [], None, None, done, owners, staged_bytes)
                    self.times.copies.append((ev_start, done))
                    for dc in out.values():
                        dc.ready = done
        other = sum(mem.layout(n).other_bytes for n in names)
        if other:
            mem.account(other)
        st = self.stats
        if st is not None and any(n not in mem.resident_names for n in names):
            st.copies += 1
            st.bytes_streamed += sum(mem.unit_bytes(n) for n in names if n not in mem.resident_names)
            if not self.cuda:
                st.time_copy_s += time.perf_counter() - t0
        elif st is not None:
            # a resident unit's copy, once (the first planned call, or the host wrote into it): not
            # streaming, which is what a call pays each time
            st.resident_loads += 1
            if not self.cuda:
                st.time_load_s += time.perf_counter() - t0
        if self.cuda and sync:
            self.order_readers(self._ready(next(iter(out.values())).ready))
        return out

    def _ready(self, ready):
        """A group's copy-done event; a transfer still on the reader is waited for first (a read
        that failed raises here: its group is entered)."""
        if isinstance(ready, Ahead):
            return self.reads.join(ready, self.times.copies)
        return ready

    def load_resident(self, plan: Plan, stale: bool) -> None:
        """A buffer and a copy for each unit ``plan`` keeps resident; ``stale``: the host wrote
        into the masters, the kept copies are copied again."""
        mem = self.memory
        for name in plan.resident_units:
            if name not in mem.resident:
                buf = mem.alloc(mem.layout(name).nbytes)
                mem.resident[name] = (buf, self.load((name,), buf, sync=True)[name])
                del buf
            elif stale:
                self._reload_resident(name)

    def _reload_resident(self, name: str) -> None:
        mem = self.memory
        buf, dc = mem.resident[name]
        mem.account(-mem.other_bytes(dc))
        mem.resident[name] = (buf, self.load((name,), buf, sync=True)[name])

    def _copy_unit(self, name: str, buf: torch.Tensor, base: int, master: _HostMaster | None,
                   bounce: BounceBuffer | None, compute) -> tuple[DeviceCopy, Callable[[], None] | None, bool | None]:
        """One unit's copy into ``buf`` from byte ``base``: its ``DeviceCopy`` (views made now),
        the issue of its flat copy (None: copied tensor by tensor, ``_copy_tensors``) and where
        that copy may be issued (True: a disk read the reader makes; None: anywhere; False: by
        the host only)."""
        unit, lay = self._unit(name), self.memory.layout(name)
        dc = DeviceCopy()
        dc.unit = name
        reads = self.masters.tiers.reads(name) if master is None else None  # a disk-tier unit
        whole = reads is not None or bounce is not None or (master is not None and lay.nbytes)  # one flat copy
        if not whole:
            return dc, None, False
        for i, off, n in lay.flat:
            dc.views[i] = view(buf, base + off, n, unit.tensors[i].tensor)
        for i, spans in lay.quant.items():
            dc.parts[i] = quant_views(buf, unit.tensors[i].tensor, spans, base)
        where = None if not lay.other else False
        if reads is not None and self.cuda and bounce is not None:
            count(self.stats, reads)  # the reader reads and copies it, piece by piece
            copy = functools.partial(self.reads.read_through, buf, base, lay.nbytes, bounce, reads)
            return dc, copy, True if not lay.other else False
        if reads is not None and self.cuda:
            return dc, functools.partial(self.reads.read_pageable, buf, base, lay.nbytes,
                                         self.reads.pageable(lay.nbytes), reads, self.stats), False
        if reads is not None:
            return dc, functools.partial(self.reads.read, buf, base, lay.nbytes, reads, self.stats), False
        if bounce is not None:
            return dc, functools.partial(_through_bounce, unit, lay, functools.partial(self.binding.host, name), buf,
                                         base, bounce, compute, self.copy_stream), False
        # a pageable master would make the copy wait for the compute stream on the host
        # (under a RAM budget nothing is staged: the copy is synchronous, on purpose)
        src_buf, async_ok = ((master.buf, True) if master.page_locked
                             else (master.buf, False) if not self.cuda or self.masters.tiers.tiers is not None
                             else staged(master.buf, self.memory.place, self._staged_bytes))
        if src_buf is not master.buf:
            self._staged_bytes += host_alloc_size(src_buf.numel())
            where = False
        return dc, functools.partial(_copy_flat, buf[base:base + lay.nbytes], src_buf, async_ok), where

    def _copy_tensors(self, name: str, buf: torch.Tensor, base: int, dc: DeviceCopy, compute) -> None:
        """Issue the copies of a unit's weights tensor by tensor (no flat master), and of its
        subclass tensors (on CUDA on the copy stream, which the caller has made current;
        ``compute`` is the stream that reads)."""
        unit, lay, place = self._unit(name), self.memory.layout(name), self.memory.place
        if not dc.views and not dc.parts:
            for i, off, n in lay.flat:
                src = self.binding.host(name, i)
                v = view(buf, base + off, n, src)
                v.copy_(*self._source(src))
                dc.views[i] = v
            for i, spans in lay.quant.items():
                t = unit.tensors[i].tensor  # the host object (the layer sees a rebuilt one)
                views = quant_views(buf, t, spans, base)
                for v, p in zip(views, quant.parts(t)):
                    v.copy_(*self._source(p))
                dc.parts[i] = views
        for i in lay.other:
            src, async_ok = self._source(self.binding.host(name, i))
            dev = src.to(place, non_blocking=async_ok, copy=True)
            if self.cuda:
                # allocated on the copy stream, used on the compute stream: keep the
                # allocator from reusing it before compute is done with it
                dev.record_stream(compute)
            dc.views[i] = dev
        # a staging buffer goes back to torch's host cache (reused after the copy)

    def _source(self, src: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """What a copy of one host tensor reads, and whether it may be asynchronous: on CUDA,
        page-locked memory as it is; pageable memory (a unit the host page-locked only in part:
        its other tensors) staged through torch's page-locked host cache where page-locking is on.
        hazard: a non-blocking copy from pageable memory makes the host wait anyway (CUDA stages
        it), unseen; it is synchronous here on purpose (pin_memory off, no room to stage)."""
        if not self.cuda:
            return src, False
        if src.is_pinned():
            return src, True
        if not self.masters.pin:
            return src, False
        out, async_ok = staged(src, self.memory.place, self._staged_bytes)
        if out is not src:
            self._staged_bytes += host_alloc_size(src.numel() * src.element_size())
        return out, async_ok

    def order_readers(self, ready) -> None:
        """Every stream that reads the weights waits for the copy that put them there."""
        # hazard: compute reading a buffer before its copy has landed
        torch.cuda.current_stream(self.device).wait_event(ready)
        if self.reader_streams is not None:
            for s in self.reader_streams():
                s.wait_event(ready)  # hazard: a host offload stream casting a weight not yet copied

    def order_entry(self, dc: DeviceCopy, group: dict[str, DeviceCopy]) -> None:
        """Entering a prefetched unit: compute waits for its copy, once for the whole group (on
        CPU: the host waits for its disk reads issued ahead; a failed one raises here)."""
        if not self.cuda and dc.ready is not None:
            reads = dc.ready
            for c in group.values():
                c.ready = None
            for fut in reads:
                fut.result()  # the read stage's end: its group computes from here on
        elif self.cuda and dc.ready is not None:
            ready = self._ready(dc.ready)  # a transfer on the reader: the host waits for its reads here
            # compute must not read the slot before its copy has landed
            if not ready.query():
                a = self.times.cuda_mark()
                self.order_readers(ready)
                self.times.waits.append((a, self.times.cuda_mark()))
            for c in group.values():  # one event for the group: ordered for all of it
                c.ready = None


def _through_bounce(unit, lay, host: Callable[[int], torch.Tensor], buf: torch.Tensor, base: int,
                    bounce: BounceBuffer, compute, copy_stream) -> None:
    """Copy a file-backed unit's flat bytes into ``buf`` from byte ``base`` piece by piece
    through the page-locked bounce buffer: the host fills a piece from the mapped tensors (as laid
    out; ``host(i)``: its tensor ``i``), ``copy_stream`` moves it, and an event per piece says when
    it may be filled again. Its tensors stay where they are: the file mapping is their master."""
    spans = [(off, n, host(i)) for i, off, n in lay.flat]
    spans += [(off, n, p) for i, sp in lay.quant.items()
              for (off, n), p in zip(sp, quant.parts(unit.tensors[i].tensor))]
    spans = [(off, n, src.reshape(-1).view(torch.uint8)) for off, n, src in sorted(spans, key=lambda x: x[0])]

    def fill(piece: torch.Tensor, lo: int, hi: int) -> None:
        # the fill is host work, done at once: it is no copy the copy stream queues
        with torch.cuda.stream(compute):
            for off, n, src in spans:
                a, b = max(off, lo), min(off + n, hi)
                if a < b:
                    piece[a - lo:b - lo].copy_(src[a - off:b - off])

    # (the reader thread may be passing another executor's unit through it: ``pass_through`` locks)
    bounce.pass_through(buf, base, lay.nbytes, copy_stream, fill)


def _copy_flat(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    dst.copy_(src, non_blocking=non_blocking)


class CopyTimes:
    """The CUDA timing events of one executor not yet read: each copy's (start, end) on the copy
    stream, each wait of compute for a copy, each forward's. They are read once completed
    (``collect_cuda_times``), never waited for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copies: list[tuple[object, object]] = []    # CUDA (start, end) copy events
        self.waits: list[tuple[object, object]] = []     # CUDA (start, end) of compute waiting
        self.forwards: list[tuple[object, object]] = []  # CUDA (start, end) of forwards not yet timed

    def cuda_mark(self):
        """A timing event on the compute stream (None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def collect_cuda_times(self, stats, start_ev, end_ev) -> None:
        """Copy, wait and compute times of the events that have completed (nothing is waited for
        here: the CPU runs ahead into the next forward; the others are timed when a later forward
        ends). The copy stream is not waited for: the prefetch for the next forward keeps
        running, and copies still in flight are counted when they have landed."""
        done, pending = [], []
        for pair in self.copies:
            (done if pair[1].query() else pending).append(pair)
        self.copies = pending
        stats.time_copy_s = sum(a.elapsed_time(b) for a, b in done) / 1e3
        waited = [p for p in self.waits if p[1].query()]
        self.waits = [p for p in self.waits if p not in waited]
        stats.time_wait_s += sum(a.elapsed_time(b) for a, b in waited) / 1e3
        if start_ev is not None:
            self.forwards.append((start_ev, end_ev))
        timed = [p for p in self.forwards if p[1].query()]
        self.forwards = [p for p in self.forwards if p not in timed]
        total = sum(a.elapsed_time(b) for a, b in timed) / 1e3
        stats.time_s, stats.timed = total, len(timed)
        stats.time_compute_s = max(0.0, total - stats.time_wait_s)

    def forget(self) -> None:
        self.copies.clear()
        self.forwards.clear()


def _drain_cuda(copy_stream) -> None:
    # Collection can run this inside another engine's step: block the host only while a copy is
    # still in flight (an executor collected without release); a released one's stream is idle.
    if copy_stream is not None and not copy_stream.query():
        copy_stream.synchronize()  # hazard: buffers freed with this executor while copies write them
