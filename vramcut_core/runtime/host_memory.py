"""Host memory: the flat host masters of streamed units, their page-locking and its ledger, and
the staging copy of a master that could not be page-locked.

Owns and frees host memory, nothing on the device. A master is owned for the process: shared by
executors on the same tensors, kept across sessions, page-locked up to a cap (``PIN_FRACTION``
of RAM, portable to every GPU) and unpinned by its own finalizer once the copies reading it have
finished. The one rule: host memory is never unregistered (or written) while a copy may read it.
A failed registration's pending CUDA error is cleared where it happens. May call torch only.
"""
from __future__ import annotations

import os
import weakref
from typing import Callable

import torch

from .. import quant
from ..units import Unit
from .layout import Layout, quant_views, view

_HOST_REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: page-locked for every GPU, not only the current one
PIN_FRACTION = 0.45           # at most this share of physical RAM is page-locked by the pack
                              # (Windows refuses past about half of RAM; the host pins too)


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


class _PinLedger:
    """Bytes the pack has page-locked in this process, against a cap; ``room`` (set by a host
    that pins memory itself) says how many more bytes its own limit leaves for the pack."""

    def __init__(self) -> None:
        self.bytes = 0
        self.cap: int | None = None
        self.room: Callable[[], int] | None = None

    def limit(self) -> int | None:
        if self.cap is None:
            ram = _physical_ram()
            self.cap = int(ram * PIN_FRACTION) if ram else -1
        return None if self.cap < 0 else self.cap

    def allows(self, n: int) -> bool:
        cap = self.limit()
        if cap is not None and self.bytes + n > cap:
            return False
        return self.room is None or n <= self.room()


PINNED = _PinLedger()


def _clear_cuda_error(place: torch.device) -> None:
    """A failed runtime call (cudaHostRegister) stays the thread's last CUDA error, and the next
    unrelated kernel launch would raise it ("CUDA error: out of memory", not an OutOfMemoryError).
    A tiny kernel launch reads and clears it here, where it is expected."""
    try:
        torch.empty(1, dtype=torch.uint8, device=place).zero_()
    except RuntimeError:
        pass


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
    PINNED.bytes -= buf.numel()


def staged(buf: torch.Tensor, place: torch.device) -> tuple[torch.Tensor, bool]:
    """A page-locked copy of a pageable master from torch's host allocator (reused after the copy
    that reads it has finished), so the device copy stays asynchronous; the master itself where
    that fails."""
    try:
        return buf.pin_memory(), True
    except RuntimeError:
        _clear_cuda_error(place)
        return buf, False


_SHARED_MASTERS: "weakref.WeakValueDictionary[tuple, _HostMaster]" = weakref.WeakValueDictionary()


class _HostMaster:
    """One unit's plain tensors in a single flat host buffer, page-locked when possible.

    Owned for the process: shared by every executor on the same tensors, kept across sessions,
    unregistered when the last owner drops it (after the copies reading it have finished)."""

    def __init__(self, unit: Unit, layout: Layout, place: torch.device | None = None) -> None:
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
        self.pinned = False
        self.readers: dict[int, object] = {}   # copy stream id -> event of its last copy from here
        self._fin = None
        place = place if place is not None else torch.device("cuda")
        if self.buf.numel() and PINNED.allows(self.buf.numel()):
            try:
                err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(),
                                                           _HOST_REGISTER_PORTABLE)
                self.pinned = int(getattr(err, "value", err)) == 0
            except Exception:
                self.pinned = False
            if self.pinned:
                PINNED.bytes += self.buf.numel()
                self._fin = weakref.finalize(self, _unpin, self.buf, self.readers, place)
            else:
                _clear_cuda_error(place)

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
        self.pinned = False


class HostMasters:
    """One executor's view of the process's host masters: the master of each streamed unit,
    built (or found shared) on first use. Dropping it drops its references; a master no other
    executor shares is unpinned by its own finalizer, after the copies that read it."""

    def __init__(self, units: Callable[[str], Unit], layout: Callable[[str], Layout], pin: bool,
                 place: torch.device) -> None:
        self._unit, self._layout, self.pin, self._place = units, layout, pin, place
        self.masters: dict[str, _HostMaster] = {}

    def get(self, name: str) -> _HostMaster | None:
        """The flat host master of a streamed unit (CUDA only). None means: copy tensor by tensor
        from where they are (CPU; tensors the host has already page-locked itself)."""
        if not self.pin:
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
                m = _SHARED_MASTERS[key] = _HostMaster(unit, lay, self._place)
            self.masters[name] = m
        return m

    def forget(self) -> None:
        """Unpin and drop every master (the module's tensors were replaced from outside)."""
        for m in self.masters.values():
            m.release()
        self.masters.clear()
