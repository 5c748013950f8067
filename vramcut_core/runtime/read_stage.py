"""The read stage: disk-tier units' reads from their files, on the process's reader thread,
feeding the copy (a disk read is one more engine feeding the copy stream).

Owns one executor's work issued to the reader and not yet waited for. On CPU a read fills the
slot itself: a prefetch (``Transfers.load`` with ``sync`` false: the group's slot freed) issues
it and returns, so it runs beside the compute of the groups before it, and the group's entry
waits for it (``Transfers.order_entry``: ``DeviceCopy.ready`` holds the reads; by buffer in
``pending``).

On CUDA the reads go piece by piece through the page-locked bounce buffer, and the READER
THREAD issues each piece's copy on the copy stream as soon as its read is back, then reads the
next piece; before it refills a piece it waits (``BounceBuffer.take``: the event recorded after
the piece's last copy, ``Event.synchronize``, which releases the GIL as ``preadv`` does). Why the
reader and not the host: the bounce buffer has two pieces, so a read can be at most two pieces
ahead of the last copy issued; a host that issued the copies where it next walks the schedule
(a unit's entry) would let a group larger than two pieces advance only that far between two
entries, and its reads would wait on the host. Issued by the reader, a group's reads and copies
run end to end from the moment its slot frees, however large it is, and the host never waits
for them there. The price is one rule on the copy stream, which two threads now write: its work
stays in the schedule's order (a copy waits for the copies before it, in the order of the
groups) because, while the reader holds a transfer not yet waited for (``jobs``), every later
transfer of whole units goes to the reader too (one thread: first in, first out), and the host
itself issues nothing on the copy stream before waiting for those (``join_all``). The host
waits only where it must: where the group is entered (its copy-done event exists once the
reader has issued its last piece; compute then waits on that event, on the device), before it
issues copies of its own (tensor by tensor, subclass tensors, the bounce buffer filled from a
mapping), and before device buffers are freed (``Transfers.drain``).

The one rule: nothing writes or frees a buffer a read or a copy still uses (``wait``, ``join_all``,
the piece events), and a read never returns wrong bytes silently (a failed one raises
``disk.DiskTierError`` where its group is entered; its group's event is recorded all the same, so
nothing waits on an event never recorded). May call torch, ``disk`` and ``host_memory`` (the
bounce buffer).
"""
from __future__ import annotations

import collections
import concurrent.futures
from typing import Callable

import torch

from . import disk, host_memory
from .host_memory import BOUNCE_PIECE, BounceBuffer


def count(st, reads: list) -> None:
    """The bytes of ``reads`` count in ``st`` (what ``read_into`` returns, or it raises)."""
    if st is not None:
        st.disk_bytes_read += sum(r[3] for r in reads)


def issue_transfer(copy_stream, copies: list, ev, ev_start, done, owners: list, staged_bytes: int,
                   free=None) -> None:
    """Issue ``copies`` on ``copy_stream`` (after ``ev``, where the host has not opened the
    transfer) and record ``done`` after them, whatever happens; then the host memory they read is
    marked read by them (``owners``; ``staged_bytes`` staged for them). On the reader thread for a
    transfer with disk reads (and the ones after it), else on the host. ``free``: the slot's free
    event, which the reads wait for (the reader's wait, not the host's: a read starts when its
    slot frees, as on CPU where it fills the slot; the bounce pieces are not held for a copy that
    could not start yet). A resident unit's buffer has none: its read starts when issued."""
    with torch.cuda.stream(copy_stream):
        try:
            if free is not None:
                free.synchronize()
            if ev is not None:
                # hazard: overwriting a slot that queued kernels (compute or host readers) still read
                # hazard: overwriting a slot before the group that last held it is done computing
                copy_stream.wait_event(ev)
                ev_start.record(copy_stream)
            for copy in copies:
                copy()
        finally:
            done.record(copy_stream)
            host_memory.PAGE_LOCKED.staged(done, staged_bytes)
            for owner in owners:
                owner.read_by(copy_stream, done)


class Ahead:
    """A CUDA transfer issued on the reader thread: its future, its copy-done event (recorded on
    the copy stream by the reader once the transfer's last copy is issued) and its timing pair."""

    __slots__ = ("fut", "done", "times")

    def __init__(self, fut: concurrent.futures.Future, done, times) -> None:
        self.fut, self.done, self.times = fut, done, times


