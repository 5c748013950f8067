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

The bandwidth probe times a large copy and a small one (each the best of a few) and fits
``seconds = latency + bytes / bandwidth`` through them: ``bytes_per_s`` and ``latency_s`` (the
fixed cost of one copy) are cached together, and the timeline charges both.

``executor_call(device, measure)`` keeps the executor's own fixed cost of a call beside them
(measured by the executor: a call of a plan with no units).

``device_to_device(src, dst)`` measures the link between two GPUs the same way (a large peer copy
and a small one, as a hop makes them, fitted and cached under the link's name): a placement
across devices times its hops by it.

Probes run inside the engine's budget: ``max_bytes`` (what the budget leaves when the probe runs)
sizes each probe's device buffers, counted as the caching allocator rounds them; a probe that
cannot be sized to fit allocates nothing and answers "no room" (not remembered: a later call with
room measures). A dtype no matrix product runs in (fp8) allocates nothing and has no figure.

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
# Each probe buffer is at least torch's kMinLargeAlloc (10 MiB): a segment of its own, so what it
# takes is known (a smaller request shares a 2 or 20 MiB segment with others)
MIN_PROBE_BYTES = 10 * MIB
LARGE_ROUND = 2 * MIB      # kRoundLarge
SMALL_PROBE_BYTES = 64 * 1024  # the small copy of the fit: mostly the fixed cost of one copy
PROBE_REPEATS = 3          # the best of these is kept: the first copy pays for warm-up
MATMUL_N = {"cuda": 4096, "cpu": 512}  # side of the probe's square matrices (CPU: quick on one core)
MATMUL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what the probe multiplies
NO_ROOM = "no room"        # the source of a figure not measured because the budget left too little

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


def _placement(device: torch.device) -> torch.device:
    """Where the probes' device tensors are made: the device itself (a seam: the simulated
    accelerator in the tests maps it to host memory)."""
    return device


def _pinned(n: int) -> torch.Tensor:
    """``n`` bytes of page-locked host memory."""
    return torch.empty(n, dtype=torch.uint8).pin_memory()


def copy_seconds(device, nbytes: int, repeats: int = PROBE_REPEATS, bufs=None) -> float:
    """Seconds of a host-to-``device`` copy of ``nbytes`` (best of ``repeats``): from page-locked
    memory on CUDA, a plain memory copy on CPU. ``bufs``: (source, destination) of at least
    ``nbytes`` to copy between (else made here)."""
    dev = torch.device(device)
    n = max(1, int(nbytes))
    best = float("inf")
    if dev.type == "cuda":
        src, dst = bufs or (_pinned(n), torch.empty(n, dtype=torch.uint8, device=_placement(dev)))
        src, dst = src[:n], dst[:n]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    else:
        src, dst = bufs or (torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8, device=dev))
        src, dst = src[:n], dst[:n]
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure(device, nbytes: int = PROBE_BYTES, repeats: int = PROBE_REPEATS) -> float:
    """Bytes per second of a host-to-``device`` copy of ``nbytes`` (best of ``repeats``)."""
    return max(1, int(nbytes)) / copy_seconds(device, nbytes, repeats)


