"""bench/gpu_check.py in its dry mode: it imports, runs on CPU and prints every key, with no
figure in it (nothing measured without a GPU)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _values(d):
    for v in d.values():
        if isinstance(v, dict):
            yield from _values(v)
        else:
            yield v


def test_gpu_check_dry_prints_every_key_and_no_figure():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--dry"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout)
    assert res["dry"] is True and res["device"] is None
    assert set(res) >= {"register", "bandwidth", "sanitizer", "forwards", "sessions", "offload", "checks"}
    assert set(res["checks"]) == {"kitchen", "replan", "outgrow", "teardown", "alternating", "second_gpu", "compiler",
                                  "file_backed"}
    assert set(res["register"]) == {"registered", "register_s_per_gb", "unregister_s_per_gb",
                                    "failed_register_leaves_pending_error", "executor_clears_it"}
    assert set(res["sanitizer"]) == {"native", "cudaMallocAsync"}
    for fwd in res["forwards"].values():
        assert {"max_reserved_bytes", "budget_bytes", "forward_s", "compute_only_s", "floor_s"} <= set(fwd)
    figures = [v for k, v in res.items() if k not in ("dry", "device", "torch") for v in _values(v if isinstance(v, dict) else {k: v})]
    assert all(v == "not measured" for v in figures), "a dry run must not claim a figure"


def test_file_backed_check_runs_on_the_simulated_accelerator(monkeypatch):
    """The GPU check of fast-disk loading, small, on the simulated accelerator: it runs, and its
    verdict holds (bit-equal both ways, no flat master with the window, the window's bytes)."""
    import gc

    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_check
    import gpu_file_backed_check as fb
    from sim_cuda import simulated_cuda
    from vramcut_core.runtime import host_memory as hm

    monkeypatch.setattr(hm.PINNED, "bytes", 0)
    monkeypatch.setattr(hm.PINNED, "cap", -1)
    monkeypatch.setattr(hm, "_WINDOW", None)
    with simulated_cuda(monkeypatch) as sim:
        res = fb.check(torch.device("cuda"), gpu_check._budget_to_stream, d=64, depth=4, tokens=16, forwards=3,
                       inputs_on=torch.device("cpu"), host=sim.host_memory)
        gc.collect()
    assert not sim.hazards, sim.hazards[:5]
    assert res["ok"], res
    assert res["file_backed"]["page_locked_bytes"] > 0 and res["flat_masters"]["flat_masters"] > 0


def test_outgrow_check_runs_on_the_simulated_accelerator(monkeypatch):
    """The GPU check of a steady forward that outgrows its plan, small, on the simulated
    accelerator: seen, re-planned once, later forwards within the budget."""
    import gc

    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_check
    from sim_cuda import simulated_cuda

    with simulated_cuda(monkeypatch) as sim:
        monkeypatch.setattr(gpu_check._SyncCounter, "NAMES", ((torch.cuda, "synchronize"), (torch.cuda, "empty_cache")))
        with torch.no_grad():
            res = gpu_check.check_outgrow(torch.device("cuda"), d=32, depth=8, tokens=8,
                                          inputs_on=torch.device("cpu"), host=sim.host_memory)
        gc.collect()
    assert not sim.hazards, sim.hazards[:5]
    assert res["ok"], res
    assert res["over_budget_forwards"] == 1
