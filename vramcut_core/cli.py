"""Command line: ``python -m vramcut_core plan FILE --max-vram GIB`` and ``... demo``."""
from __future__ import annotations

import argparse
import sys

from .plan import BudgetError, PlanOptions, gib_to_bytes, make_plan
from .report import dumps, plan_to_json, plan_to_text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other error here
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m vramcut_core", description="VRAMCut: run models under a VRAM budget.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    pl = sub.add_parser("plan", help="plan a .safetensors or .gguf model from its header (no weights read)")
    pl.add_argument("model", help="path to a .safetensors or .gguf file (quantized: stored bytes)")
    pl.add_argument("--max-vram", required=True, metavar="GIB", help="VRAM budget in GiB")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--no-prefetch", action="store_true", help="one streaming slot, no overlap")
    pl.add_argument("--no-residency", action="store_true", help="stream every unit")
    de = sub.add_parser("demo", help="run a built-in model plain and segmented")
    de.add_argument("--max-vram", metavar="GIB", default=None,
                    help="VRAM budget in GiB (default: 40%% of the demo model's weights)")
    de.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="default: cuda if available, else cpu")
    de.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _plan(a) -> int:
    from .safetensors_plan import plan_units_from_header, read_header

    from .gguf_header import is_gguf, read_gguf_header

    budget = gib_to_bytes(a.max_vram)
    header = read_gguf_header(a.model) if is_gguf(a.model) else read_header(a.model)
    units = plan_units_from_header(header)
    if not units:
        raise ValueError(f"{a.model}: holds no tensors")
    opts = PlanOptions(prefetch=not a.no_prefetch, residency=not a.no_residency)
    plan = make_plan(units, budget, opts)
    if a.json:
        print(dumps(plan_to_json(plan)))
    else:
        kinds = sorted({v["dtype"] for v in header.values()})
        print(plan_to_text(plan, title=f"{a.model}: {len(units)} units, weights only, "
                                       f"stored bytes ({', '.join(kinds)})"))
    return 0


def _demo(a) -> int:
    import torch

    from .demo import format_demo, run_demo

    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    budget = gib_to_bytes(a.max_vram) if a.max_vram is not None else None
    r = run_demo(budget, a.device)
    if a.json:
        keys = ("plan", "parity_max_abs_diff", "peak_device_bytes", "budget_bytes", "bytes_streamed",
                "time_plain_s", "time_segmented_s")
        print(dumps({k: r[k] for k in keys} | {"device": r["device"]}))
    else:
        print(format_demo(r))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        return _plan(a) if a.cmd == "plan" else _demo(a)
    except (ValueError, BudgetError, OSError) as e:
        print(f"vramcut: error: {e}", file=sys.stderr)
        return 2