def fit_copy(device, nbytes: int = PROBE_BYTES, small: int = SMALL_PROBE_BYTES,
             repeats: int = PROBE_REPEATS) -> tuple[float, float]:
    """``(bytes_per_s, latency_s)`` through a copy of ``nbytes`` and one of ``small`` bytes (the
    start of the same buffers: nothing more is allocated): ``seconds = latency + bytes / bandwidth``
    (a latency below zero, timing noise, is taken as 0)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        bufs = (_pinned(nbytes), torch.empty(nbytes, dtype=torch.uint8, device=_placement(dev)))
    else:
        bufs = (torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8, device=dev))
    small = min(small, nbytes // 2)
    return _fit(nbytes, copy_seconds(device, nbytes, repeats, bufs), small, copy_seconds(device, small, repeats, bufs))


def _fit(big: int, big_s: float, small: int, small_s: float) -> tuple[float, float]:
    """``(bytes_per_s, latency_s)`` of the line through two timed copies (a latency below zero,
    timing noise, is taken as 0)."""
    per_byte = (big_s - small_s) / (big - small) if big_s > small_s else big_s / big
    return 1.0 / per_byte, max(0.0, small_s - small * per_byte)


def _device_bytes(nbytes: int) -> int:
    """What a probe buffer of ``nbytes`` (10 MiB or more) takes in torch's CUDA caching allocator: a
    segment of its own, rounded up to 2 MiB (kMinLargeAlloc, kRoundLarge)."""
    return -(-nbytes // LARGE_ROUND) * LARGE_ROUND


def probe_bytes(max_bytes: int | None, full: int = PROBE_BYTES) -> int:
    """The bandwidth probe's copy size where ``max_bytes`` of device memory are free for it (the
    allocator's rounding counted): the full probe where it fits, else the largest multiple of
    2 MiB that fits; 0 when that is under ``MIN_PROBE_BYTES``."""
    if max_bytes is None or _device_bytes(full) <= max_bytes:
        return full
    n = max_bytes - max_bytes % LARGE_ROUND
    return n if n >= MIN_PROBE_BYTES else 0


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


def host_to_device(device, max_bytes: int | None = None) -> dict:
    """``{"bytes_per_s", "latency_s", "device", "source"}`` for ``device``: from memory, the cache
    file, or measured now (``source`` says which) with a probe sized to ``max_bytes`` of device
    memory (``probe_bytes``). ``bytes_per_s`` is None when it could not be measured ("no room":
    the budget left too little; asked again later, it measures)."""
    key = device_key(device)
    n = probe_bytes(max_bytes) if torch.device(device).type == "cuda" else PROBE_BYTES
    return _fitted(key, {"device": key}, n, lambda m: fit_copy(device, m))


def _fitted(key: str, about: dict, n: int, fit: Callable[[int], tuple[float, float]]) -> dict:
    """``{"bytes_per_s", "latency_s", **about, "source"}`` for ``key``: from memory, the cache
    file, or ``fit(n)`` now (then cached); "no room" where ``n`` is 0 (not remembered)."""
    with _lock:
        hit = _memo.get(key)
        if hit is not None:
            return dict(hit, source="memory" if hit["source"] != "unmeasurable" else hit["source"])
        cached = _read_cache().get(key)
        if isinstance(cached, dict) and isinstance(cached.get("bytes_per_s"), (int, float)) \
                and cached["bytes_per_s"] > 0:
            lat = cached.get("latency_s")
            entry = {"bytes_per_s": float(cached["bytes_per_s"]), **about, "source": "cache",
                     "latency_s": float(lat) if isinstance(lat, (int, float)) and lat >= 0 else 0.0}
        else:
            if not n:
                return {"bytes_per_s": None, "latency_s": None, **about, "source": NO_ROOM}
            try:
                bps, lat = fit(n)
                entry = {"bytes_per_s": bps, "latency_s": lat, **about, "source": "measured"}
                _write_cache(key, {"bytes_per_s": bps, "latency_s": lat, "probe_bytes": n,
                                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            except Exception:  # a device that went away, no memory: no estimate
                entry = {"bytes_per_s": None, "latency_s": None, **about, "source": "unmeasurable"}
        _memo[key] = entry
        return dict(entry)


def executor_call(device, measure_now: Callable[[], float]) -> dict:
    """``{"call_s", "device", "source"}``: the executor's fixed cost of a call on ``device``
    (``runtime.executor.call_seconds``, run by ``measure_now``) from memory, the cache file, or
    measured now, kept beside the device's bandwidth figure."""
    key = device_key(device)
    return _figure(f"call:{key}", "call_s", {"device": key}, measure_now, {})


def cached_latency(device) -> float:
    """The fixed seconds of one host-to-``device`` copy measured with the bandwidth (0 where none
    was: a cache written before the fit, or no figure)."""
    try:
        key = device_key(device)
    except Exception:  # a device this build of torch cannot name
        return 0.0
    with _lock:
        hit = _memo.get(key) or _read_cache().get(key)
    lat = hit.get("latency_s") if isinstance(hit, dict) else None
    return float(lat) if isinstance(lat, (int, float)) and lat > 0 else 0.0


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


def peer_key(src, dst) -> str:
    """A name for the link from device ``src`` to ``dst`` (their models and indices: two GPUs of
    one model may sit on different links)."""
    a, b = torch.device(src), torch.device(dst)
    return f"peer:{device_key(a)}#{a.index}->{device_key(b)}#{b.index}"


