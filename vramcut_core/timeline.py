"""Time: each unit's compute time, and the step time a plan predicts.

Pure (no torch, no device calls). A unit's compute time comes from the dry run's FLOP count
(``UnitMeasurement.flops``, counted by torch's ``FlopCounterMode``) divided by the matrix-product
throughput measured on this machine (``bandwidth.matmul_throughput``), or from a measured forward;
it is kept on the plan's rows (``PlanUnit.compute_s``).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from .plan import PlanUnit


def unit_seconds(flops: int | None, flops_per_s: float | None) -> float | None:
    """Compute seconds of ``flops`` operations at ``flops_per_s``; None when either is unknown."""
    if flops is None or not flops_per_s or flops_per_s <= 0:
        return None
    return flops / flops_per_s


def with_compute_times(units: Sequence[PlanUnit], flops: Mapping[str, int | None],
                       flops_per_s: float | None) -> list[PlanUnit]:
    """``units`` with ``compute_s`` from each unit's FLOP count (``flops[name]``, e.g. the dry run's
    ``UnitMeasurement.flops``) at the measured throughput; a unit without a count keeps None."""
    return [dataclasses.replace(u, compute_s=unit_seconds(flops.get(u.name), flops_per_s)) for u in units]

