"""Command line: ``python -m vramcut_core plan FILE --max-vram GIB`` and ``... demo``.

``--max-ram GIB`` adds the host tiers (``tiers``): which units' host copies fit the RAM budget and
which are read from the file each call, with the reads' predicted time at ``--disk-gbps``.

``plan FILE --devices cuda:0=8,cuda:1=8`` places the model across devices instead, one budget
each (``placement.place``): one row per device, the hops between them."""
from __future__ import annotations

import argparse
import sys

from ..planning.budget import BudgetError, gib_to_bytes
from ..planning.plan import PlanOptions, make_plan
from ..planning.report import dumps, plan_to_json, plan_to_text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other error here
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m vramcut_core", description="VRAMCut: run models under a VRAM budget.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    pl = sub.add_parser("plan", help="plan a .safetensors or .gguf model from its header (no weights read); "
                                     "an all-in-one checkpoint is planned per component (MODEL, CLIP, VAE)")
    pl.add_argument("model", help="path to a .safetensors or .gguf file (quantized: stored bytes)")
    pl.add_argument("--max-vram", metavar="GIB", help="VRAM budget in GiB (one device)")
    pl.add_argument("--devices", metavar="DEV=GIB,...",
                    help="plan across devices, a budget each in GiB, in the order the forward visits them "
                         "(e.g. cuda:0=8,cuda:1=8); instead of --max-vram")
    pl.add_argument("--max-ram", metavar="GIB",
                    help="RAM budget in GiB for the model's host copies: what does not fit is read from the "
                         "file each call (printed as host tiers)")
    pl.add_argument("--disk-gbps", metavar="GB/S", type=float,
                    help="the disk's read rate in GB/s for the predicted reads (default: the rate measured "
                         "before on this file's disk, if any; nothing is read now)")
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
    from ..formats.safetensors_plan import read_header, split_components

    from ..formats.gguf_header import is_gguf, read_gguf_header

    if (a.max_vram is None) == (a.devices is None):
        raise ValueError("give one of --max-vram GIB or --devices DEV=GIB,...")
    devices = None
    if a.devices is not None:
        from ..planning.placement import parse_devices
        devices = parse_devices(a.devices)  # "free" refused here: no device is queried
    budget = gib_to_bytes(a.max_vram) if devices is None else None
    if a.max_ram is not None and devices is not None:
        raise ValueError("--max-ram plans one device: give it with --max-vram")
    if a.disk_gbps is not None and not a.disk_gbps > 0:
        raise ValueError(f"--disk-gbps must be a positive rate, got {a.disk_gbps}")
    header = read_gguf_header(a.model) if is_gguf(a.model) else read_header(a.model)
    a.ram = (None, None)   # (RAM budget bytes, disk bytes per second)
    if a.max_ram is not None:
        a.ram = (gib_to_bytes(a.max_ram), a.disk_gbps * 1e9 if a.disk_gbps else _cached_disk_rate(a.model))
    opts = PlanOptions(prefetch=not a.no_prefetch, residency=not a.no_residency)
    if devices is not None:
        return _place(a, header, devices, opts)
    comps, rest = split_components(header)
    if len(comps) > 1:
        return _plan_components(a, comps, rest, budget, opts)
    units, plan = _plan_header(a.model, header, budget, opts, a.ram)
    if a.json:
        print(dumps(plan_to_json(plan)))
    else:
        print(plan_to_text(plan, title=f"{a.model}: {len(units)} units, weights only, "
                                       f"stored bytes ({_kinds(header)})"))
    return 0


