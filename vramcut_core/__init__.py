"""VRAMCut engine: cut a model's forward at block boundaries and run it under a VRAM budget.

Imports torch only, never ComfyUI. See ``Engine`` for the entry point. The names below are the
engine's public face, and the only ones the ComfyUI adapter (``nodes/``) may import. The folders
are the engine's parts (docs/architecture.md): ``model`` (units, tensor bytes, quantized weights),
``figures`` (the dry run, meters, bandwidth), ``planning`` (plans under a budget), ``formats``
(checkpoint headers), ``runtime`` (the executor and its rooms) and ``cli`` (the command line).
"""
from .figures.bandwidth import host_to_device
from .engine import Engine, EngineConfig, HostHooks, TraceUnavailable
from .runtime.executor import SegmentedExecutor
from .figures.meters import signature
from .planning.placement import parse_devices
from .planning.budget import BudgetError, gib_text, gib_to_bytes
from .planning.plan import Plan, PlanOptions, PlanUnit, Segment, build_plan, make_plan
from .model.quant import parts as quant_parts
from .planning.report import RunStats, cost_to_json, plan_to_json, plan_to_text
from .model.tensors import GIB, fmt_bytes, is_plain_tensor
from .planning.tiers import RamBudgetError
from .model.units import FAMILIES, Family, Unit, UnitSet, find_units, split_unit

__version__ = "0.1.0"

__all__ = [
    "BudgetError", "Engine", "EngineConfig", "FAMILIES", "Family", "GIB", "HostHooks", "Plan", "PlanOptions",
    "PlanUnit", "RamBudgetError", "RunStats", "Segment", "SegmentedExecutor", "TraceUnavailable", "Unit", "UnitSet",
    "build_plan", "cost_to_json", "find_units", "fmt_bytes", "gib_text", "gib_to_bytes", "host_to_device", "is_plain_tensor",
    "make_plan", "parse_devices", "plan_to_json", "plan_to_text", "quant_parts", "signature", "split_unit",
]
