"""Host-to-device copy bandwidth and matrix-product throughput, measured once per device and cached.

The node estimates what streaming will cost before a run has measured it: streamed bytes per
forward divided by the bandwidth the executor's copies get on this machine. That bandwidth is
measured here, once per device (pinned host memory to the GPU; on CPU, a plain memory copy, which
is what the CPU executor does), and kept in memory and in a small JSON file so the next process
does not measure again.

``disk_read(path)`` measures the read rate of the disk a weights file is on, cold (its pages
dropped first) and from the page cache, once per disk, cached the same way: the host tiers plan
reads from disk by it.

Beside it, ``matmul_throughput(device, dtype)`` measures floating-point operations per second of
a square matrix product on the device in that dtype (on CPU, the CPU's), once per device and
dtype: with the dry run's per-unit FLOP counts it gives each unit's compute time before any run.

The cache file is ``$VRAMCUT_CACHE_DIR/bandwidth.json`` (default ``~/.cache/vramcut``); a cache
that cannot be read or written only means measuring again. One rule: a figure in the cache was
measured on this machine for this device name, never assumed.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

import torch

from ..model.tensors import MIB

CACHE_ENV = "VRAMCUT_CACHE_DIR"
CACHE_FILE = "bandwidth.json"
PROBE_BYTES = 64 * MIB     # large enough to reach the link's rate, small enough to be quick
PROBE_REPEATS = 3          # the best of these is kept: the first copy pays for warm-up
MATMUL_N = {"cuda": 4096, "cpu": 512}  # side of the probe's square matrices (CPU: quick on one core)

_lock = threading.Lock()
_memo: dict[str, dict] = {}


def cache_path() -> str:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "vramcut")
    return os.path.join(root, CACHE_FILE)


def device_key(device) -> str:
    """A name that identifies the copy path: the GPU's model for CUDA, ``cpu`` otherwise."""
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{torch.cuda.get_device_name(idx)}"
    return dev.type


def _read_cache() -> dict:
    try:
        with open(cache_path(), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict) -> None:
    path = cache_path()
    try:
        data = _read_cache()
        data[key] = entry
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only means measuring again next time


def measure(device, nbytes: int = PROBE_BYTES, repeats: int = PROBE_REPEATS) -> float:
    """Bytes per second of a host-to-``device`` copy of ``nbytes`` (best of ``repeats``)."""
    dev = torch.device(device)
    n = max(1, int(nbytes))
    best = float("inf")
    if dev.type == "cuda":
        src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    else:
        src = torch.ones(n, dtype=torch.uint8)
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    return n / max(best, 1e-9)


