"""The disk tier's read rate against a plain sequential reader of the same file (aim: >= 90 %).

A checkpoint of ``--gib`` GiB (a stack of linear layers in float32, safetensors) is written to a
temporary folder (``--dir``, removed after), mapped as a host maps it, and run by a CPU engine
under a RAM budget of one byte: every streamed unit is read from the file each call by the disk
tier's reader (``runtime.disk.read_into`` on its reader thread: ``os.preadv``, straight into the
slot). Its rate is the bytes it read over the time its reads took (timed around each read the
engine makes). The plain reader reads the whole file from start to end into a buffer of its
size in 16 MiB ``readinto`` calls (the tier's slot and that buffer are both written before). Cold reads: before each run the file's pages are dropped (``posix_fadvise(DONTNEED)``:
the engine never touches the mapped pages, so they drop); page-cache reads are measured too.
The machine is shared: the runs alternate and the median of ``--repeats`` is kept.

    python bench/bench_disk_tier.py [--gib G] [--repeats N] [--dir DIR] [--json | --doc]

``--doc`` rewrites the generated section of docs/measurements.md (with the stamp: bench/docgen.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from vramcut_core import Engine, EngineConfig  # noqa: E402
from vramcut_core.runtime import disk  # noqa: E402

SCRIPT = "bench/bench_disk_tier.py"
DEPTH = 8


class Stack(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(DEPTH))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _write(path: str, d: int) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(DEPTH):
        sd[f"blocks.{i}.weight"] = torch.empty(d, d).uniform_(-d ** -0.5, d ** -0.5, generator=g)
        sd[f"blocks.{i}.bias"] = torch.zeros(d)
    save_file(sd, path)
    del sd
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read(path: str, cold: bool, dest: bytearray) -> float:
    """Bytes per second of a sequential read of the whole file into ``dest`` (a buffer of the
    file's size, written before: the reader keeps what it reads, as the tier keeps it in its
    slot), in 16 MiB ``readinto`` calls."""
    if cold:
        _drop(path)
    mv = memoryview(dest)
    n = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(mv[n:n + (16 << 20)])
            if not k:
                break
            n += k
    return n / (time.perf_counter() - t0)


class _Timed:
    """Wraps ``disk.read_into``: the time and bytes of every read the engine makes."""

    def __init__(self) -> None:
        self.real, self.s, self.bytes = disk.read_into, 0.0, 0

    def __call__(self, dest, reads):
        t0 = time.perf_counter()
        got = self.real(dest, reads)
        self.s += time.perf_counter() - t0
        self.bytes += got
        return got


def tier_read(eng, model, x, path: str, cold: bool) -> tuple[float, int]:
    """(bytes per second, bytes) the disk tier read in one call."""
    if cold:
        _drop(path)
    timed = _Timed()
    disk.read_into = timed
    try:
        with torch.no_grad():
            eng.run(model, x)
    finally:
        disk.read_into = timed.real
    assert timed.bytes == eng.last_stats.disk_bytes_read == eng.last_plan.tiers.disk_bytes_per_call
    return timed.bytes / timed.s, timed.bytes


def run(gib: float, repeats: int, folder: str | None) -> dict:
    import safetensors

    torch.set_num_threads(1)
    d = int((gib * 2**30 / DEPTH / 4) ** 0.5) // 64 * 64
    tmp = tempfile.mkdtemp(prefix="vramcut-disk-", dir=folder)
    old_cache = os.environ.get(disk.CACHE_ENV)
    os.environ[disk.CACHE_ENV] = os.path.join(tmp, "cache")
    try:
        path = os.path.join(tmp, "stack.safetensors")
        _write(path, d)
        with torch.device("meta"):
            model = Stack(d)
        with safetensors.safe_open(path, framework="pt") as f:
            model.load_state_dict({k: f.get_tensor(k) for k in f.keys()}, assign=True)
        x = torch.linspace(-1, 1, 2 * d).reshape(2, d)
        unit = 4 * d * (d + 1)
        eng = Engine(model, EngineConfig(budget_bytes=3 * unit, device="cpu", ram_budget_bytes=1))
        session = eng.session()   # resident units stay: a call reads the streamed ones (a sampling run)
        session.__enter__()
        with torch.no_grad():
            eng.run(model, x)   # the first call plans (and measures)
        rows = {"tier_cold": [], "plain_cold": [], "tier_cached": [], "plain_cached": []}
        per_call = 0
        dest = bytearray(b"\1") * os.path.getsize(path)
        for i in range(repeats):   # each goes first in turn
            for tier in ((True, False) if i % 2 == 0 else (False, True)):
                if tier:
                    rate, per_call = tier_read(eng, model, x, path, cold=True)
                    rows["tier_cold"].append(rate)
                    rows["tier_cached"].append(tier_read(eng, model, x, path, cold=False)[0])
                else:
                    rows["plain_cold"].append(plain_read(path, True, dest))
                    rows["plain_cached"].append(plain_read(path, False, dest))
        session.__exit__(None, None, None)
        med = {k: statistics.median(v) for k, v in rows.items()}
        return {"file_bytes": os.path.getsize(path), "read_per_call_bytes": per_call, "repeats": repeats,
                "disk_units": len(eng.last_plan.tiers.disk_units), **{f"{k}_bytes_per_s": v for k, v in med.items()},
                "ratio_cold": med["tier_cold"] / med["plain_cold"],
                "ratio_cached": med["tier_cached"] / med["plain_cached"]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old_cache is None:
            os.environ.pop(disk.CACHE_ENV, None)
        else:
            os.environ[disk.CACHE_ENV] = old_cache


def lines(r: dict) -> list[str]:
    gb = lambda v: f"{v / 1e9:.2f} GB/s"  # noqa: E731
    return [f"file {r['file_bytes'] / 2**30:.2f} GiB, {r['disk_units']} units read per call "
            f"({r['read_per_call_bytes'] / 2**30:.2f} GiB), median of {r['repeats']}",
            f"cold    disk tier {gb(r['tier_cold_bytes_per_s'])}  plain reader {gb(r['plain_cold_bytes_per_s'])}  "
            f"ratio {100 * r['ratio_cold']:.0f} %",
            f"cached  disk tier {gb(r['tier_cached_bytes_per_s'])}  plain reader {gb(r['plain_cached_bytes_per_s'])}  "
            f"ratio {100 * r['ratio_cached']:.0f} %"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder for the temporary checkpoint (its disk is measured)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--doc", action="store_true", help="rewrite the generated section of docs/measurements.md")
    a = ap.parse_args(argv)
    r = run(a.gib, a.repeats, a.dir)
    if a.json:
        print(json.dumps(r, indent=1))
    elif a.doc:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import docgen
        cmd = f"python {SCRIPT} --doc" + (f" --gib {a.gib:g}" if a.gib != 1.0 else "")
        docgen.write_section(os.path.join(ROOT, "docs", "measurements.md"), SCRIPT,
                             "```\n" + "\n".join(lines(r)) + "\n```\n\n" + docgen.stamp(cmd))
    else:
        print("\n".join(lines(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
