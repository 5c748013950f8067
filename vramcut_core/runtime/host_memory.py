"""Host memory: the flat host masters of streamed units, their page-locking and its ledger, the
staging copy of a master that could not be page-locked, and the bounce buffer of file-backed
weights.

Owns and frees host memory, nothing on the device. A master is owned for the process: shared by
executors on the same tensors, kept across sessions, page-locked up to a cap (``PIN_FRACTION``
of RAM, portable to every GPU) and unpinned by its own finalizer once the copies reading it have
finished. Weights that live in a file mapping (a memory-mapped checkpoint) are their own masters
where the engine is told to keep them so (``keep_file_backed``: the host streams from a fast
disk): no flat copy is made, and their bytes reach the device through a small page-locked
bounce buffer (``BOUNCE_PIECES`` pieces of ``BOUNCE_PIECE`` bytes, reused). The one rule: host memory
is never unregistered (or written) while a copy may read it. A failed registration's pending
CUDA error is cleared where it happens. May call torch, ``quant``, ``units`` and ``layout``.
"""
from __future__ import annotations

import bisect
import os
import threading
import weakref
from typing import Callable

import torch

from ..model import quant
from ..model.units import Unit
from ..planning.tiers import RAM
from .layout import Layout, quant_views, view

_HOST_REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: page-locked for every GPU, not only the current one
PIN_FRACTION = 0.45           # at most this share of physical RAM is page-locked by the pack
                              # (Windows refuses past about half of RAM; the host pins too)
BOUNCE_PIECE = 64 << 20       # bytes of one piece of the bounce buffer of file-backed weights
BOUNCE_PIECES = 2             # the host fills one piece while the copy of the other runs


def _host_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _physical_ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        try:
            import psutil
            return int(psutil.virtual_memory().total)
        except Exception:
            return None


class _PageLockLedger:
    """Bytes the pack has page-locked in this process, against a cap; ``room`` (a host's
    ``HostHooks.page_lock_room``, where the host page-locks memory itself) gives the bytes the
    host's own limit leaves for everything the pack page-locks."""

    def __init__(self) -> None:
        self.bytes = 0
        self.cap: int | None = None
        self.room: Callable[[], int] | None = None
        # Staging buffers from torch's page-locked host allocator: it keeps them cached, so the
        # most staged at once (rounded as it rounds) stays page-locked, counted in ``bytes``.
        self.staging = 0
        self._in_flight: list[tuple[object, int]] = []   # (event of the copy reading it, bytes)

    def staging_room(self, n: int, pending: int = 0) -> bool:
        """Whether staging ``n`` more bytes now stays within the cap and the host's room, beside
        ``pending`` bytes staged for the transfer being issued (not yet in flight here)."""
        self._in_flight = [(ev, b) for ev, b in self._in_flight if not ev.query()]
        grow = sum(b for _, b in self._in_flight) + pending + host_alloc_size(n) - self.staging
        return grow <= 0 or self.allows(grow)

    def staged(self, done, n: int) -> None:
        """``n`` bytes were staged for the copy that ``done`` marks."""
        if not n:
            return
        self._in_flight.append((done, n))
        now = sum(b for _, b in self._in_flight)
        if now > self.staging:
            self.bytes += now - self.staging
            self.staging = now

    def limit(self) -> int | None:
        if self.cap is None:
            ram = _physical_ram()
            self.cap = int(ram * PIN_FRACTION) if ram else -1
        return None if self.cap < 0 else self.cap

    def allows(self, n: int) -> bool:
        cap = self.limit()
        if cap is not None and self.bytes + n > cap:
            return False
        return self.room is None or self.bytes + n <= self.room()


PAGE_LOCKED = _PageLockLedger()


def _clear_cuda_error(place: torch.device) -> None:
    """A failed runtime call (cudaHostRegister) stays the thread's last CUDA error, and the next
    unrelated kernel launch would raise it ("CUDA error: out of memory", not an OutOfMemoryError).
    A tiny kernel launch reads and clears it here, where it is expected."""
    try:
        torch.empty(1, dtype=torch.uint8, device=place).zero_()
    except RuntimeError:
        pass


def _register(buf: torch.Tensor, readers: dict, place: torch.device, owner) -> bool:
    """Page-lock ``buf`` within the ledger; ``owner``'s finalizer unregisters it after the copies
    in ``readers``. False (nothing pinned, the pending error cleared) where it cannot be."""
    if not buf.numel() or not PAGE_LOCKED.allows(buf.numel()):
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), _HOST_REGISTER_PORTABLE)
        ok = int(getattr(err, "value", err)) == 0
    except Exception:
        ok = False
    if not ok:
        _clear_cuda_error(place)
        return False
    PAGE_LOCKED.bytes += buf.numel()
    owner._fin = weakref.finalize(owner, _unpin, buf, readers, place)
    return True


