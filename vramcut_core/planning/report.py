"""The plan as a text table and as JSON (the JSON the node sends to the web UI)."""
from __future__ import annotations

import dataclasses
import json

from .budget import budget_gib, need_gib
from .plan import Plan
from ..model.tensors import fmt_bytes, fmt_seconds
from .tiers import DEVICE, DISK, RAM, Tiers, tiers_to_json


@dataclasses.dataclass
class RunStats:
    """What one segmented forward (or a session of them) did."""

    forwards: int = 0
    bytes_streamed: int = 0
    copies: int = 0            # streamed copies (a transfer of streamed units)
    sync_loads: int = 0        # streamed units that were not prefetched in time and loaded on entry
    resident_loads: int = 0    # resident units copied in (once, or again after the host wrote into them)
    time_load_s: float = 0.0   # their copy time (CPU; on CUDA the copy events count it with the copies)
    time_copy_s: float = 0.0
    time_compute_s: float = 0.0
    time_wait_s: float = 0.0
    peak_device_bytes: int = 0        # measured: executor buffers + activations
    peak_weight_bytes: int = 0        # exact: the executor's own device buffers
    # the forwards' own time, start to end (CUDA: events on the compute stream, counted when they
    # have completed, which may be in a later forward's stats; CPU: wall time), over ``timed`` forwards
    time_s: float = 0.0
    timed: int = 0
    disk_bytes_read: int = 0   # read from weights files (disk-tier units, under a RAM budget)

    @property
    def s_per_forward(self) -> float | None:
        """Measured seconds per forward (None: none timed yet)."""
        return self.time_s / self.timed if self.timed else None

    def add(self, other: "RunStats") -> None:
        for f in ("forwards", "bytes_streamed", "copies", "sync_loads", "resident_loads", "timed", "disk_bytes_read"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for f in ("time_copy_s", "time_load_s", "time_compute_s", "time_wait_s", "time_s"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.peak_device_bytes = max(self.peak_device_bytes, other.peak_device_bytes)
        self.peak_weight_bytes = max(self.peak_weight_bytes, other.peak_weight_bytes)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def plan_to_json(plan: Plan, stats: RunStats | None = None, steady: RunStats | None = None) -> dict:
    """Keys are read by tools and the UI: keep them stable. ``stats``: every forward of the run,
    the measuring one included; ``steady``: the forwards after it, which run the plan."""
    out = {
        "budget_bytes": plan.budget_bytes,
        "peak_bytes": plan.peak_bytes,
        "streamed_bytes_per_forward": plan.streamed_bytes_per_forward,
        "transfers_per_forward": plan.transfers_per_forward,
        "resident_bytes": plan.resident_bytes,
        "window_bytes": plan.window_bytes,
        "slots": plan.slots,
        "activation_reserve_bytes": plan.activation_reserve_bytes,
        "measured": plan.measured,
        "source": plan.source,  # "traced" | "measured" (activations known before the first forward?), None
        "split": list(plan.split),
        "warnings": list(plan.warnings),
        "units": [
            {"name": u.name, "weight_bytes": u.weight_bytes, "activation_bytes": u.peak_bytes,
             "cut_in_bytes": u.entry_bytes, "keep_resident": u.keep_resident, "entered": u.entered,
             "calls": u.calls}
            for u in plan.units
        ],
        "segments": [
            {"name": plan.segment_name(s), "units": [plan.units[i].name for i in s.units],
             "weight_bytes": s.weight_bytes, "activation_bytes": s.activation_bytes,
             "peak_bytes": s.peak_bytes, "resident": s.resident,
             "idle": not any(plan.units[i].entered for i in s.units)}
            for s in plan.segments
        ],
    }
    if stats is not None:
        out["stats"] = stats.to_json()
    if steady is not None:
        out["steady_stats"] = steady.to_json()
    if plan.time is not None:
        out["time"] = time_to_json(plan, steady)
    if plan.refit is not None:
        out["refit"] = dataclasses.asdict(plan.refit)
    if plan.tiers is not None:
        out["tiers"] = tiers_to_json(plan.tiers, plan)
    return out


def time_to_json(plan: Plan, steady: RunStats | None = None) -> dict | None:
    """The plan's predicted seconds per forward (``Plan.time``), for all-resident, where its
    compute times come from, and, once forwards that ran the plan were timed (``steady``), the
    measured seconds per forward and the prediction's error ((predicted - measured) / measured)."""
    t = plan.time
    if t is None:
        return None
    measured = steady.s_per_forward if steady is not None else None
    return {"predicted_s": t.predicted_s, "resident_s": t.resident_s, "source": t.source,
            "bound_s": t.bound_s, "gap": t.gap, "measured_s": measured,
            "error": (t.predicted_s - measured) / measured if measured else None}


def cost_to_json(plan_json: dict, bandwidth: dict | None = None) -> dict:
    """What the plan costs, for the node's answer line: does it fit, how many blocks stream (and,
    where blocks were cut finer, how many parts), and the time streaming adds per call (one
    forward of the model: with CFG a sampling step is usually one call of batch 2).

    ``plan_json`` is ``plan_to_json``'s output (its ``stats`` when a run measured them);
    ``bandwidth`` is ``bandwidth.host_to_device``'s answer. The added time is *measured* when
    forwards ran the plan (its ``steady_stats``: the measuring forward streams every block through
    one slot, once per shape, and is left out; the time compute waited on copies, per forward; on
    CPU the copies are synchronous, so that is the copy time), else *estimated* as streamed bytes /
    bandwidth, else None (no bandwidth known). A plan from an older version, without
    ``steady_stats``, is measured by its ``stats``. ``transfers_per_forward`` counts the copies those bytes take (a
    streamed segment is one copy; None for a plan from an older version)."""
    segs = plan_json.get("segments") or []
    streamed = [s for s in segs if not s.get("resident") and not s.get("idle")]
    # the node's words: a block is where the model is cut; a block that alone does not fit the
    # budget is cut finer into parts (the plan's units are then parts, its ``split`` those blocks)
    split = sorted(plan_json.get("split") or [], key=len)
    block_of = lambda unit: next((b for b in split if unit.startswith(f"{b}.")), unit)  # noqa: E731
    units = [u for s in segs for u in (s.get("units") or [])]
    streamed_units = [u for s in streamed for u in (s.get("units") or [])]
    parted = any(block_of(u) != u for u in units)
    stats = (plan_json["steady_stats"] if "steady_stats" in plan_json else plan_json.get("stats")) or {}
    forwards = int(stats.get("forwards") or 0)
    bps = (bandwidth or {}).get("bytes_per_s")
    sbytes = int(plan_json.get("streamed_bytes_per_forward") or 0)
    out = {
        "fits": plan_json.get("peak_bytes", 0) <= plan_json.get("budget_bytes", 0),
        "peak_is_lower_bound": plan_json.get("activation_reserve_bytes") is None,
        "blocks": len({block_of(u) for u in units}),
        "blocks_streamed": len({block_of(u) for u in streamed_units}),
        "parts": len(units) if parted else 0,           # 0: no block was cut finer
        "parts_streamed": len(streamed_units) if parted else 0,
        "streamed_bytes_per_forward": sbytes,
        "transfers_per_forward": plan_json.get("transfers_per_forward"),
        "bandwidth_bytes_per_s": bps,
        "bandwidth_device": (bandwidth or {}).get("device"),
        "bandwidth_source": (bandwidth or {}).get("source"),
        "estimate_s_per_forward": (sbytes / bps) if bps else None,
        "measured_forwards": forwards,
        "measured_s_per_forward": None,
        "measured_copy_s_per_forward": None,
        "measured_compute_s_per_forward": None,
        "measured_bytes_per_forward": None,
        "measured_copies_per_forward": None,
    }
    if forwards:
        out["measured_bytes_per_forward"] = int(stats.get("bytes_streamed", 0)) / forwards
        out["measured_copies_per_forward"] = int(stats.get("copies", 0)) / forwards
        out["measured_s_per_forward"] = float(stats.get("time_wait_s", 0.0)) / forwards
        out["measured_copy_s_per_forward"] = float(stats.get("time_copy_s", 0.0)) / forwards
        out["measured_compute_s_per_forward"] = float(stats.get("time_compute_s", 0.0)) / forwards
    if out["measured_s_per_forward"] is not None:
        out["added_s_per_forward"], out["added_source"] = out["measured_s_per_forward"], "measured"
    elif out["estimate_s_per_forward"] is not None:
        out["added_s_per_forward"], out["added_source"] = out["estimate_s_per_forward"], "estimate"
    else:
        out["added_s_per_forward"], out["added_source"] = None, None
    return out


def _resident_copies(plan: Plan, copies: int) -> str:
    """How often the resident units were copied in: once, or once in each of several calls (each
    call outside a sampling run, such as a VAE decode, starts with nothing on the device)."""
    units = sum(len(s.units) for s in plan.segments if s.resident)
    if units and copies > units and copies % units == 0:
        return f"{units} block{'' if units == 1 else 's'}, copied in {copies // units} calls"
    return "once" if copies <= units else f"{units} block{'' if units == 1 else 's'}, some copied more than once"


def plan_to_text(plan: Plan, title: str = "", stats: RunStats | None = None,
                 steady: RunStats | None = None) -> str:
    """A fixed-width table: one row per segment, then the totals; with ``steady`` (the forwards
    after the measuring one) what they streamed and waited per forward, beside the run's total."""
    rows = []
    wheres = []
    for n, s in enumerate(plan.segments):
        where = "resident" if s.resident else ("idle" if not any(plan.units[i].entered for i in s.units)
                                               else "streamed")
        wheres.append(where)
        rows.append((str(n), plan.segment_name(s), str(len(s.units)), where,
                     fmt_bytes(s.weight_bytes), fmt_bytes(s.activation_bytes), fmt_bytes(s.peak_bytes)))
    head = ("#", "segment", "units", "where", "weights", "activation", "peak")
    widths = [max(len(r[c]) for r in rows + [head]) for c in range(len(head))]
    widths[1] = min(widths[1], 48)

    def line(r) -> str:
        cells = [r[0].rjust(widths[0]), r[1][: widths[1]].ljust(widths[1]), r[2].rjust(widths[2]),
                 r[3].ljust(widths[3])] + [r[c].rjust(widths[c]) for c in range(4, 7)]
        return "  ".join(cells)

    out = [title] if title else []
    out += [line(head), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    act = plan.activation_reserve_bytes
    out.append("")
    window = (f"window {plan.slots}×{fmt_bytes(plan.slot_bytes)}" if plan.slots and plan.slot_bytes
              else "no streaming window")
    out.append(f"budget {budget_gib(plan.budget_bytes)} · peak {need_gib(plan.peak_bytes)} = resident "
               f"{fmt_bytes(plan.resident_bytes)} + {window} + "
               f"activations {fmt_bytes(act) if act is not None else 'not measured'}")
    if plan.source is not None:
        out.append(f"activations {plan.source}: " + (
            ("a dry run on fake tensors gave them before the first call, which measured them"
             if stats is not None and stats.forwards else
             "a dry run on fake tensors gave them; no weight has moved and no call has run yet")
            if plan.source == "traced" else "the dry run could not run: the first call measured them"))
    # the node's words: a call is one forward of the model; a copy, one streamed segment sent
    t = plan.transfers_per_forward
    out.append(f"streamed per call {fmt_bytes(plan.streamed_bytes_per_forward)} in {t} "
               f"cop{'y' if t == 1 else 'ies'} · "
               + " · ".join(f"{wheres.count(w)} {w}" for w in ("resident", "streamed", "idle")
                            if w != "idle" or "idle" in wheres) + " segments")
    if plan.split:
        out.append("blocks cut into parts to fit: " + ", ".join(plan.split))
    for w in plan.warnings:
        out.append(f"warning: {w}")
    if stats is not None and stats.forwards:
        n = stats.forwards
        k, r = stats.copies, stats.resident_loads
        out.append(f"measured: {n} call{'' if n == 1 else 's'}"
                   + (", the measuring one included (it streams every block through one slot)"
                      if steady is not None else "")
                   + f": streamed {fmt_bytes(stats.bytes_streamed)} in {k} cop{'y' if k == 1 else 'ies'}"
                   + (f", {r} resident cop{'y' if r == 1 else 'ies'} ({_resident_copies(plan, r)})" if r else "")
                   + f", peak device {fmt_bytes(stats.peak_device_bytes)}, copy {stats.time_copy_s:.3f} s, "
                   f"wait {stats.time_wait_s:.3f} s, compute {stats.time_compute_s:.3f} s")
    tj = time_to_json(plan, steady)
    if tj is not None:
        ratio = f"{tj['predicted_s'] / tj['resident_s']:.2f}× resident" if tj["resident_s"] > 0 else "resident 0 s"
        line = (f"predicted +{tj['predicted_s'] - tj['resident_s']:.3f} s/call over resident ({ratio}; "
                f"compute times {tj['source']})")
        if tj["gap"] is not None:
            line += f"; at most {100 * tj['gap']:.1f} % slower than the fastest residency under the model"
        if tj["measured_s"] is not None:
            line += f"; measured {tj['measured_s']:.3f} s (error {100 * tj['error']:+.1f} %)"
        out.append(line)
    if plan.refit is not None:
        out.append(f"planned again for {budget_gib(plan.refit.budget_bytes)} (was "
                   f"{budget_gib(plan.refit.previous_budget_bytes)}): {plan.refit.reason}")
    if plan.tiers is not None:
        out.append(tiers_text(plan.tiers, parts=bool(plan.split)))
    if steady is not None and steady.forwards:
        n = steady.forwards
        out.append(f"per call after measuring ({n}): streamed {fmt_bytes(steady.bytes_streamed // n)} in "
                   f"{steady.copies / n:g} cop{'y' if steady.copies == n else 'ies'}, wait {steady.time_wait_s / n:.3f} s")
    return "\n".join(out)


def tiers_text(t: Tiers, parts: bool = False) -> str:
    """One line for the CLI and the node's table, in the node's words (a unit is a block, or a
    part where blocks were cut finer: ``parts``) and sizes (``fmt_bytes``, as the node writes
    them): the three tiers, the reads per call and their predicted time, the bounce buffer."""
    c = tiers_to_json(t)["units"]
    word = "part" if parts else "block"
    n = lambda k: f"{k} {word}{'' if k == 1 else 's'}"  # noqa: E731
    line = (f"host tiers under {t.ram_budget_bytes / 1024**3:.3f} GiB RAM: {n(c[DEVICE])} on the device, "
            f"{c[RAM]} in RAM ({fmt_bytes(t.ram_bytes - t.held_bytes)}), {c[DISK]} read from disk "
            f"({fmt_bytes(t.disk_bytes_per_call)} per call")
    s = t.disk_s_per_call
    line += (f", {fmt_seconds(s)} predicted at {t.disk_bytes_per_s / 1e9:.2f} GB/s)" if s is not None
             else ", disk rate not measured)")
    if t.held:  # resident units whose host copies the budget's room keeps (no call reads them again)
        line += f"; {n(len(t.held))} on the device kept in RAM too ({fmt_bytes(t.held_bytes)})"
    if t.bounce_bytes:
        line += f"; bounce buffer {fmt_bytes(t.bounce_bytes)}"
    return line


def dumps(obj) -> str:
    return json.dumps(obj, indent=2)
