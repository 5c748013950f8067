"""The child of ``test_ram_budget_cgroup.py``: joins a memory cgroup, maps a large checkpoint,
computes the plain forward on the mapped weights (page cache only: the kernel reclaims it), then
runs it under a RAM budget, sampling the pack's host bytes, and prints one JSON line.

    python ram_budget_child.py CGROUP_PROCS CHECKPOINT D DEPTH VRAM_BYTES RAM_BYTES
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time


def main() -> None:
    procs, path, d, depth, vram, ram = sys.argv[1:7]
    d, depth, vram, ram = int(d), int(depth), int(vram), int(ram)
    with open(procs, "w") as f:   # from here on every byte of this process counts in the cgroup
        f.write(str(os.getpid()))
    import safetensors
    import torch
    from torch import nn

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from vramcut_core import Engine, EngineConfig

    torch.set_num_threads(1)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x

    with torch.device("meta"):
        model = Stack()
    with safetensors.safe_open(path, framework="pt") as f:
        model.load_state_dict({k: f.get_tensor(k) for k in f.keys()}, assign=True)
    x = torch.linspace(-1, 1, 2 * d).reshape(2, d)
    with torch.no_grad():
        ref = model(x)   # the plain forward on the mapped weights: only page cache, reclaimable
    eng = Engine(model, EngineConfig(budget_bytes=vram, device="cpu", ram_budget_bytes=ram))
    tiers = eng.executor.masters.tiers
    samples, stop = [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(tiers.host_bytes())
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    outs, reads, times = [], [], []
    try:
        with torch.no_grad():
            for _ in range(2):
                t0 = time.perf_counter()
                outs.append(eng.run(model, x))
                times.append(time.perf_counter() - t0)
                reads.append(eng.last_stats.disk_bytes_read)
    finally:
        stop.set()
        th.join()
    plan = eng.last_plan
    print(json.dumps({
        "equal": [bool(torch.equal(o, ref)) for o in outs],
        "reads": reads, "plan_reads": plan.tiers.disk_bytes_per_call,
        "max_host_bytes": max(samples), "samples": len(samples), "ram_budget": ram,
        "disk_units": len(plan.tiers.disk_units), "ram_units": len(plan.tiers.in_ram),
        "files": tiers.files(), "seconds": times,
    }))


if __name__ == "__main__":
    main()
