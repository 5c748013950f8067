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
    pl = sub.add_parser("plan", help="plan a .safetensors or .gguf model from its header (no weights read); "
                                     "an all-in-one checkpoint is planned per component (MODEL, CLIP, VAE)")
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
    from .safetensors_plan import read_header, split_components

    from .gguf_header import is_gguf, read_gguf_header

    budget = gib_to_bytes(a.max_vram)
    header = read_gguf_header(a.model) if is_gguf(a.model) else read_header(a.model)
    opts = PlanOptions(prefetch=not a.no_prefetch, residency=not a.no_residency)
    comps, rest = split_components(header)
    if len(comps) > 1:
        return _plan_components(a, comps, rest, budget, opts)
    units, plan = _plan_header(a.model, header, budget, opts)
    if a.json:
        print(dumps(plan_to_json(plan)))
    else:
        print(plan_to_text(plan, title=f"{a.model}: {len(units)} units, weights only, "
                                       f"stored bytes ({_kinds(header)})"))
    return 0


def _kinds(header: dict) -> str:
    return ", ".join(sorted({v["dtype"] for v in header.values()}))


def _plan_header(what: str, header: dict, budget: int, opts: PlanOptions):
    from .safetensors_plan import plan_units_from_header

    units = plan_units_from_header(header)
    if not units:
        raise ValueError(f"{what}: holds no tensors")
    return units, make_plan(units, budget, opts)


def _plan_components(a, comps, rest: dict, budget: int, opts: PlanOptions) -> int:
    """An all-in-one checkpoint: each model planned on its own under the whole budget, as the
    node plans its MODEL, CLIP and VAE inputs (they run one after another, never together)."""
    from .safetensors_plan import header_bytes
    from .tensors import fmt_bytes

    planned = []
    for c in comps:
        try:
            units, plan = _plan_header(f"{a.model} ({c.name})", c.header, budget, opts)
        except BudgetError as e:
            raise ValueError(f"{_heading(c)}: {e}") from None
        planned.append((c, units, plan))
    left = {"keys": len(rest), "bytes": header_bytes(rest), "examples": sorted(rest)[:5]}
    if a.json:
        print(dumps({
            "all_in_one": True,
            "budget_bytes": budget,
            "components": [{"component": c.name, "label": c.label, "prefixes": list(c.prefixes),
                            "weight_bytes": header_bytes(c.header), "plan": plan_to_json(plan)}
                           for c, _, plan in planned],
            "not_planned": left,
        }))
        return 0
    names = ", ".join(c.name for c in comps)
    out = [f"{a.model}: all-in-one checkpoint ({names}); each planned on its own under the budget, "
           f"as the Max VRAM node plans its inputs"]
    for c, units, plan in planned:
        out += ["", plan_to_text(plan, title=f"{_heading(c)}: {len(units)} units, weights only, stored bytes "
                                             f"({_kinds(c.header)})")]
    if rest:
        out += ["", f"not planned: {left['keys']} keys ({fmt_bytes(left['bytes'])}) outside the diffusion "
                    f"model, text encoders and VAE ({', '.join(left['examples'])}"
                    f"{', ...' if left['keys'] > len(left['examples']) else ''})"]
    print("\n".join(out))
    return 0


def _heading(c) -> str:
    return f"{c.name} ({c.label}, {' '.join(p + '*' for p in c.prefixes)})"


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
