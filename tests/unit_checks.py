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