def peer_seconds(src, dst, nbytes: int, buf: torch.Tensor, repeats: int = PROBE_REPEATS) -> float:
    """Seconds of a copy of ``nbytes`` of ``buf`` (on ``src``) to device ``dst`` as a hop makes it
    (``tensor.to``: on the source's current stream, ``runtime.hops``), best of ``repeats``."""
    a, b = torch.device(src), torch.device(dst)
    stream = torch.cuda.current_stream(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record(stream)
        out = buf[:max(1, int(nbytes))].to(_placement(b), non_blocking=True, copy=True)
        end.record(stream)
        end.synchronize()
        del out
        best = min(best, start.elapsed_time(end) / 1e3)
    return max(best, 1e-9)


def device_to_device(src, dst, max_bytes: int | None = None) -> dict:
    """``{"bytes_per_s", "latency_s", "link", "source"}`` of a copy from CUDA device ``src`` to
    ``dst`` (the hop of an activation between the devices of a placement): from memory, the cache
    file, or measured now as ``host_to_device`` (a large copy and a small one, fitted: latency +
    bytes / bandwidth), its buffers sized to ``max_bytes`` (``probe_bytes``: the room on each
    device). ``bytes_per_s`` None where it could not be measured."""
    key = peer_key(src, dst)

    def fit(n: int) -> tuple[float, float]:
        buf = torch.empty(n, dtype=torch.uint8, device=_placement(torch.device(src)))
        small = min(SMALL_PROBE_BYTES, n // 2)
        return _fit(n, peer_seconds(src, dst, n, buf), small, peer_seconds(src, dst, small, buf))

    return _fitted(key, {"link": key}, probe_bytes(max_bytes), fit)


def matmul_n(device, dtype, max_bytes: int | None) -> int:
    """The side of the matmul probe's matrices on ``device`` in ``dtype`` where ``max_bytes`` of
    device memory are free for its three (each as the allocator rounds it, each at least
    ``MIN_PROBE_BYTES``); 0 where they do not fit."""
    dev = torch.device(device)
    n = MATMUL_N.get(dev.type, MATMUL_N["cpu"])
    if max_bytes is None or dev.type != "cuda":
        return n
    size = torch.empty((), dtype=dtype).element_size()
    while n * n * size >= MIN_PROBE_BYTES and 3 * _device_bytes(n * n * size) > max_bytes:
        n -= 64
    return n if n * n * size >= MIN_PROBE_BYTES and 3 * _device_bytes(n * n * size) <= max_bytes else 0


def measure_matmul(device, dtype=torch.float32, n: int | None = None, repeats: int = PROBE_REPEATS) -> float:
    """Floating-point operations per second of an ``n`` x ``n`` matrix product on ``device`` in
    ``dtype`` (best of ``repeats``, after one warm-up product; 2 n^3 operations each)."""
    dev = torch.device(device)
    if dtype not in MATMUL_DTYPES:  # before anything is allocated
        raise TypeError(f"no matrix product runs in {dtype}")
    n = int(n or MATMUL_N.get(dev.type, MATMUL_N["cpu"]))
    place = _placement(dev)
    a = torch.rand(n, n, device=place, dtype=dtype)  # made where they are used: three n x n, no more
    b = torch.rand(n, n, device=place, dtype=dtype)
    out = torch.empty(n, n, device=place, dtype=dtype)
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


def matmul_throughput(device, dtype=torch.float32, max_bytes: int | None = None) -> dict:
    """``{"flops_per_s", "device", "dtype", "source"}`` for a matrix product on ``device`` in
    ``dtype``: from memory, the cache file, or measured now, as ``host_to_device`` (its matrices
    sized to ``max_bytes``, ``matmul_n``). ``flops_per_s`` is None when it could not be measured:
    a dtype no product runs in (nothing allocated), or "no room" (not remembered)."""
    key = matmul_key(device, dtype)
    dt = str(dtype).replace("torch.", "")
    if dtype not in MATMUL_DTYPES:
        return {"flops_per_s": None, "device": device_key(device), "dtype": dt, "source": "unmeasurable"}
    with _lock:
        hit = _memo.get(key)
        if hit is not None:
            return dict(hit, source="memory" if hit["source"] != "unmeasurable" else hit["source"])
        cached = _read_cache().get(key)
        if isinstance(cached, dict) and isinstance(cached.get("flops_per_s"), (int, float)) \
                and cached["flops_per_s"] > 0:
            entry = {"flops_per_s": float(cached["flops_per_s"]), "device": device_key(device), "dtype": dt,
                     "source": "cache"}
        else:
            n = matmul_n(device, dtype, max_bytes)
            if not n:
                return {"flops_per_s": None, "device": device_key(device), "dtype": dt, "source": NO_ROOM}
            try:
                fps = measure_matmul(device, dtype, n)
                entry = {"flops_per_s": fps, "device": device_key(device), "dtype": dt, "source": "measured"}
                _write_cache(key, {"flops_per_s": fps, "n": n,
                                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            except Exception:  # a dtype the device cannot multiply, no memory: no estimate
                entry = {"flops_per_s": None, "device": device_key(device), "dtype": dt, "source": "unmeasurable"}
        _memo[key] = entry
        return dict(entry)


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
