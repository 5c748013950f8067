"""VRAMCut engine: cut a model's forward at block boundaries and run it under a VRAM budget.

Imports torch only, never ComfyUI. See ``Engine`` for the entry point.
"""
from .engine import Engine, EngineConfig, TraceUnavailable
from .executor import SegmentedExecutor
from .measure import signature
from .plan import BudgetError, Plan, PlanOptions, PlanUnit, Segment, build_plan, gib_to_bytes, make_plan
from .report import RunStats, plan_to_json, plan_to_text
from .units import FAMILIES, Family, Unit, UnitSet, find_units, split_unit

__version__ = "0.1.0"

__all__ = [
    "BudgetError", "Engine", "EngineConfig", "FAMILIES", "Family", "Plan", "PlanOptions", "PlanUnit",
    "RunStats", "Segment", "SegmentedExecutor", "TraceUnavailable", "Unit", "UnitSet", "build_plan", "find_units",
    "gib_to_bytes", "make_plan", "plan_to_json", "plan_to_text", "signature", "split_unit",
]