class ReadStage:
    """The disk reads of one executor's units (see the module docstring)."""

    def __init__(self, cuda: bool, copy_stream) -> None:
        self.cuda, self.copy_stream = cuda, copy_stream
        # CPU: reads issued ahead into a buffer, by the buffer's address, not yet waited for;
        # ``ahead`` while a prefetch is issued (its reads are not waited for there)
        self.pending: dict[int, list[concurrent.futures.Future]] = {}
        self.ahead = False
        # CUDA: transfers issued on the reader that the host has not waited for, in order
        self.jobs: list[Ahead] = []

    def into(self, buf: torch.Tensor) -> tuple | None:
        """The reads issued ahead into ``buf`` (CPU), or None."""
        fs = self.pending.get(buf.data_ptr()) if not self.cuda else None
        return tuple(fs) if fs else None

    def wait(self, buf: torch.Tensor | None = None) -> None:
        """The host waits for the disk reads issued ahead (CPU: into ``buf``; None: all, and on
        CUDA every transfer on the reader). A failed one raises where its group is entered
        (``order_entry``), not here: its bytes are dropped."""
        if buf is None:
            self.join_all()
        futs = ([f for fs in self.pending.values() for f in fs] if buf is None
                else self.pending.get(buf.data_ptr(), []))
        for f in futs:
            f.exception()
        if buf is None:
            self.pending.clear()
        else:
            self.pending.pop(buf.data_ptr(), None)

    # -- CUDA: transfers on the reader -----------------------------------------------------------

    def submit(self, job: Callable[[], None], done, times) -> Ahead:
        """Issue ``job`` (a transfer's copies, ending with ``done`` recorded) on the reader thread,
        after the transfers before it."""
        a = Ahead(disk.reader().submit(job), done, times)
        self.jobs.append(a)
        return a

    def join(self, a: Ahead, copies: list) -> object:
        """The host waits for transfer ``a`` to be issued (its reads back): its copy-done event,
        which compute may now wait on; a failed read raises here (``disk.DiskTierError``). Its
        timing pair goes to ``copies`` (``CopyTimes.copies``)."""
        try:
            a.fut.result()
        finally:
            if a in self.jobs:
                self.jobs.remove(a)
                copies.append(a.times)
        return a.done

    def join_all(self) -> None:
        """The host waits until every transfer on the reader is issued (errors stay with their
        groups): from here it may issue on the copy stream itself, after them."""
        for a in self.jobs:
            a.fut.exception()
        self.jobs.clear()

    # -- the reads ---------------------------------------------------------------------------------

    def read(self, buf: torch.Tensor, base: int, nbytes: int, reads: list, st) -> None:
        """CPU: fill ``buf`` from byte ``base`` with a disk-tier unit's bytes, read from its files
        on the reader thread (``preadv`` releases the GIL) straight into the buffer. The bytes
        count in ``st``."""
        count(st, reads)
        fut = disk.reader().submit(disk.read_into, buf[base:base + nbytes], reads)
        if self.ahead:  # the read stage: it runs beside compute until its group is entered
            self.pending.setdefault(buf.data_ptr(), []).append(fut)
        else:
            fut.result()

    def read_through(self, buf: torch.Tensor, base: int, nbytes: int, bounce: BounceBuffer, reads: list) -> None:
        """On the reader thread, the copy stream current: each piece read into the bounce buffer
        (once the piece's last copy is done: ``take``), its copy into ``buf`` issued, the next
        piece read while it runs. The bounce buffer is the process's: its lock keeps another
        executor's pass from taking its pieces meanwhile."""
        bounce.pass_through(buf, base, nbytes, self.copy_stream,
                            lambda piece, lo, hi: disk.read_into(piece, disk.clip(reads, lo, hi)))

    @staticmethod
    def pageable(nbytes: int) -> list[torch.Tensor]:
        """CUDA without a page-locked bounce buffer: two pieces of pageable memory (made by the
        host before the copy stream is current: no stream owns them)."""
        piece = min(BOUNCE_PIECE, nbytes)
        return [host_memory._host_buffer(piece) for _ in range(2 if nbytes > piece else 1)]

    def read_pageable(self, buf: torch.Tensor, base: int, nbytes: int, pieces: list, reads: list, st) -> None:
        """CUDA without a page-locked bounce buffer, by the host, on purpose: each piece read on
        the reader into pageable memory (``pageable``), the next read running while the host
        copies this one, synchronously. The bytes count in ``st``."""
        count(st, reads)
        pool, piece = disk.reader(), pieces[0].numel()
        pending: collections.deque = collections.deque()
        try:
            for k, lo in enumerate(range(0, nbytes, piece)):
                hi = min(lo + piece, nbytes)
                src = pieces[k % len(pieces)][:hi - lo]
                pending.append((pool.submit(disk.read_into, src, disk.clip(reads, lo, hi)), src, lo, hi))
                if len(pending) == len(pieces):
                    self._copy_back(buf, base, *pending.popleft())
            while pending:
                self._copy_back(buf, base, *pending.popleft())
        finally:
            for fut, *_ in pending:  # a read failed: the others finish before their memory goes
                fut.exception()

    @staticmethod
    def _copy_back(buf, base, fut, src, lo, hi) -> None:
        fut.result()
        buf[base + lo:base + hi].copy_(src, non_blocking=False)
