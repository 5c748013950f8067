"""What the GPU checks share: the checkout on the import path, and a check run in a fresh process.

Importing this module puts the repository, ``bench/``, ``tests/`` and ``tests/core/`` first on
``sys.path`` (the checks import the engine, the toys and the pack from this checkout): each check
script imports it before anything of the checkout. The checks that need a host set up as its
``main.py`` sets it up (comfy-aimdo before CUDA is first used, the host imported for the GPU) run
in a fresh process: ``run`` is what ``bench/gpu_check.py`` calls for them, and ``main`` is such a
script's entry (with ``--child``, the check itself, its JSON printed as the last line).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "core")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


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


def main(script: str, child: Callable[[], dict]) -> None:
    """A child-process check's entry: ``--child`` runs ``child()`` here and prints its JSON (a
    failure is a result, printed as one); without it, the check run in a fresh process."""
    if "--child" in sys.argv:
        try:
            res = child()
        except Exception as e:
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:800]}
        print(json.dumps(res))
    else:
        print(json.dumps(run(script), indent=1))


def weight_bytes(m) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
