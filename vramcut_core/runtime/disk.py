"""Disk: the files the weights of disk-tier units are read from, each call, and the reader.

Owns the open files (``WeightFile``: path, descriptor and the identity the file had when its
bytes were found equal to the weights: device, inode, size, modification time), the reader
thread, and the cache file of a model whose weights were in anonymous memory. A tensor mapped
from a file (a memory-mapped checkpoint: safetensors, ``torch.load(mmap=True)``, a GGUF reader's
``numpy.memmap``, the host's own mapping) is read from that file at the offset its mapping gives
(``/proc/self/maps``): its bytes are the file's, so no copy is made. Where a mapping's pages were
written (a copy-on-write page holds other bytes than the file: ``Anonymous`` in
``/proc/self/smaps``), or the tensor lives in anonymous memory, its bytes are written once to the
model's cache file (its own directory, ``cache_dir()``; removed with the model, and those of
processes gone are removed when a new one is made) and the tensor is mapped from there,
read-only in effect (a private mapping: a write would stay in memory, never reach the file).

The reader thread runs ``os.preadv``, which releases the GIL, into the destination's memory (a
page-locked bounce piece on CUDA, the slot itself on CPU). The one rule: a read never returns
wrong bytes silently. Every file is checked before each call (``check``: removed, replaced,
truncated, modified), a read that comes back short or fails (EIO) raises ``DiskTierError``
naming the file, and the file is usable again once it is back as it was.

The page cache of these files counts against no budget: the pack never touches the mapped pages
(it reads with ``preadv``) and locks none, so the kernel reclaims them under memory pressure (a
memory cgroup counts them until it does). May call torch, ``layout`` and ``quant``.
"""
from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import logging
import mmap
import os
import threading
import weakref

import torch

log = logging.getLogger("vramcut")

CACHE_ENV = "VRAMCUT_CACHE_DIR"
PAGE = mmap.ALLOCATIONGRANULARITY


class DiskTierError(OSError):
    """A weights file a disk-tier unit reads changed, went away, or could not be read."""

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        super().__init__(f"VRAMCut: the weights file {path} {what}; the model reads its weights from it "
                         "on every call (its disk tier): put the file back as it was, or load the model again")


def cache_dir() -> str:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "vramcut")
    return os.path.join(root, "tiers")


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class WeightFile:
    """One file weights are read from, with the identity it had when they were found in it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.ident = _identity(os.fstat(self.fd))
        self._close = weakref.finalize(self, os.close, self.fd)

    def check(self) -> None:
        """Raise ``DiskTierError`` unless the file at ``path`` is the one the weights were found in
        (same device, inode, size and modification time); reopen it once it is back."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise DiskTierError(self.path, "was removed") from None
        except OSError as e:
            raise DiskTierError(self.path, f"cannot be read ({e.strerror})") from None
        now = _identity(st)
        if now == self.ident:
            if _identity(os.fstat(self.fd)) != self.ident:  # it went away and is back: read it again
                old = self._close.detach()
                self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._close = weakref.finalize(self, os.close, self.fd)
                if old is not None:  # closed on the reader, after the reads issued ahead on it (in
                    reader().submit(os.close, *old[2])  # order): its number is never reused under one
            return
        if now[:2] != self.ident[:2]:
            raise DiskTierError(self.path, "was replaced by another file")
        if now[2] != self.ident[2]:
            raise DiskTierError(self.path, f"changed size ({self.ident[2]} bytes, now {now[2]}: truncated or grown)")
        raise DiskTierError(self.path, "was modified")

    def grown(self) -> None:
        """The pack appended to this file (its cache file): what it is now is what is read."""
        self.ident = _identity(os.fstat(self.fd))


_FILES: "weakref.WeakValueDictionary[str, WeightFile]" = weakref.WeakValueDictionary()
_FILES_LOCK = threading.Lock()


def weight_file(path: str) -> WeightFile:
    """The process's one ``WeightFile`` for ``path`` (opened on first use)."""
    with _FILES_LOCK:
        f = _FILES.get(path)
        if f is None:
            f = _FILES[path] = WeightFile(path)
        return f


# -- where a tensor's bytes are in a file ------------------------------------------------------

