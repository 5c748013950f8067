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
                                  "file_backed", "detach", "devices"}
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

    monkeypatch.setattr(hm.PAGE_LOCKED, "bytes", 0)
    monkeypatch.setattr(hm.PAGE_LOCKED, "cap", -1)
    monkeypatch.setattr(hm, "_BOUNCE", None)
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


def test_detach_check_without_a_host_says_it_was_skipped_and_why(monkeypatch, tmp_path):
    """No ComfyUI host (``COMFYUI_PATH`` naming a folder without one): the ``detach`` check does
    not fail, it says it was skipped and why (its run on the simulated accelerator with the host's
    own pinning is tests/comfy/test_gpu_detach_check.py)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_detach_check

    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path))
    res = gpu_detach_check.check()
    assert res["ok"] is None, res
    assert res["why"].startswith("skipped: no ComfyUI host"), res


def test_devices_check_runs_on_two_simulated_gpus(monkeypatch):
    """The GPU check of one model across two GPUs, small, on the simulated accelerator: bit-equal,
    each device within its budget on every forward, no host sync in a steady forward; the split
    streams fewer host bytes than one GPU under one of its budgets. Skipped with its reason on one."""
    import gc

    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_check
    from sim_cuda import simulated_cuda

    with simulated_cuda(monkeypatch, devices=1):
        assert gpu_check.check_devices() == {"ok": None, "why": "1 GPU(s): the check needs two"}
    with simulated_cuda(monkeypatch, devices=2) as sim:
        with torch.no_grad():
            res = gpu_check.check_devices(d=32, depth=8, tokens=8, steps=4, inputs_on=torch.device("cpu", 0),
                                          host=sim.host_memory)
        gc.collect()
    assert not sim.hazards, sim.hazards[:5]
    assert res["ok"], res
    assert res["two_gpus"]["host_bytes_per_call"] < res["one_gpu"]["host_bytes_per_call"]
    assert res["two_gpus"]["hop_bytes_per_call"] > 0 and res["one_gpu"]["hops"] == []
