"""Shared test set-up: the test helper modules (toys, tiny_models) import by name, and
``vramcut_core`` is imported from this checkout (not from whichever copy is installed)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE, os.path.join(HERE, "core")):
    if p not in sys.path:
        sys.path.insert(0, p)


@pytest.fixture(scope="session", autouse=True)
def _bandwidth_cache(tmp_path_factory):
    """The engine caches the copy bandwidth and the matmul rate it measures (the simulated
    accelerator's too): here, in a folder of this run, never in the home, so no test reads a figure
    an earlier run or another checkout left there."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VRAMCUT_CACHE_DIR", str(tmp_path_factory.mktemp("vramcut_cache")))
    yield
    mp.undo()


def pytest_report_header(config):
    """Say which ComfyUI host the ComfyUI and browser tests run against."""
    import re

    import tiny_models as tm

    path = tm.comfyui_path()
    if path is None:
        return "ComfyUI host: none found ($COMFYUI_PATH, ~/comfy/ComfyUI): the ComfyUI and browser tests skip"
    version = "unknown version"
    try:
        with open(os.path.join(path, "comfyui_version.py")) as f:
            m = re.search(r'__version__\s*=\s*"([^"]+)"', f.read())
        version = m.group(1) if m else version
    except OSError:
        pass
    return f"ComfyUI host: {version} at {path}"


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason in ``-ra``'s summary, not one per test: a run without ComfyUI skips
    every host test for the same reason. pytest folds skips by place and reason; each reason's
    place here is the folder (or file) its tests share. Runs before pytest prints the summary."""
    groups = {}
    for rep in terminalreporter.stats.get("skipped", []):
        if isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3:
            groups.setdefault(rep.longrepr[2], []).append(rep)
    for reason, reps in groups.items():
        where = os.path.commonpath([os.path.abspath(str(r.longrepr[0])) for r in reps])
        for r in reps:
            r.longrepr = (where, None, reason)
