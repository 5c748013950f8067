"""Checks shared by the unit-registry tests (engine toys and real ComfyUI classes)."""
from __future__ import annotations

import torch


def blocks(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


def assert_partition(module: torch.nn.Module, us) -> None:
    """Every parameter and buffer of ``module`` is in exactly one unit (by identity)."""
    where: dict[int, list[str]] = {}
    for u in us.units:
        for t in u.tensors:
            where.setdefault(id(t.tensor), []).append(u.name)
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(dict(module.named_buffers(remove_duplicate=False)))
    missing = [n for n, t in named.items() if id(t) not in where]
    twice = {n: where[id(t)] for n, t in named.items() if len(where.get(id(t), [])) > 1}
    assert not missing, f"tensors in no unit: {missing[:10]}"
    assert not twice, f"tensors in several units: {dict(list(twice.items())[:10])}"
    n_unique = len({id(t) for t in named.values()})
    assert sum(len(u.tensors) for u in us.units) == n_unique
    assert us.weight_bytes == sum(t.numel() * t.element_size()
                                  for t in {id(t): t for t in named.values()}.values())


def assert_peak_within_budget(where, budget: int | None = None) -> int:
    """The measured peak (executor buffers + activations) of the forwards ``where`` reports is
    within the budget. ``where``: ``RunStats``, an ``Engine`` (its stats since the last reset),
    or a plan JSON from the node's payload (``{"budget_bytes", "stats": {...}}``). The peak must
    have been measured (a first forward always is). Returns the peak."""
    if hasattr(where, "stats") and hasattr(where, "config"):  # an Engine
        budget = where.config.budget_bytes if budget is None else budget
        where = where.stats
    if isinstance(where, dict):
        budget = where["budget_bytes"] if budget is None else budget
        assert "stats" in where, "the plan carries no measured stats"
        peak = where["stats"]["peak_device_bytes"]
    else:
        peak = where.peak_device_bytes
    assert budget is not None
    assert peak > 0, "the peak was not measured"
    assert peak <= budget, f"measured peak {peak} B is over the budget {budget} B (+{(peak - budget) / budget:.1%})"
    return peak


def traced_vs_measured(engine) -> tuple[list[tuple[str, int, int]], str | None]:
    """The dry run's per-unit activation peaks beside the real forward's, for the engine's last
    input signature: ([(unit, traced peak bytes, measured peak bytes)], None), or ([], why the
    forward could not be traced). Measured is the CPU meter of the engine's first forward (the
    figures the cached plan is built from)."""
    sig = engine.last_signature
    tr = engine.traces.get(sig)
    if tr is None or tr.measurements is None:
        return [], (tr.reason if tr is not None else "no dry run recorded")
    meas = engine.measurements[sig]
    return [(n, t.peak_bytes, meas[n].peak_bytes) for n, t in tr.measurements.items() if n in meas], None


def peak_ratios(rows: list[tuple[str, int, int]]) -> tuple[float, float, str]:
    """(smallest, largest traced/measured peak ratio over the units, the unit of the one furthest
    from 1)."""
    ratios = [(t / m if m else (1.0 if t == 0 else float("inf")), n) for n, t, m in rows]
    worst = max(ratios, key=lambda r: abs(r[0] - 1))[1]
    return min(r for r, _ in ratios), max(r for r, _ in ratios), worst


TRACE_SLACK_BYTES = 1024


def trace_bound(traced: int, measured: int) -> bool:
    """The bound the dry run keeps against the CPU meter, unit by unit: never below it, above by at
    most 1 % or 1 KiB. Never below: both count every storage an operator creates while the unit
    runs, the trace on fakes of the same shapes. Above: the trace also sees tensors built from
    Python data (``torch.tensor(scale_factors)`` in LTX's patchifier, 24 bytes), which are created
    without an operator and so escape the CPU meter; on CUDA the allocator counts them too."""
    return measured <= traced <= measured + max(measured // 100, TRACE_SLACK_BYTES)


def trace_text(engine) -> str:
    """The coverage table's cell for one engine's dry run against its measured forward."""
    rows, why = traced_vs_measured(engine)
    if why is not None:
        return f"measured ({why})"
    lo, hi, _ = peak_ratios(rows)
    over = max(t - m for _, t, m in rows)
    return f"{lo:.3f}–{hi:.3f}" + (f" (+{over} B at most)" if over else " (equal)")


def assert_trace_bound(engine, label: str, untraced: bool) -> None:
    """The engine's dry run against its measured first forward, every unit within ``trace_bound``;
    or, where ``untraced`` (a forward listed as one the dry run cannot run), that it still cannot."""
    rows, why = traced_vs_measured(engine)
    if untraced:
        assert why is not None, f"{label} traces now: take it out of the untraced list"
        return
    assert why is None, f"{label} could not be traced: {why}"
    assert rows
    for unit, traced, measured in rows:
        assert trace_bound(traced, measured), (label, unit, traced, measured)
