"""A GPU check run in a fresh process: ``script --child`` prints its JSON as its last line.

The checks that need a host set up as its ``main.py`` sets it up (comfy-aimdo before CUDA is
first used, the host imported for the GPU) run there; ``run`` is what ``bench/gpu_check.py``
calls for them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def run(script: str, timeout: int = 300) -> dict:
    """``script --child``'s JSON, or ``{"ok": False, "error": ...}`` saying why none came."""
    try:
        p = subprocess.run([sys.executable, os.path.abspath(script), "--child"], capture_output=True,
                           text=True, timeout=timeout)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no answer in {timeout} s"}
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": f"the child failed: {p.stderr.strip()[-800:]}"}