def _mappings() -> list[tuple[int, int, int, str, bool]]:
    """The file mappings of this process: (start, end, file offset, path, written), joined where
    the kernel keeps one mapping in pieces; ``written``: some of its pages are private copies
    (``Anonymous`` in smaps), whose bytes need not be the file's."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out: list[list] = []
    cur = None
    for line in lines:
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            path = head[5] if len(head) == 6 else ""
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            ok = path.startswith("/") and not path.startswith("/dev/") and not path.endswith("(deleted)")
            cur = [lo, hi, int(head[2], 16), path, False] if ok else None
            if cur is not None:
                out.append(cur)
        elif cur is not None and line.startswith("Anonymous:") and int(line.split()[1]) > 0:
            cur[4] = True
    out.sort()
    joined: list[list] = []
    for m in out:
        p = joined[-1] if joined else None
        if p is not None and m[0] == p[1] and m[3] == p[3] and m[2] == p[2] + (p[1] - p[0]):
            p[1], p[4] = m[1], p[4] or m[4]
        else:
            joined.append(m)
    return [tuple(m) for m in joined]


def locate(tensors: list[torch.Tensor]) -> list[tuple[str, int] | None]:
    """For each tensor: (file, offset) where its bytes are, from the file mapping it lives in;
    None for a tensor in anonymous memory, one not contiguous, or one in pages written since
    they were mapped."""
    maps = None
    out: list[tuple[str, int] | None] = []
    for t in tensors:
        n = t.numel() * t.element_size()
        if not n or not t.is_contiguous() or t.device.type != "cpu":
            out.append(None)
            continue
        if maps is None:
            maps = _mappings()
            starts = [m[0] for m in maps]
        ptr = t.data_ptr()
        k = bisect.bisect_right(starts, ptr) - 1
        if k < 0 or not (maps[k][0] <= ptr and ptr + n <= maps[k][1]) or maps[k][4]:
            out.append(None)
            continue
        out.append((maps[k][3], maps[k][2] + ptr - maps[k][0]))
    return out


def mapped(path: str, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of ``path`` from ``offset`` as a uint8 tensor on a private read-only-in-effect
    mapping (pages come from the file on first touch; a write stays in memory)."""
    start = offset - offset % PAGE
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), offset - start + nbytes, access=mmap.ACCESS_COPY, offset=start)
    return torch.frombuffer(mm, dtype=torch.uint8)[offset - start:offset - start + nbytes]


# -- the cache file of weights in anonymous memory --------------------------------------------

def _sweep(d: str) -> None:
    """Remove cache files of processes that are gone (stale: nobody reads them)."""
    try:
        names = os.listdir(d)
    except OSError:
        return
    for name in names:
        pid = name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.remove(os.path.join(d, name))
            except OSError:
                pass
        except PermissionError:
            pass


class CacheFile:
    """A model's cache file: the bytes of its disk-tier weights that no checkpoint holds as they
    are (cast on load, in anonymous memory), each written once, page-aligned. Removed when the
    model's tiers go (its finalizer)."""

    _count = 0

    def __init__(self) -> None:
        d = cache_dir()
        os.makedirs(d, exist_ok=True)
        _sweep(d)
        CacheFile._count += 1
        self.path = os.path.join(d, f"{os.getpid()}-{id(self):x}-{CacheFile._count}.bin")
        self.size = 0
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._fin = weakref.finalize(self, _remove, fd, self.path)
        self._fd = fd

    def append(self, chunks: list[torch.Tensor]) -> int:
        """Write ``chunks`` (uint8 host tensors) back to back at the next page; their offset."""
        off = -(-self.size // PAGE) * PAGE
        pos = off
        for c in chunks:
            pos += _pwrite_all(self._fd, c, pos, self.path)
        os.fsync(self._fd)
        self.size = pos
        log.info("VRAMCut: wrote %d MiB of weights to the cache file %s (now %d MiB)",
                 (pos - off) >> 20, self.path, self.size >> 20)
        return off


def _remove(fd: int, path: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.remove(path)
    except OSError:
        pass


def _pwrite_all(fd: int, t: torch.Tensor, pos: int, path: str) -> int:
    n = t.numel()
    mv = _memory(t)
    done = 0
    while done < n:
        k = os.pwrite(fd, mv[done:], pos + done)
        if k <= 0:
            raise DiskTierError(path, "could not be written (disk full?)")
        done += k
    return n


# -- the reader ---------------------------------------------------------------------------------

def _memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 host tensor as a writable memoryview (no copy)."""
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


def read_into(dest: torch.Tensor, reads: list[tuple[int, WeightFile, int, int]]) -> int:
    """Fill ``dest`` (uint8, host): each ``(dest offset, file, file offset, nbytes)``; the bytes
    read. A short read or a failed one raises ``DiskTierError`` naming the file."""
    mv = _memory(dest)
    total = 0
    for d, f, off, n in reads:
        got = 0
        while got < n:
            try:
                k = os.preadv(f.fd, [mv[d + got:d + n]], off + got)
            except OSError as e:
                raise DiskTierError(f.path, f"could not be read ({e.strerror or e})") from None
            if k <= 0:
                raise DiskTierError(f.path, f"came back short ({off + got} bytes of it were there, "
                                            f"{off + n} were expected)")
            got += k
        total += n
    return total


def clip(reads: list[tuple[int, WeightFile, int, int]], lo: int, hi: int) -> list[tuple[int, WeightFile, int, int]]:
    """The part of ``reads`` (by destination offset) that fills ``[lo, hi)``, offsets from ``lo``."""
    out = []
    for d, f, off, n in reads:
        a, b = max(d, lo), min(d + n, hi)
        if a < b:
            out.append((a - lo, f, off + a - d, b - a))
    return out


_READER: concurrent.futures.ThreadPoolExecutor | None = None


def reader() -> concurrent.futures.ThreadPoolExecutor:
    """The process's reader thread (``preadv`` releases the GIL while the disk works)."""
    global _READER
    if _READER is None:
        _READER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vramcut-disk")
    return _READER
