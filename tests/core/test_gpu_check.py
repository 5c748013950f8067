"""bench/gpu_check.py in its dry mode: it imports, runs on CPU and prints every key, with no
figure in it (nothing measured without a GPU)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BPS, FLOPS = 2e9, 1e9   # the simulated link and throughput, given to the engine as its figures


def _timed(sim, monkeypatch):
    """The simulated accelerator's copies and kernels take time, and the engine plans with the
    same figures (as a GPU's cached bandwidth and throughput): its plans carry a prediction."""
    from sim_cuda import flop_seconds
    from vramcut_core.figures import bandwidth

    sim.set_durations(copy_bytes_per_s=BPS, op_seconds=flop_seconds(FLOPS))
    monkeypatch.setattr(bandwidth, "cached_host_to_device", lambda device: BPS)
    monkeypatch.setattr(bandwidth, "matmul_throughput",
                        lambda device, dtype=None, max_bytes=None: {"flops_per_s": FLOPS, "source": "cache"})


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
    import gpu_engine_checks
    import gpu_file_backed_check as fb
    import gpu_timing
    from sim_cuda import simulated_cuda
    from vramcut_core.runtime import host_memory as hm

    monkeypatch.setattr(hm.PAGE_LOCKED, "bytes", 0)
    monkeypatch.setattr(hm.PAGE_LOCKED, "cap", -1)
    monkeypatch.setattr(hm, "_BOUNCE", None)
    with simulated_cuda(monkeypatch) as sim:
        _timed(sim, monkeypatch)
        res = fb.check(torch.device("cuda"), gpu_engine_checks._budget_to_stream, d=64, depth=4, tokens=16, forwards=3,
                       inputs_on=torch.device("cpu"), host=sim.host_memory, timing=gpu_timing.time_per_call)
        gc.collect()
    assert not sim.hazards, sim.hazards[:5]
    assert res["ok"], res
    assert res["file_backed"]["page_locked_bytes"] > 0 and res["flat_masters"]["flat_masters"] > 0
    for way in ("file_backed", "flat_masters"):   # predicted against measured time per call, both ways
        t = res[way]["time_per_call"]
        assert t["predicted_s"] > 0 and t["measured_s"] > 0 and t["error"] is not None, (way, t)


def test_outgrow_check_runs_on_the_simulated_accelerator(monkeypatch):
    """The GPU check of a steady forward that outgrows its plan, small, on the simulated
    accelerator: seen, re-planned once, later forwards within the budget."""
    import gc

    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_engine_checks
    import gpu_timing
    from sim_cuda import simulated_cuda

    with simulated_cuda(monkeypatch) as sim:
        _timed(sim, monkeypatch)
        monkeypatch.setattr(gpu_engine_checks._SyncCounter, "NAMES", ((torch.cuda, "synchronize"), (torch.cuda, "empty_cache")))
        with torch.no_grad():
            res = gpu_engine_checks.check_outgrow(torch.device("cuda"), d=32, depth=8, tokens=8,
                                                  inputs_on=torch.device("cpu"), host=sim.host_memory)
        gc.collect()
    assert not sim.hazards, sim.hazards[:5]
    assert res["ok"], res
    assert res["over_budget_forwards"] == 1
    # the re-planned steady forwards' time per call: the simulator's is the timeline's prediction
    t = res["time_per_call"]
    assert t["predicted_s"] > 0 and t["measured_s"] > 0 and abs(t["error"]) < 0.02, t
    assert gpu_timing.time_text(t).startswith("predicted ") and " ms/call, measured " in gpu_timing.time_text(t)


def test_a_check_without_a_prediction_says_why(monkeypatch):
    """Residency by bytes (``speed="count"``) or no bandwidth figure: no predicted time, and the
    check's line says why instead of printing a figure."""
    import gc

    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_timing
    from sim_cuda import simulated_cuda
    from vramcut_core import Engine, EngineConfig
    from vramcut_core.figures import bandwidth

    monkeypatch.setattr(bandwidth, "cached_host_to_device", lambda device: None)
    with simulated_cuda(monkeypatch) as sim:
        with sim.host_memory():
            model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
            x = torch.randn(2, 16)
        why = {}
        for name, cfg in (("count", dict(speed="count")), ("no_bandwidth", {})):
            eng = Engine(model, EngineConfig(budget_bytes=1 << 20, device="cuda", **cfg))
            with torch.no_grad(), eng.session():
                for _ in range(3):
                    eng.run(model, x)
            t = gpu_timing.time_per_call(eng)
            eng.release()
            del eng
            gc.collect()
            assert t["predicted_s"] is None and t["error"] is None, t
            why[name] = gpu_timing.time_text(t)
    assert why["count"].startswith("no prediction (speed=count on cuda: residency by bytes"), why
    assert why["no_bandwidth"].startswith("no prediction (no host-to-device bandwidth figure for cuda)"), why


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
    import gpu_engine_checks
    from sim_cuda import simulated_cuda

    with simulated_cuda(monkeypatch, devices=1):
        assert gpu_engine_checks.check_devices() == {"ok": None, "why": "1 GPU(s): the check needs two"}
    with simulated_cuda(monkeypatch, devices=2) as sim:
        with torch.no_grad():
            res = gpu_engine_checks.check_devices(d=32, depth=8, tokens=8, steps=4, inputs_on=torch.device("cpu", 0),
                                                  host=sim.host_memory)
        gc.collect()
    assert not sim.hazards, sim.hazards[:5]
    assert res["ok"], res
    # each run's time per call is there (the simulator's copies and kernels take no time here)
    for run in ("one_gpu", "two_gpus"):
        assert {"predicted_s", "measured_s", "error"} <= set(res[run]["time_per_call"]), res[run]
    assert res["two_gpus"]["time_per_call"]["no_prediction"].startswith("several devices")
    assert res["two_gpus"]["host_bytes_per_call"] < res["one_gpu"]["host_bytes_per_call"]
    assert res["two_gpus"]["hop_bytes_per_call"] > 0 and res["one_gpu"]["hops"] == []
