"""The planner's figures in docs/planner.md: bytes and transfers per forward of real checkpoints.

    python bench/plan_table.py            # rewrite the generated section of docs/planner.md
    python bench/plan_table.py --print    # print it instead

Header-only files (no weights: a sparse hole after the header) with the released checkpoints' key
layout and shapes (tests/core/checkpoint_headers.py: SD1.5's UNet in fp16, Flux.1-dev's
transformer in bf16) are planned by ``python -m vramcut_core plan FILE --max-vram GIB --json``,
weights only, default options. "Blocks streamed" is the transfers per forward the plan would take
with one copy per block; "transfers" is what it takes with adjacent streamed blocks merged into one
copy (docs/planner.md says how). The section ends with the stamp (``bench/docgen.py``);
tests/core/test_generated_docs.py checks it is what this script writes now.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "core")):
    if p not in sys.path:
        sys.path.insert(0, p)

import checkpoint_headers as ch  # noqa: E402
import docgen  # noqa: E402
from test_cli import write_header_only  # noqa: E402
from vramcut_core import PlanUnit, make_plan  # noqa: E402
from vramcut_core.cli.commands import main as cli  # noqa: E402

MIB = 1 << 20
DOC = os.path.join(ROOT, "docs", "planner.md")
SCRIPT = "bench/plan_table.py"
MODELS = [("SD1.5 UNet (fp16)", "sd15_unet", lambda: ch.sd15_components()["MODEL"], (0.75, 1, 1.25)),
          ("Flux.1-dev (bf16)", "flux1_dev", ch.flux_dev, (4, 8, 12, 16, 20))]


def plan_json(path: str, gib: float) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli(["plan", path, "--max-vram", f"{gib:g}", "--json"])
    if rc != 0:
        raise RuntimeError(f"plan {path} --max-vram {gib} exited {rc}")
    return json.loads(out.getvalue())


def mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB" if n >= MIB // 10 else f"{n / 1024:,.1f} KiB"


def rows() -> tuple[list[str], list[str]]:
    """The table's rows and the block sizes, per model."""
    table, sizes = [], []
    with tempfile.TemporaryDirectory() as d:
        for name, stem, entries, budgets in MODELS:
            path = os.path.join(d, f"{stem}.safetensors")
            total = write_header_only(path, entries())
            for gib in budgets:
                p = plan_json(path, gib)
                streamed = [s for s in p["segments"] if not s["resident"] and not s["idle"]]
                blocks = sum(len(s["units"]) for s in streamed)
                table.append(f"| {name}, {gib:g} GiB | {len(p['units'])} | "
                             f"{len(p['units']) - blocks} | {blocks} | {p['transfers_per_forward']} | "
                             f"{mib(p['streamed_bytes_per_forward'])} |")
            by_list: dict[str, list[int]] = {}
            for u in p["units"]:
                head = u["name"].rsplit(".", 1)[0] if u["name"].rsplit(".", 1)[-1].isdigit() else u["name"]
                by_list.setdefault(head.rsplit(".", 1)[-1], []).append(u["weight_bytes"])
            parts = ", ".join(f"`{k}` {len(v)} × {mib(max(v))}" if len(v) > 1 else f"`{k}` {mib(v[0])}"
                              for k, v in by_list.items())
            sizes.append(f"- {name}: {total / (1 << 30):.2f} GiB in {len(p['units'])} blocks: {parts} "
                         f"(the largest of each list).")
    return table, sizes


def example() -> str:
    """A larger budget that streams fewer bytes in more transfers."""
    units = [PlanUnit("a", 100 * MIB, None, None)] + [PlanUnit(f"b{i}", 10 * MIB, None, None) for i in range(4)]
    out = []
    for b in (119, 125):
        p = make_plan(units, b * MIB)
        out.append(f"at {b} MiB: {mib(p.streamed_bytes_per_forward)} in {p.transfers_per_forward} transfers "
                   f"({len(p.resident_units)} resident, {p.slots} slot{'s' if p.slots != 1 else ''})")
    return ("A 100 MiB block followed by four 10 MiB blocks (weights only, default options) streams "
            + "; ".join(out) + ".")


def section() -> str:
    """The generated section, stamp last."""
    table, sizes = rows()
    head = ("| model, budget | blocks | resident | blocks streamed (one copy each) | transfers per forward "
            "(merged) | streamed per forward |\n|---|---|---|---|---|---|")
    body = "\n".join([head, *table, "", "Block sizes (weights as stored):", "", *sizes, "", example(), "",
                      docgen.stamp(f"python {SCRIPT}")])
    return body


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the section instead of writing docs/planner.md")
    a = ap.parse_args(argv)
    text = section()
    if a.print:
        print(text)
    else:
        docgen.write_section(DOC, SCRIPT, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
