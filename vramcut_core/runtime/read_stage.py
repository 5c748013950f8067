"""The read stage: disk-tier units' reads from their files, on the process's reader thread,
feeding the copy (a disk read is one more engine feeding the copy stream).

Owns one executor's reads issued ahead and not yet waited for (CPU: by the buffer they fill, a
slot). On CPU a read fills the slot itself: a prefetch (``Transfers.load`` with ``sync`` false:
the group's slot freed) issues it and returns, so it runs beside the compute of the groups before
it, and the group's entry waits for it (``Transfers.order_entry``: ``DeviceCopy.ready`` holds the
reads). On CUDA the reads go piece by piece through the page-locked bounce buffer, each piece
copied on the copy stream and refilled only after its copy (``BounceBuffer.take``); the host
waits for each read when it issues the piece's copy. The one rule: nothing writes or frees a
buffer a read still fills (``wait``), and a read never returns wrong bytes silently (a failed
one raises ``disk.DiskTierError`` where its group is waited for). May call torch, ``disk`` and
``host_memory`` (the bounce buffer).
"""
from __future__ import annotations

import collections
import concurrent.futures

import torch

from . import disk, host_memory
from .host_memory import BOUNCE_PIECE, BounceBuffer


class ReadStage:
    """The disk reads of one executor's units (see the module docstring)."""

    def __init__(self, cuda: bool, copy_stream) -> None:
        self.cuda, self.copy_stream = cuda, copy_stream
        # CPU: reads issued ahead into a buffer, by the buffer's address, not yet waited for;
        # ``ahead`` while a prefetch is issued (its reads are not waited for there)
        self.pending: dict[int, list[concurrent.futures.Future]] = {}
        self.ahead = False

    def into(self, buf: torch.Tensor) -> tuple | None:
        """The reads issued ahead into ``buf`` (CPU), or None."""
        fs = self.pending.get(buf.data_ptr()) if not self.cuda else None
        return tuple(fs) if fs else None

    def wait(self, buf: torch.Tensor | None = None) -> None:
        """CPU: the host waits for the disk reads issued ahead (into ``buf``; None: all). A failed
        one raises where its group is entered (``order_entry``), not here: its bytes are dropped."""
        futs = ([f for fs in self.pending.values() for f in fs] if buf is None
                else self.pending.get(buf.data_ptr(), []))
        concurrent.futures.wait(futs)
        if buf is None:
            self.pending.clear()
        else:
            self.pending.pop(buf.data_ptr(), None)

    def read(self, buf: torch.Tensor, base: int, nbytes: int, bounce: BounceBuffer | None,
             reads: list, st) -> None:
        """Fill ``buf`` from byte ``base`` with a disk-tier unit's bytes, read from its files on the
        reader thread (``disk.reader``; ``preadv`` releases the GIL): on CPU straight into the
        buffer; on CUDA piece by piece into the page-locked bounce buffer, the read of the next
        piece running while the copy of this one is issued (a piece is refilled only after its
        copy: ``BounceBuffer.take``). Without a page-locked bounce buffer each piece is read into
        pageable memory and copied synchronously, on purpose. The bytes count in ``st``."""
        pool = disk.reader()
        if not self.cuda:
            fut = pool.submit(disk.read_into, buf[base:base + nbytes], reads)
            if st is not None:
                st.disk_bytes_read += sum(r[3] for r in reads)  # what read_into returns, or it raises
            if self.ahead:  # the read stage: it runs beside compute until its group is entered
                self.pending.setdefault(buf.data_ptr(), []).append(fut)
            else:
                fut.result()
        else:
            self._read_cuda(pool, buf, base, nbytes, bounce, reads, st)

    def _read_cuda(self, pool, buf: torch.Tensor, base: int, nbytes: int, bounce: BounceBuffer | None,
                   reads: list, st) -> None:
        """CUDA: the reads piece by piece through the bounce buffer, each piece's copy issued as
        its read is back (see ``read``)."""
        piece = bounce.piece if bounce is not None else min(BOUNCE_PIECE, nbytes)
        pending: collections.deque = collections.deque()

        def issue() -> None:
            fut, src, k, lo, hi = pending.popleft()
            got = fut.result()  # the host waits for the read itself
            if st is not None:
                st.disk_bytes_read += got
            buf[base + lo:base + hi].copy_(src[:hi - lo], non_blocking=bounce is not None)
            if bounce is not None:
                done = torch.cuda.Event()
                done.record(self.copy_stream)
                bounce.read_by(k, self.copy_stream, done)

        try:
            for lo in range(0, nbytes, piece):
                hi = min(lo + piece, nbytes)
                if bounce is not None and len(pending) == len(bounce.bufs):
                    issue()  # before its piece is taken again
                src, k = bounce.take() if bounce is not None else (host_memory._host_buffer(piece), -1)
                pending.append((pool.submit(disk.read_into, src, disk.clip(reads, lo, hi)), src, k, lo, hi))
                if bounce is None:
                    issue()
            while pending:
                issue()
        finally:
            for fut, *_ in pending:  # a read failed: the others finish before their pieces are reused
                concurrent.futures.wait([fut])

