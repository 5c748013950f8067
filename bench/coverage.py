"""Write the coverage table (docs/coverage.md) from the sweep, one section per ComfyUI host.

    python bench/coverage.py PYTHON=COMFYUI_PATH [PYTHON=COMFYUI_PATH ...] > docs/coverage.md

Each PYTHON is an interpreter with that host's requirements installed (torch, ...); the sweep
modules (tests/comfy/test_sweep_models.py, test_sweep_encoders.py) run as scripts under it with
COMFYUI_PATH set: each registered diffusion class and LLM text encoder is built small, cut, and
run plain and streamed on CPU, so the table's parity column is measured, not copied.
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("tests/comfy/test_sweep_models.py", "tests/comfy/test_sweep_encoders.py")

HEADER = """# Coverage: which model families VRAMCut cuts, and how

Written by `python bench/coverage.py PYTHON=COMFYUI_PATH ...` from the sweep tests
(`tests/comfy/test_sweep_models.py`, `tests/comfy/test_sweep_encoders.py`). For every diffusion
class the host registers (`comfy.supported_models.models`) and every LLM text encoder in
`comfy.text_encoders`, the sweep builds the host's own class small on CPU (tiny widths, one or
two blocks per list), finds its cut units, and runs its forward plain and through the engine at a
budget below its weights; "bit-identical, streamed" means the outputs were equal bit for bit and
some weights were streamed. "registry" means a family entry of `vramcut_core/model/units.py` names the
block lists in execution order; "generic fallback" means the long same-typed module lists were
found by shape (the node shows a warning saying so). "not swept" rows give the reason; such a
model still runs through the registry or the fallback, but its parity is not tested here.
Units are counted on the small build (the real model has more blocks of the same lists).

Wan 2.2 14B's two experts are two diffusion models in ComfyUI (two loaders, two samplers with
step ranges): each is a `WanModel` with its own Max VRAM engine and plan.

The last column holds the dry run against the meter on the same forward: for every unit, the
activation peak traced on fake tensors (`vramcut_core/figures/trace.py`, the figures a first forward is
planned from) divided by the peak the CPU meter measured in the engine's first real forward (the
figures the plan keeps), smallest and largest over the units, and the most bytes traced above
measured. The sweep tests hold every unit to the bound `measured <= traced <= measured + max(1 %,
1 KiB)` (`tests/unit_checks.py: trace_bound`): never below, because both count every storage an
operator creates; above only by tensors built from Python data (`torch.tensor(...)`, created
without an operator, so the CPU meter cannot see them; the CUDA allocator does). "measured (why)"
marks a forward the dry run cannot run: the engine measures its first forward instead.

What the released checkpoints of the large 2026 models need at their usual resolutions
(activations per block, the smallest budget), dry-run at full size without weights, is in
[full_size.md](full_size.md).
"""


def main(argv: list[str]) -> int:
    if not argv or any("=" not in a for a in argv):
        print(__doc__, file=sys.stderr)
        return 2
    print(HEADER)
    for spec in argv:
        python, comfy = spec.split("=", 1)
        env = dict(os.environ, COMFYUI_PATH=comfy)
        for script in SCRIPTS:
            out = subprocess.run([python, script], cwd=ROOT, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return out.returncode
            print(out.stdout)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import docgen
    print(docgen.stamp("python bench/coverage.py PYTHON=COMFYUI_PATH ... > docs/coverage.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