def _figure(key: str, field: str, about: dict, measure_now: Callable[[], float], probe: dict) -> dict:
    """``{field, **about, "source"}`` for ``key``: from memory, the cache file, or ``measure_now()``
    (then written to the cache with ``probe``, what was measured); ``source`` says which, and
    ``field`` is None when it could not be measured."""
    with _lock:
        hit = _memo.get(key)
        if hit is not None:
            return dict(hit, source="memory" if hit["source"] != "unmeasurable" else hit["source"])
        cached = _read_cache().get(key)
        if isinstance(cached, dict) and isinstance(cached.get(field), (int, float)) and cached[field] > 0:
            entry = {field: float(cached[field]), **about, "source": "cache"}
        else:
            try:
                value = measure_now()
                entry = {field: value, **about, "source": "measured"}
                _write_cache(key, {field: value, **probe,
                                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            except Exception:  # no memory for the probe, a device that went away, a dtype it cannot
                entry = {field: None, **about, "source": "unmeasurable"}   # multiply: no estimate
        _memo[key] = entry
        return dict(entry)


def host_to_device(device) -> dict:
    """``{"bytes_per_s", "device", "source"}`` for ``device``: from memory, the cache file, or
    measured now (``source`` says which). ``bytes_per_s`` is None when it could not be measured."""
    key = device_key(device)
    return _figure(key, "bytes_per_s", {"device": key}, lambda: measure(device), {"probe_bytes": PROBE_BYTES})


def cached_host_to_device(device) -> float | None:
    """The host-to-``device`` bytes per second measured before (in this process or in the cache
    file), without measuring now; None when there is none (or the device has no name here)."""
    try:
        key = device_key(device)
    except Exception:  # a device this build of torch cannot name
        return None
    with _lock:
        hit = _memo.get(key)
        if hit is not None:
            return hit["bytes_per_s"]
        cached = _read_cache().get(key)
    if isinstance(cached, dict) and isinstance(cached.get("bytes_per_s"), (int, float)) and cached["bytes_per_s"] > 0:
        return float(cached["bytes_per_s"])
    return None


def measure_matmul(device, dtype=torch.float32, n: int | None = None, repeats: int = PROBE_REPEATS) -> float:
    """Floating-point operations per second of an ``n`` x ``n`` matrix product on ``device`` in
    ``dtype`` (best of ``repeats``, after one warm-up product; 2 n^3 operations each)."""
    dev = torch.device(device)
    n = int(n or MATMUL_N.get(dev.type, MATMUL_N["cpu"]))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=dev, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: kernel selection, first-touch pages
    best = float("inf")
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / max(best, 1e-9)


def matmul_key(device, dtype) -> str:
    return f"matmul:{device_key(device)}:{str(dtype).replace('torch.', '')}"


def matmul_throughput(device, dtype=torch.float32) -> dict:
    """``{"flops_per_s", "device", "dtype", "source"}`` for a matrix product on ``device`` in
    ``dtype``: from memory, the cache file, or measured now, as ``host_to_device``.
    ``flops_per_s`` is None when it could not be measured."""
    about = {"device": device_key(device), "dtype": str(dtype).replace("torch.", "")}
    return _figure(matmul_key(device, dtype), "flops_per_s", about, lambda: measure_matmul(device, dtype),
                   {"n": MATMUL_N.get(torch.device(device).type)})


def disk_key(path: str) -> str:
    """A name for the disk ``path`` is on: its block device (``disk:MAJOR:MINOR``)."""
    st = os.stat(path)
    return f"disk:{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def measure_disk(path: str, nbytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(cold, page cache) bytes per second of ``os.preadv`` reads of ``nbytes`` from the middle of
    ``path``: cold after ``posix_fadvise(DONTNEED)`` drops the range's pages (pages some process
    maps stay: a figure from a file in use may be nearer the page cache's), then the same range
    again from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        n = int(nbytes)
        if size < n:  # a small file's read is all latency: no figure for the disk
            raise OSError(f"{path} is smaller than the probe ({size} < {n} bytes)")
        off = (size - n) // 2 // 4096 * 4096
        buf = bytearray(min(n, 16 * MIB))
        mv = memoryview(buf)

        def read() -> float:
            t0 = time.perf_counter()
            done = 0
            while done < n:
                k = os.preadv(fd, [mv[:min(len(buf), n - done)]], off + done)
                if k <= 0:
                    break
                done += k
            return max(done, 1) / max(time.perf_counter() - t0, 1e-9)

        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        cold = read()
        cached = max(read(), read())
        return cold, cached
    finally:
        os.close(fd)


def disk_read(path: str) -> dict:
    """``{"cold_bytes_per_s", "cached_bytes_per_s", "device", "source"}`` for reads from the disk
    ``path`` is on: from memory, the cache file, or measured now on ``path`` (as
    ``host_to_device``; the two rates are kept as ``disk:MAJOR:MINOR:cold`` and ``:cached``).
    The rates are None when they could not be measured."""
    try:
        key = disk_key(path)
    except OSError:
        return {"cold_bytes_per_s": None, "cached_bytes_per_s": None, "device": None, "source": "unmeasurable"}
    both: dict = {}

    def rates() -> tuple[float, float]:
        if "r" not in both:
            both["r"] = measure_disk(path)
        return both["r"]

    probe = {"probe_bytes": PROBE_BYTES}
    cold = _figure(key + ":cold", "bytes_per_s", {"device": key}, lambda: rates()[0], probe)
    warm = _figure(key + ":cached", "bytes_per_s", {"device": key}, lambda: rates()[1], probe)
    return {"cold_bytes_per_s": cold["bytes_per_s"], "cached_bytes_per_s": warm["bytes_per_s"], "device": key,
            "source": cold["source"]}


def forget() -> None:
    """Drop what this process remembers (tests; the cache file is kept)."""
    with _lock:
        _memo.clear()
