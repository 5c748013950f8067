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
    assert set(res["checks"]) == {"kitchen", "replan", "teardown", "alternating", "second_gpu", "compiler"}
    assert set(res["register"]) == {"registered", "register_s_per_gb", "unregister_s_per_gb",
                                    "failed_register_leaves_pending_error", "executor_clears_it"}
    assert set(res["sanitizer"]) == {"native", "cudaMallocAsync"}
    for fwd in res["forwards"].values():
        assert {"max_reserved_bytes", "budget_bytes", "forward_s", "compute_only_s", "floor_s"} <= set(fwd)
    figures = [v for k, v in res.items() if k not in ("dry", "device", "torch") for v in _values(v if isinstance(v, dict) else {k: v})]
    assert all(v == "not measured" for v in figures), "a dry run must not claim a figure"
