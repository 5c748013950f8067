"""The README's promise "the one file it writes outside its folder is ~/.cache/vramcut/bandwidth.json",
checked on the node's whole path: in a fresh interpreter whose home and temporary folder are
empty folders of their own (no ``VRAMCUT_CACHE_DIR``), ComfyUI loads a tiny model with its own
loader, the Max VRAM node patches it, and ComfyUI's KSampler node samples it streamed; then the
files that appeared in the home, the temporary folder, the pack's folder and ComfyUI's folder are
listed."""
import fnmatch
import os
import subprocess
import sys

from pack_nodes import REPO

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = r"""
import torch
import tiny_models as tm
from pack_nodes import load_pack, run_node

tm.import_comfy()
from nodes import KSampler
from vramcut_core import find_units

pack = load_pack()
model = tm.load_tiny_sd3(depth=4)
pos, neg = tm.tiny_sd3_conditioning()
sizes = sorted((u.weight_bytes for u in find_units(model.model.diffusion_model).units), reverse=True)
gb = (sizes[0] + 2.2 * sizes[1] + (1 << 20)) / (1 << 30)  # the largest resident, the rest streamed
(patched, _, _), ui = run_node(pack, "VRAMCutMaxVRAM", "1", max_vram_gb=gb, budget_mode="fixed",
                               reserve_gb=1.0, prefetch=True, residency=True, model=model, clip=None,
                               vae=None)
with torch.inference_mode():
    KSampler().sample(patched, 7, 2, 2.0, "euler", "simple", pos, neg,
                      {"samples": torch.zeros(1, 16, 8, 8)}, denoise=1.0)
entry = ui["vramcut"][0]["models"][0]  # the node's payload, brought up to date by the run
print("stage", entry["stage"], "streamed per call", entry["plan"]["streamed_bytes_per_forward"])
"""


def files_under(root: str, leave_out=()) -> set:
    """Every file below ``root``, relative, leaving out Python's byte-code caches and the
    top-level folders matching ``leave_out`` (in the repository: what other test runs write,
    CI's environments and host trees)."""
    out = set()
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "__pycache__"
                   and not (d == root and any(fnmatch.fnmatch(x, p) for p in leave_out))]
        out.update(os.path.relpath(os.path.join(d, f), root) for f in files)
    return out


def test_a_streamed_ksampler_run_writes_only_the_bandwidth_cache_outside_the_pack(comfy, tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    roots = {REPO: ("tests", "bench", "docs", ".*"), comfy: ()}  # the pack's own files; ComfyUI's
    before = {root: files_under(root, skip) for root, skip in roots.items()}
    env = {k: v for k, v in os.environ.items() if k != "VRAMCUT_CACHE_DIR"}
    env.update(HOME=str(home), TMPDIR=str(tmp), COMFYUI_PATH=comfy, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([REPO, TESTS]))
    r = subprocess.run([sys.executable, "-c", RUN], env=env, cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    stage, streamed = r.stdout.split()[1], int(r.stdout.split()[-1])
    assert stage == "measured" and streamed > 0, r.stdout  # the sampler ran the model streamed
    assert files_under(str(home)) == {os.path.join(".cache", "vramcut", "bandwidth.json")}
    assert files_under(str(tmp)) == set()
    for root, was in before.items():
        assert files_under(root, roots[root]) - was == set(), f"new files in {root}"