def _place(a, header: dict, devices, opts: PlanOptions) -> int:
    """The model's header placed across ``devices``: a row per device, the hops between them."""
    from ..planning.placement import place
    from ..formats.safetensors_plan import plan_units_from_header
    from ..model.tensors import fmt_bytes

    from ..formats.safetensors_plan import split_components

    comps, _ = split_components(header)
    if len(comps) > 1:
        raise ValueError(f"{a.model}: --devices places one model; this checkpoint holds "
                         f"{', '.join(c.name for c in comps)} (plan it with --max-vram)")
    units = plan_units_from_header(header)
    if not units:
        raise ValueError(f"{a.model}: holds no tensors")
    p = place(units, devices, opts)
    if a.json:
        print(dumps({
            "devices": [{"device": d.device, "budget_bytes": d.budget_bytes,
                         "units": [u.name for u in units[d.first:d.stop]],
                         "plan": plan_to_json(d.plan) if d.plan is not None else None} for d in p.devices],
            "hops": [{"from": h.src, "to": h.dst, "before_unit": h.unit, "bytes": h.bytes} for h in p.hops],
            "host_bytes_per_forward": p.host_bytes_per_forward,
            "hop_bytes_known": p.hop_bytes_known,
        }))
        return 0
    out = [f"{a.model}: {len(units)} units on {len(devices)} devices, weights only, stored bytes ({_kinds(header)})"]
    for d in p.devices:
        if d.plan is None:
            out.append(f"  {d.device:<8} budget {fmt_bytes(d.budget_bytes):>10}  (no units)")
            continue
        pl = d.plan
        first, last = units[d.first].name, units[d.stop - 1].name
        out.append(f"  {d.device:<8} budget {fmt_bytes(d.budget_bytes):>10}  peak {fmt_bytes(pl.peak_bytes):>10}  "
                   f"resident {fmt_bytes(pl.resident_bytes)}  window {fmt_bytes(pl.window_bytes)}  "
                   f"streamed/forward {fmt_bytes(pl.streamed_bytes_per_forward)}  "
                   f"units {first} … {last} ({d.stop - d.first})")
    for h in p.hops:
        size = fmt_bytes(h.bytes) if p.hop_bytes_known else "not measured (weights only)"
        out.append(f"  hop {h.src} -> {h.dst} before {h.unit}: {size}")
    out.append(f"host-link bytes per call: {fmt_bytes(p.host_bytes_per_forward)} · hops per call: {len(p.hops)}")
    print("\n".join(out))
    return 0


def _cached_disk_rate(path: str) -> float | None:
    """The cold read rate measured before on ``path``'s disk (none is measured here)."""
    from ..figures import bandwidth

    try:
        hit = bandwidth._read_cache().get(bandwidth.disk_key(path) + ":cold")
    except OSError:
        return None
    rate = hit.get("bytes_per_s") if isinstance(hit, dict) else None
    return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None


def _kinds(header: dict) -> str:
    return ", ".join(sorted({v["dtype"] for v in header.values()}))


def _plan_header(what: str, header: dict, budget: int, opts: PlanOptions, ram: tuple = (None, None)):
    from ..formats.safetensors_plan import plan_units_from_header

    units = plan_units_from_header(header)
    if not units:
        raise ValueError(f"{what}: holds no tensors")
    return units, _tiered(make_plan(units, budget, opts), *ram)


def _tiered(plan, ram: int | None, rate: float | None):
    """``plan`` with its host tiers under ``--max-ram`` (every tensor read from the checkpoint
    itself: a header's offsets are the file's), planned for a GPU (with its bounce buffer)."""
    if ram is None:
        return plan
    import dataclasses

    from ..planning.tiers import HostUnit, bounce_for, choose
    from ..runtime import host_memory

    host = {u.name: HostUnit(u.weight_bytes, u.weight_bytes) for u in plan.units}
    bounce = bounce_for(host, host_memory.BOUNCE_PIECE, host_memory.BOUNCE_PIECES)
    return dataclasses.replace(plan, tiers=choose(plan, host, ram, bounce, rate))


def _plan_components(a, comps, rest: dict, budget: int, opts: PlanOptions) -> int:
    """An all-in-one checkpoint: each model planned on its own under the whole budget, as the
    node plans its MODEL, CLIP and VAE inputs (they run one after another, never together)."""
    from ..formats.safetensors_plan import header_bytes
    from ..model.tensors import fmt_bytes

    planned = []
    for c in comps:
        try:
            units, plan = _plan_header(f"{a.model} ({c.name})", c.header, budget, opts, a.ram)
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