def _unpin(buf: torch.Tensor, readers: dict, place: torch.device) -> None:
    """Unregister a master (finalizer and release share it): first wait for every copy that may
    still read it."""
    for ev in list(readers.values()):
        ev.synchronize()  # hazard: unregistering host memory an in-flight copy still reads
    readers.clear()
    try:
        err = torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        if int(getattr(err, "value", err)) != 0:
            _clear_cuda_error(place)
    except Exception:
        _clear_cuda_error(place)
    PAGE_LOCKED.bytes -= buf.numel()


def host_alloc_size(n: int) -> int:
    """What torch's page-locked host allocator reserves for ``n`` bytes (a power of two)."""
    return 1 << max(0, n - 1).bit_length() if n else 0


def staged(buf: torch.Tensor, place: torch.device, pending: int = 0) -> tuple[torch.Tensor, bool]:
    """A page-locked copy of a pageable master from torch's host allocator (reused after the copy
    that reads it has finished), so the device copy stays asynchronous; the master itself where
    that fails or the page-locked room is spent (then copied synchronously, on purpose)."""
    if not PAGE_LOCKED.staging_room(buf.numel() * buf.element_size(), pending):
        return buf, False
    try:
        return buf.pin_memory(), True
    except RuntimeError:
        _clear_cuda_error(place)
        return buf, False


