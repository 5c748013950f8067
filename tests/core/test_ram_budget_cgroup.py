"""The RAM budget holds in a memory cgroup: a model of more than 4 GiB on disk runs under a RAM
budget of a quarter of it, in a process whose memory is limited just above its budgets plus the
stated overhead of the process (Python, torch, the slots of the CPU "device"). A process over the
limit is killed; page cache is reclaimed. The child (``ram_budget_child.py``) is never killed,
the pack's host bytes stay within the budget at every sample, its output equals the plain forward
bit for bit, and it reads from disk each call exactly the bytes the plan says.

Needs the cgroup v1 memory controller writable (root); skipped otherwise, saying so."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import uuid

import pytest
import torch

CG_ROOT = "/sys/fs/cgroup/memory"
D, DEPTH = 6144, 29          # 29 linear layers of 6144 x 6144 in float32: 4.08 GiB on disk
VRAM = 400 << 20             # the CPU engine's device budget: two slots and the activations
OVERHEAD = 640 << 20         # the process besides the pack: interpreter, torch, its allocator
MIB = 1 << 20


def _cgroup_or_skip() -> str:
    path = os.path.join(CG_ROOT, f"vramcut-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
    except OSError as e:
        pytest.skip(f"the cgroup v1 memory controller is not writable here ({CG_ROOT}: {e.strerror})")
    return path


def _write_checkpoint(path: str) -> int:
    """A safetensors file of the child's model, written tensor by tensor (never whole in memory),
    its pages dropped from the page cache after: the child reads it from disk."""
    names = [(f"blocks.{i}.{k}", [D, D] if k == "weight" else [D]) for i in range(DEPTH) for k in ("weight", "bias")]
    header, off = {}, 0
    for n, shape in names:
        nbytes = 4 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        header[n] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    g = torch.Generator().manual_seed(0)
    bound = D ** -0.5
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _, shape in names:
            t = torch.empty(shape).uniform_(-bound, bound, generator=g)
            f.write(t.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return os.path.getsize(path)


def test_a_model_four_times_the_ram_budget_runs_in_a_cgroup_just_above_it(tmp_path):
    cg = _cgroup_or_skip()
    ckpt = str(tmp_path / "big.safetensors")
    try:
        size = _write_checkpoint(ckpt)
        ram = size // 4
        assert size >= 4 << 30 and ram <= size // 4
        limit = ram + VRAM + OVERHEAD
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        with open(os.path.join(cg, "memory.swappiness"), "w") as f:
            f.write("0")   # over the limit the process is killed, not swapped
        env = dict(os.environ, OMP_NUM_THREADS="1", VRAMCUT_CACHE_DIR=str(tmp_path / "cache"))
        child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ram_budget_child.py")
        p = subprocess.run([sys.executable, child, os.path.join(cg, "cgroup.procs"), ckpt, str(D), str(DEPTH),
                            str(VRAM), str(ram)], capture_output=True, text=True, timeout=600, env=env)
        with open(os.path.join(cg, "memory.failcnt")) as f:
            failcnt = int(f.read())
        with open(os.path.join(cg, "memory.max_usage_in_bytes")) as f:
            peak = int(f.read())
        assert p.returncode == 0, (f"the child died (code {p.returncode}; the cgroup limit is {limit >> 20} MiB, "
                                   f"it reached {peak >> 20} MiB): {p.stderr[-2000:]}")
        out = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        if os.path.exists(ckpt):
            os.remove(ckpt)
        try:
            os.rmdir(cg)
        except OSError:
            pass
    assert all(out["equal"]), "the output is the plain forward's, bit for bit"
    assert out["samples"] > 10 and out["max_host_bytes"] <= ram, out
    assert out["disk_units"] and out["ram_units"], "both tiers are used"
    assert out["reads"] == [out["plan_reads"]] * 2, "each call reads from disk exactly what the plan says"
    assert out["files"] == [ckpt], "read from the checkpoint itself: no cache file"
    print(f"\n{size / 2**30:.2f} GiB on disk, RAM budget {ram >> 20} MiB, cgroup limit {limit >> 20} MiB, "
          f"peak {peak >> 20} MiB (reclaims: {failcnt}); calls {[round(s, 1) for s in out['seconds']]} s")