def _file_mappings() -> list[tuple[int, int]] | None:
    """The address ranges this process has mapped from files on disk, sorted (Linux); None where
    the system does not say. RAM-backed files (``/dev/shm``, memfd, deleted files) are not
    counted: their pages are memory the process holds like any other."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        parts = line.split(maxsplit=5)
        path = parts[5] if len(parts) == 6 else ""
        if not path.startswith("/") or path.startswith("/dev/") or path.endswith("(deleted)"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi))
    out.sort()
    joined: list[tuple[int, int]] = []
    for lo, hi in out:  # one file mapping the kernel keeps in several pieces
        if joined and lo == joined[-1][1]:
            joined[-1] = (joined[-1][0], hi)
        else:
            joined.append((lo, hi))
    return joined


def file_backed(tensors: list[torch.Tensor]) -> list[bool]:
    """For each tensor: whether its bytes live in a file mapping (a memory-mapped checkpoint:
    ``safetensors``, ``torch.load(mmap=True)``, a host's own mapping of the file) rather than in
    anonymous memory. Such pages are the file's: the kernel drops and reads them again as it
    needs, so a copy of them is RAM the process did not hold before."""
    maps = None
    out = []
    for t in tensors:
        st = t.untyped_storage()
        if getattr(st, "filename", None):  # torch's own file storages (from_file, load(mmap=True))
            out.append(True)
            continue
        if maps is None:
            maps = _file_mappings() or []
        ptr, n = t.data_ptr(), t.numel() * t.element_size()  # the bytes a copy would read
        k = bisect.bisect_right(maps, (ptr, float("inf"))) - 1
        out.append(n > 0 and k >= 0 and maps[k][0] <= ptr and ptr + n <= maps[k][1])
    return out


class BounceBuffer:
    """Page-locked pieces the bytes of file-backed weights pass through on their way to the
    device: the host fills a piece from the mapping, a copy stream moves it, and the piece is
    filled again only after that copy has finished (``take`` waits). Shared by the process's
    executors (events order every reader, whatever its stream); unregistered by its finalizer
    after the copies reading it."""

    def __init__(self, piece: int, pieces: int, place: torch.device) -> None:
        self.piece = piece
        self.bufs = [_host_buffer(piece) for _ in range(pieces)]
        self._pieces = [_BouncePiece(b, place) for b in self.bufs]
        self.page_locked = all(p.page_locked for p in self._pieces)
        self.nbytes = piece * pieces
        self._next = 0
        # held for a whole unit's pass (the reader's, or a host's filling from a mapping): the
        # process's executors share the pieces and the order they are taken in
        self.lock = threading.Lock()

    def take(self) -> tuple[torch.Tensor, int]:
        """The next piece to fill, once no copy reads it any more."""
        k = self._next
        self._next = (k + 1) % len(self.bufs)
        readers = self._pieces[k].readers
        for ev in list(readers.values()):
            if not ev.query():
                ev.synchronize()  # hazard: the host refilling a bounce piece a copy still reads
        readers.clear()
        return self.bufs[k], k

    def read_by(self, k: int, stream, done) -> None:
        self._pieces[k].readers[id(stream)] = done

    def pass_through(self, buf: torch.Tensor, base: int, nbytes: int, copy_stream,
                     fill: Callable[[torch.Tensor, int, int], None]) -> None:
        """Copy ``nbytes`` into ``buf`` from byte ``base`` piece by piece through the buffer:
        ``fill(piece, lo, hi)`` writes bytes [lo, hi) into a piece (a disk read, or the host's
        fill from a mapping), its copy is issued on ``copy_stream`` and an event per piece says
        when it may be filled again (``take``). Under ``lock``: the process's executors share the
        pieces and the order they are taken in."""
        with self.lock:
            for lo in range(0, nbytes, self.piece):
                hi = min(lo + self.piece, nbytes)
                piece, k = self.take()
                fill(piece[:hi - lo], lo, hi)
                buf[base + lo:base + hi].copy_(piece[:hi - lo], non_blocking=True)
                done = torch.cuda.Event()
                done.record(copy_stream)
                self.read_by(k, copy_stream, done)


class _BouncePiece:
    def __init__(self, buf: torch.Tensor, place: torch.device) -> None:
        self.readers: dict[int, object] = {}
        self._fin = None
        self.page_locked = _register(buf, self.readers, place, self)


_BOUNCE: "weakref.ref[BounceBuffer] | None" = None


def bounce_buffer(nbytes: int, place: torch.device) -> BounceBuffer | None:
    """The process's bounce buffer, with pieces of at least ``min(nbytes, BOUNCE_PIECE)``
    bytes (one of smaller pieces is replaced: its own finalizer unpins it after its
    copies); None where it cannot be page-locked (the copy is then synchronous, on purpose)."""
    global _BOUNCE
    want = min(BOUNCE_PIECE, max(nbytes, 1))
    w = _BOUNCE() if _BOUNCE is not None else None
    if w is None or w.piece < want:
        w = BounceBuffer(want, BOUNCE_PIECES, place)
        if not w.page_locked:
            return None  # dropped: what was pinned is unpinned by the pieces' finalizers
        _BOUNCE = weakref.ref(w)
    return w


_SHARED_MASTERS: "weakref.WeakValueDictionary[tuple, _HostMaster]" = weakref.WeakValueDictionary()


class _HostMaster:
    """One unit's plain tensors in a single flat host buffer, page-locked when possible.

    Owned for the process: shared by every executor on the same tensors, kept across sessions,
    unregistered when the last owner drops it (after the copies reading it have finished)."""

    def __init__(self, unit: Unit, layout: Layout, place: torch.device | None = None, pin: bool = True) -> None:
        # outside inference mode: the parameters will live in this buffer for good, and must not
        # turn into inference tensors (training nodes leave inference mode)
        with torch.inference_mode(False):
            self.buf = _host_buffer(layout.nbytes)
            for i, off, n in layout.flat:
                t = unit.tensors[i].tensor
                view(self.buf, off, n, t).copy_(t.data)
            for i, off, n in layout.flat:  # the flat buffer is now the master: drop the old storage
                t = unit.tensors[i].tensor
                t.data = view(self.buf, off, n, t)
            for i, spans in layout.quant.items():
                t = unit.tensors[i].tensor
                for v, p in zip(quant_views(self.buf, t, spans), quant.parts(t)):
                    v.copy_(p)
            for i, spans in layout.quant.items():  # likewise for quantized tensors' parts
                t = unit.tensors[i].tensor
                quant.rehome_(t, quant_views(self.buf, t, spans))
        self.readers: dict[int, object] = {}   # copy stream id -> event of its last copy from here
        self._fin = None
        self.page_locked = pin and _register(self.buf, self.readers,
                                             place if place is not None else torch.device("cuda"), self)

    def backs(self, unit: Unit, layout: Layout) -> bool:
        """Do the unit's tensors still live in this buffer?"""
        base = self.buf.data_ptr()
        return (all(unit.tensors[i].tensor.data_ptr() == base + off for i, off, _ in layout.flat)
                and all(p.data_ptr() == base + off for i, spans in layout.quant.items()
                        for (off, _), p in zip(spans, quant.parts(unit.tensors[i].tensor))))

    def read_by(self, stream, done) -> None:
        self.readers[id(stream)] = done

    def release(self) -> None:
        """Unpin (after the copies reading it); the tensors keep living in the pageable buffer."""
        if self._fin is not None:
            self._fin()
        self.page_locked = False


def masters_holding(unit: Unit) -> list:
    """Page-locked masters whose buffers hold ``unit``'s tensors although they are not its own (a
    part of a unit cut finer still lives in the whole unit's master): a copy from them must be
    waited for before they are unpinned."""
    spans = [(m.buf.data_ptr(), m.buf.data_ptr() + m.buf.numel(), m)
             for m in list(_SHARED_MASTERS.values()) if m.page_locked]
    out = []
    for ut in unit.tensors:
        try:
            ptr = ut.tensor.data_ptr()
        except RuntimeError:
            continue
        for lo, hi, m in spans:
            if lo <= ptr < hi and m not in out:
                out.append(m)
    return out


class HostMasters:
    """One executor's view of the process's host masters: the master of each streamed unit,
    built (or found shared) on first use. Dropping it drops its references; a master no other
    executor shares is unpinned by its own finalizer, after the copies that read it."""

    def __init__(self, units: Callable[[str], Unit], layout: Callable[[str], Layout], pin: bool,
                 place: torch.device, keep_file_backed: bool = False, cuda: bool | None = None) -> None:
        self._unit, self._layout, self.pin, self._place = units, layout, pin, place
        self.cuda = pin if cuda is None else cuda
        self.keep_file_backed = keep_file_backed
        self.masters: dict[str, _HostMaster] = {}
        self._from_file: dict[str, tuple[tuple, bool]] = {}  # unit -> (its tensors' addresses, answer)
        self._bounce: BounceBuffer | None = None
        from .host_tiers import HostTiers
        self.tiers = HostTiers(units, layout, self)  # under a RAM budget: which units are in RAM

    def get(self, name: str) -> _HostMaster | None:
        """The flat host master of a streamed unit (CUDA only). None means: copy tensor by tensor
        from where they are (CPU; tensors the host has already page-locked itself), or through
        the bounce buffer (``bounce``: file-backed tensors kept as their own masters)."""
        tier = self.tiers.of(name)
        if tier is not None and tier != RAM:
            return None  # resident or on disk: read from its file
        if tier is None and (not self.pin or self.from_file(name)):
            return None
        unit, lay = self._unit(name), self._layout(name)
        m = self.masters.get(name)
        if m is not None and not m.backs(unit, lay):
            m.release()  # someone moved the tensors since (the host): rebuild
            m = None
        if m is None:
            if not lay.nbytes:
                return None
            key = tuple(id(unit.tensors[i].tensor) for i in [i for i, _, _ in lay.flat] + list(lay.quant))
            m = _SHARED_MASTERS.get(key)  # another executor on the same tensors built it
            if m is None or not m.backs(unit, lay):
                if any(unit.tensors[i].tensor.is_pinned() for i, _, _ in lay.flat):
                    return None  # the host page-locked them itself: copy from where they are
                m = _SHARED_MASTERS[key] = _HostMaster(unit, lay, self._place, pin=self.pin)
            self.masters[name] = m
        return m

    def from_file(self, name: str) -> bool:
        """Whether unit ``name`` streams from the file mapping its tensors live in (with
        ``keep_file_backed``: a unit with any file-backed tensor; the others are in RAM already
        and pass through the bounce buffer with it)."""
        if not self.keep_file_backed:
            return False
        unit, lay = self._unit(name), self._layout(name)
        tensors = [unit.tensors[i].tensor for i, _, _ in lay.flat]
        tensors += [p for i in lay.quant for p in quant.parts(unit.tensors[i].tensor)]
        where = tuple(t.data_ptr() for t in tensors)
        known = self._from_file.get(name)
        if known is None or known[0] != where:
            known = self._from_file[name] = (where, any(file_backed(tensors)))
        return known[1]

    def bounce(self, name: str) -> BounceBuffer | None:
        """The page-locked bounce buffer a file-backed unit is copied through (CUDA, pinning on); None
        means: copy tensor by tensor from where they are."""
        lay = self._layout(name)
        if self.tiers.of(name) is not None:  # under a RAM budget: a unit read from its file
            if not self.cuda or not self.pin or self.tiers.reads(name) is None:
                return None
        elif not self.pin or not lay.nbytes or not self.from_file(name):
            return None
        t = self.tiers.tiers
        # under a RAM budget the pieces are the plan's from the first read: never two buffers at once
        w = bounce_buffer(t.bounce_bytes // BOUNCE_PIECES if t is not None else lay.nbytes, self._place)
        self._bounce = w  # held while this executor streams: the process keeps one
        return w

    def forget(self) -> None:
        """Unpin and drop every master (the module's tensors were replaced from outside)."""
        for m in self.masters.values():
            m.release()
        self.masters.clear()
        self._from_file.clear()
        self.tiers.forget()
