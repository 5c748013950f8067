"""The engine: one module under one budget.

``Engine.run(fn, *args, **kwargs)`` runs a forward of the module segmented. Before the first
forward for an input signature, a dry run on fake tensors (``trace``) gives each unit's
activation bytes; the merged plan is built from them, so a budget too small for the shape is
refused at once, before any weight is copied, with the smallest budget that works. The first real
forward runs that plan and measures: its figures are the authority, and the plan cached for the
signature is rebuilt from them. Later forwards with the same signature reuse it, so a sampling run
plans once; a new resolution or batch plans again.

On CUDA, shapes that alternate while the executor holds
its buffers (CFG's cond and uncond, two batch sizes) and whose plans would lay the buffers out
differently share one plan, made from the most each unit needed in any of them: a steady step of
any mix of them then reshapes nothing (no buffer freed or allocated, no host sync, no
``empty_cache``, no fragmentation of the allocator's cache).

The one rule: the first forward stays within the budget too. Where the dry run cannot run (or its
plan is passed), the first forward is the measured one of old: every unit streams through one
slot, cut only as far as the budget needs for weights alone; the executor stops it the moment
weights plus live activations would pass the budget, and the engine cuts every unit of the
slot's size finer and measures again, for as long as that lowers the weights it holds. When it
cannot, a ``BudgetError`` names what does not fit and a lower bound of the budget that works.

With ``VRAMCUT_VERIFY=1`` in the environment (or ``EngineConfig(verify=True)``) the first forward
of each new shape is run a second time unpatched on the same inputs and the largest absolute
difference is logged and kept in ``Engine.verify_results``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Callable, Sequence

import torch
from torch import nn

from .devices import DeviceGroup, check_hops, combined, combined_plan, placement_json, unit_devices
from .runtime.executor import SegmentedExecutor
from .planning.placement import Placement, place
from .runtime.hops import HOME
from .figures.meters import OverBudget, UnitMeasurement, describe_signature, joint_measurements, signature
from .planning.budget import BudgetError, STOPPED, budget_error, gib_text
from .planning.plan import Plan, PlanOptions, REFIT_MARGIN, Refit, refit_budget, refit_reason
from .planning.report import RunStats, plan_to_json, plan_to_text
from .model.tensors import fmt_bytes, max_abs_diff
from .figures.trace import MEASURED, TRACED, TraceResult, trace_units, tracing
from .planning.planner import UnitPlanner
from .figures import speed
from .figures.speed import SPEEDS, UnitTimes

log = logging.getLogger("vramcut")

VERIFY_ENV = "VRAMCUT_VERIFY"


def verify_from_env() -> bool:
    return os.environ.get(VERIFY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    budget_bytes: int
    device: str = "cuda"
    family: str | None = None
    prefetch: bool = True
    residency: bool = True
    keep_resident: tuple[str, ...] = ()  # unit name patterns that must stay resident
    track_cpu_memory: bool = False   # measure activations on every CPU forward, not only the first
    pin_memory: bool = True          # page-lock host masters (CUDA); off: plain pageable copies
    keep_file_backed: bool = False   # file-mapped weights stay their own masters (no flat host
                                     # copy), streamed through a page-locked window (a fast disk)
    verify: bool = dataclasses.field(default_factory=verify_from_env)  # compare first forwards with unpatched
    # residency chosen by predicted time ("time"), by bytes ("count") or "auto" (time on CUDA); see ``speed``
    speed: str = "auto"
    bandwidth_bytes_per_s: float | None = None  # host-to-device; None: the figure measured before, if any
    flops_per_s: float | None = None            # compute throughput; None: measured once (``bandwidth``)
    copy_latency_s: float | None = None         # fixed seconds per copy; None: the bandwidth probe's fit (or 0)
    # per-device budgets in bytes, in the user's order (``placement.parse_devices``); empty: one
    # device, ``device``, under ``budget_bytes``. Non-empty: ``device`` is the home device (inputs
    # arrive and the output returns there) and one of them; ``budget_bytes`` is their sum
    devices: tuple[tuple[str, int], ...] = ()
    # host memory the pack may hold for this module's weights (``tiers``): flat masters, the bounce
    # buffer; what does not fit is read from its file each call. None: no RAM budget (every
    # streamed unit has its master in RAM, as before)
    ram_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget_bytes, int) or isinstance(self.budget_bytes, bool) or self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {self.budget_bytes!r}")
        if self.speed not in SPEEDS:
            raise ValueError(f"speed must be one of {', '.join(SPEEDS)}, got {self.speed!r}")
        for f in ("bandwidth_bytes_per_s", "flops_per_s", "copy_latency_s"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not (v >= 0 if f == "copy_latency_s" else v > 0)):
                raise ValueError(f"{f} must be a positive number or None, got {v!r}")
        if self.devices:
            _check_devices(self)
        r = self.ram_budget_bytes
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r <= 0):
            raise ValueError(f"ram_budget_bytes must be a positive int or None, got {r!r}")
        if r is not None and len(self.devices) > 1:
            raise ValueError("ram_budget_bytes: a RAM budget is planned for one device only, not yet for several")

    @property
    def options(self) -> PlanOptions:
        return PlanOptions(prefetch=self.prefetch, residency=self.residency)


def _check_devices(c: "EngineConfig") -> None:
    names = []
    for entry in c.devices:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"devices: each entry is (device, budget bytes), got {entry!r}")
        name, b = entry
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError):
            raise ValueError(f"devices: {name!r} is not a device") from None
        if len(c.devices) > 1 and (dev.index is None or dev.type != "cuda"):  # one device: today's path
            raise ValueError(f"devices: {name!r}: name each device with its index (cuda:N); "
                             "several devices must all be CUDA devices")
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
            raise ValueError(f"devices: the budget of {name} must be a positive int of bytes, got {b!r}")
        names.append(str(dev))
    if len(set(names)) != len(names):
        raise ValueError(f"devices: a device is named twice ({', '.join(names)})")
    home = torch.device(c.device)
    if str(home) not in names:
        raise ValueError(f"devices: the home device {c.device!r} (where inputs arrive and the output "
                         f"returns) must be one of {', '.join(names)}")
    total = sum(b for _, b in c.devices)
    if c.budget_bytes != total:
        raise ValueError(f"devices: budget_bytes ({c.budget_bytes}) must be the devices' budgets summed ({total})")


@dataclasses.dataclass(frozen=True)
class HostHooks:
    """What a host tells an engine of its own use of the device, given once at construction.

    ``alloc_context()`` is entered around every device allocation the engine makes (a host that
    records allocation graphs keeps the engine's out of them). ``reader_streams()`` lists the
    host's other streams that may read weights while they are swapped in (its offload streams):
    each is ordered after the copies, as the compute stream is. ``page_lock_room()`` gives the
    bytes the host's own page-lock limit leaves after what the host locked itself; the engines'
    page-locked bytes stay within it (the process has one ledger: the last host to give one
    sets it)."""

    alloc_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    reader_streams: Callable[[], list] | None = None
    page_lock_room: Callable[[], int] | None = None


class TraceUnavailable(RuntimeError):
    """The dry run could not run these inputs (``Engine.preview_as``); the message says why."""


class Engine:
    """The engine's public face, and the adapter's only door: a host builds one per module with
    its ``HostHooks`` and runs forwards through ``run`` / ``run_as``."""

    def __init__(self, module: nn.Module, config: EngineConfig,
                 on_plan: Callable[["Engine", Plan, tuple], None] | None = None,
                 host: HostHooks | None = None) -> None:
        self.module = module
        self.on_plan = on_plan
        host = host or HostHooks()
        self.planner = UnitPlanner(module, config, lambda name: self.executor.unit_device_bytes(name))
        self.planner.figures.room = lambda: self.probe_room_bytes  # probes run inside the budget

        def make(device):
            return SegmentedExecutor(self.planner.unit, device, pin_memory=config.pin_memory,
                                     track_cpu_memory=config.track_cpu_memory, module=module,
                                     keep_file_backed=config.keep_file_backed,
                                     alloc_context=host.alloc_context, reader_streams=host.reader_streams,
                                     page_lock_room=host.page_lock_room)

        # more than one device: one executor per device (the home one answers for the engine)
        self.group: DeviceGroup | None = None
        if len(config.devices) > 1:
            self.group = DeviceGroup(make, config.devices, config.device)
            self.executor = self.group.executor_of(config.device)
        else:
            self.executor = make(config.device)
        self.executors = self.group.executors if self.group is not None else [self.executor]
        self._placed: dict[tuple, tuple[Placement, str, list]] = {}  # sig -> placement, hop rule, dry-run hops
        self._place_for: tuple[tuple[str, int], ...] | None = None   # budgets placed for, where below the config's
        self._device_refit: Refit | None = None   # why the placements were made again for new budgets
        self._to_place: set[tuple] = set()   # signatures to place again from their measurements
        self.device_stats: dict[str, RunStats] = {}   # per device, the forwards that ran a placement
        self.last_device_stats: dict[str, RunStats] = {}
        self.planner.block_bytes = self.executor.memory.block_bytes
        self.planner.host = self.executor.masters.tiers
        self._plans: dict[tuple, Plan] = {}
        self._joined: dict[tuple, frozenset] = {}   # signature -> the signatures sharing its plan
        self._failed: dict[tuple, BudgetError] = {}
        self.measurements: dict[tuple, dict[str, UnitMeasurement]] = {}
        self.traces: dict[tuple, TraceResult] = {}  # the dry run's profile per input signature
        self.times = UnitTimes(self.planner.top)    # measured compute seconds per unit, per signature
        self._untimed: set[tuple] = set()   # CPU: signatures whose next forward times its units
        self._replanned: dict[tuple, str] = {}  # signatures a steady forward's peak sent back to measuring: why
        self.last_plan: Plan | None = None
        self.last_signature: tuple | None = None
        self.stats = RunStats()
        self.last_stats: RunStats | None = None
        self.steady_stats = RunStats()  # the forwards that ran a plan (not the measuring ones)
        self.verify_results: list[dict] = []

    # -- units (the planner owns them) ------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self.planner.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self.planner.config = config

    @property
    def unitset(self):
        return self.planner.unitset

    def weight_plan(self, options: PlanOptions | None = None) -> Plan:
        """The plan from weights alone (structural order, activations not measured)."""
        return self.planner.weight_plan(options)

    def revalidate(self) -> None:
        """Find the units again if the module's tensors were replaced from outside (a host that
        sets new Parameter objects); plans stay cached when the unit names did not change.
        Skipped while the executor holds the weights of an all-resident plan between forwards:
        whoever replaces or writes weights inside a session calls ``weights_changed`` first."""
        if any(ex.holds_weights for ex in self.executors) or not self.planner.stale():
            return
        for ex in self.executors:
            ex.forget_units()
        if self.planner.refind():
            self._forget_plans()
            self.measurements.clear()
            self.traces.clear()
            self.times.forget()

    # -- the first forward of a signature ----------------------------------------------------

    def _measure(self, fn: Callable, args: tuple, kwargs: dict, cap: int | None = None):
        """The measured forward, within the budget: (output, stats, measurements by whole unit).
        Units larger than ``cap`` are cut finer first; stopped before passing the budget, it is run
        again with the slot cut finer."""
        budget = self.config.budget_bytes
        cap = budget if cap is None else max(1, cap)
        last: int | None = None
        while True:
            base = self.planner.measuring_plan(cap)
            try:
                out, stats, meas = self.executor.forward(base, fn, *args, measure=True,
                                                         limit_bytes=budget, **kwargs)
                return out, stats, self.planner.aggregate(meas)
            except OverBudget as e:
                held = base.resident_bytes + base.window_bytes
                hopeless = base.resident_bytes + e.activation_bytes > budget  # no slot would help
                if (e.kind == "weights" or base.slot_bytes == 0 or hopeless
                        or (last is not None and held >= last)):
                    raise _stopped_error(base, e, budget, self.executor.unit_device_bytes) from None
                log.info("VRAMCut: measuring forward stopped before passing the budget in '%s' "
                         "(%s weights + %s activations); cutting the slot finer", e.unit,
                         fmt_bytes(e.weight_bytes), fmt_bytes(e.activation_bytes))
                last, cap = held, base.slot_bytes - 1  # cut every unit of the slot's size

    def _first_forward(self, sig: tuple, fn: Callable, args: tuple, kwargs: dict):
        """The first forward of a signature: (output, stats, measurements by whole unit, source).
        Planned from the dry run when it ran (a budget too small is refused here, nothing copied).
        On CPU the real forward runs that plan and measures (the dry run counts what the CPU meter
        counts). On CUDA the caching allocator holds more than the operators' bytes (rounding,
        blocks it does not reuse: what the CUDA meter counts), so the first forward is the
        measuring one, its slot cut up front to fit beside the traced activations. Either way it
        stops before passing the budget, and is measured the old way if it does."""
        tr = self._trace(sig, fn, args, kwargs)
        if tr.reason is not None:
            log.warning("VRAMCut: the dry run could not run (%s); the first forward measures the "
                        "activations instead (a budget too small is found only as it runs)", tr.reason)
        if tr.measurements is None:
            return (*self._measure(fn, args, kwargs), MEASURED)
        plan = self.planner.measured_plan(dict(tr.measurements), TRACED)  # refuses a budget too small
        if self.executor.cuda:
            required = self.planner.keep_resident_bytes()
            return (*self._measure(fn, args, kwargs, self.config.budget_bytes - required - tr.peak_bytes), TRACED)
        try:
            out, stats, meas = self.executor.forward(plan, fn, *args, measure=True,
                                                     limit_bytes=self.config.budget_bytes, **kwargs)
            return out, stats, self.planner.aggregate(meas), TRACED
        except OverBudget as e:
            log.warning("VRAMCut: the first forward passed the traced plan in '%s' (%s weights + %s "
                        "activations); measuring it again", e.unit, fmt_bytes(e.weight_bytes),
                        fmt_bytes(e.activation_bytes))
        return (*self._measure(fn, args, kwargs), TRACED)

    def _trace(self, sig: tuple, fn: Callable, args: tuple, kwargs: dict, keep_failure: bool = True,
               on_loaded: Callable | None = None) -> TraceResult:
        """The dry run's profile of ``sig``, cached (a failure only with ``keep_failure``). The
        call's ``on_loaded`` hook (the executor's, in a run) runs in it, on the fakes."""
        tr = self.traces.get(sig)
        if tr is None:
            for ex in self.executors:
                ex.restore_weights()  # the dry run swaps the registries the held copies use
            tr = trace_units(self.module, self.unitset.units, fn, args, kwargs,
                             on_loaded=on_loaded or self.executor.on_loaded)
            if tr.measurements is not None or keep_failure:
                self.traces[sig] = tr
        return tr

    def preview_as(self, sig: tuple, fn: Callable, *args, on_loaded: Callable | None = None, **kwargs) -> Plan:
        """The plan the first forward of ``fn(*args, **kwargs)`` (input signature ``sig``) would
        run, from the dry run alone: no weight copied, no real forward. A budget too small is a
        ``BudgetError``, a forward the dry run cannot run a ``TraceUnavailable``; neither is
        remembered. Only the traced profile stays, cached as the first forward would cache it
        (``on_loaded``: the hook the run will call, as ``run`` takes it)."""
        self.revalidate()
        tr = self._trace(sig, fn, args, kwargs, keep_failure=False, on_loaded=on_loaded)
        if tr.measurements is None:
            raise TraceUnavailable(tr.reason or "the dry run gave no figures")
        if self.group is not None:  # the placement, drawn as one plan
            return combined_plan(self._place(dict(tr.measurements), sig), TRACED)
        return self.planner.measured_plan(dict(tr.measurements), TRACED)

    def plan_for(self, args: tuple = (), kwargs: dict | None = None) -> Plan | None:
        return self._plans.get(signature(args, kwargs or {}))

    # -- running ---------------------------------------------------------------------------

    def session(self):
        """Keep device buffers between forwards (a sampling run); release them at the end."""
        if self.group is None:
            return self.executor.session()
        stack = contextlib.ExitStack()
        for ex in self.executors:
            stack.enter_context(ex.session())
        return stack

    def release(self) -> None:
        for ex in self.executors:
            ex.release()

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget (resolved late, from the device's free memory, maybe before every step).
        The plan running is kept while the budget still holds its peak and has not grown past
        ``plan.REFIT_MARGIN`` (``plan.refit_reason``: no churn when free memory wobbles); else
        every cached plan is made again at once from its measurements (no forward measures
        again), carrying the reason (``Plan.refit``). A budget that fell is planned for
        ``plan.REFIT_DOWN_MARGIN`` below it (``plan.refit_budget``), so that memory taken a little
        at a time re-plans once, not at every step. Failures made for the old budget are
        dropped; measurements stay."""
        old = self.config.budget_bytes
        if budget_bytes == old:
            return
        self.config = dataclasses.replace(self.config, budget_bytes=budget_bytes)
        self._failed.clear()
        plan = self._plans.get(self.last_signature) if self.last_signature is not None else None
        why = refit_reason(plan, budget_bytes) if plan is not None else ""
        if why is None:
            return
        plans = dict(self._plans)
        self._forget_plans()
        if not why:
            return  # nothing planned yet
        log.warning("VRAMCut: %s; planning again", why)
        if not self.running:
            self.release()  # the old plan's buffers go before the new plan allocates
        # a fall plans a margin below the new budget (``plan.refit_budget``): further small drops keep it
        target = refit_budget(budget_bytes, plan.budget_bytes)
        self.planner.plan_budget = target if target < budget_bytes else None
        refit = Refit(why, budget_bytes, plan.budget_bytes)
        for sig, p in plans.items():
            if sig not in self.measurements:
                continue
            try:
                self._plans[sig] = dataclasses.replace(
                    self.planner.measured_plan(self.measurements[sig], p.source, self.times.seconds(sig)), refit=refit)
            except BudgetError as e:
                self._failed[sig] = e
        new = self._plans.get(self.last_signature)
        if new is not None:
            self.last_plan = new
            if self.on_plan is not None:
                self.on_plan(self, new, self.last_signature)

    def set_devices(self, devices: Sequence[tuple[str, int]]) -> None:
        """New budgets for the same devices (a ``free`` entry read again before a call; see
        ``set_budget`` for one device). The placements are kept while each device's part still
        holds its peak and no budget grew past ``plan.REFIT_MARGIN`` (``plan.refit_reason`` per
        device); else every signature measured is placed again at its next forward from its
        measurements (no forward measures again; the hops of a new cut from the dry run on fake
        devices), a fallen budget placed ``plan.REFIT_DOWN_MARGIN`` below it, and the plan
        carries why (``Plan.refit``). Budgets too small for a measured shape refuse it then."""
        devices = tuple((str(torch.device(d)), int(b)) for d, b in devices)
        old = self.config.devices
        if devices == old:
            return
        if [d for d, _ in devices] != [d for d, _ in old]:
            raise ValueError(f"set_devices: new budgets for the same devices ({', '.join(d for d, _ in old)}), "
                             f"in the same order; got {', '.join(d for d, _ in devices)}")
        self.config = dataclasses.replace(self.config, devices=devices, budget_bytes=sum(b for _, b in devices))
        self._failed.clear()
        placed = self._placed.get(self.last_signature) if self.last_signature is not None else None
        new = dict(devices)
        whys = []
        for d in placed[0].devices if placed is not None else ():
            if d.plan is not None:
                why = refit_reason(d.plan, new[d.device])
            elif new[d.device] > d.budget_bytes * (1 + REFIT_MARGIN) and placed[0].host_bytes_per_forward:
                why = f"the budget grew to {gib_text(new[d.device])} GiB"
            else:
                why = None
            if why:
                whys.append(f"{d.device}: {why}")
        if placed is not None and not whys:
            if self._place_for is not None:   # a new shape: placed for no more than either says
                was = dict(self._place_for)
                self._place_for = tuple((d, min(b, was.get(d, b))) for d, b in devices)
            return   # every device's part still holds
        self._to_place = set(self._placed) & set(self.measurements)
        self._placed.clear()
        self._plans.clear()
        self._joined.clear()
        if placed is None:
            self._place_for = None
            return   # nothing placed yet
        why = "; ".join(whys)
        log.warning("VRAMCut: %s; placing again", why)
        if not self.running:
            self.release()   # the old placement's buffers go before the new one allocates
        before = {d.device: d.budget_bytes for d in placed[0].devices}
        self._place_for = tuple((d, refit_budget(b, before.get(d, b))) for d, b in devices)
        self._device_refit = Refit(why, sum(b for _, b in devices), sum(before.values()))

    def _forget_plans(self) -> None:
        """Drop the plans cached per signature, the shapes sharing them and the failures."""
        self._plans.clear()
        self._joined.clear()
        self._failed.clear()
        self._placed.clear()

    def wait_copies(self) -> None:
        """Block the host until every copy the engine has issued has landed, on every device:
        for a host about to unpin (unregister) host memory those copies may read. A host sync,
        for teardown only."""
        for ex in self.executors:
            ex.transfers.wait_copies()  # hazard: host memory unregistered while a copy reads it

    def keep_buffers(self, keep: bool) -> None:
        """Hold device buffers between forwards (a host that ends runs with a callback)."""
        for ex in self.executors:
            ex.keep_buffers = keep
            if not keep and not ex.running:
                ex.release()

    def hold_weights(self, hold: bool) -> None:
        """With buffers kept between forwards (``keep_buffers``), also keep an all-resident plan's
        weights swapped in between forwards, so a forward runs no hooks and no pointer swaps
        (a session always does). Turned off, the module points at its masters again."""
        for ex in self.executors:
            ex.hold_weights = hold
            if not hold and not ex.running:
                ex.restore_weights()

    def weights_changed(self) -> None:
        """The host wrote into the module's weights in place (hook LoRAs between forwards):
        device copies held between forwards are copied again before the next forward reads them."""
        for ex in self.executors:
            ex.invalidate()

    @property
    def running(self) -> bool:
        """A forward of this engine runs now (its hooks hold the module's weights)."""
        return any(ex.running for ex in self.executors)

    @property
    def device(self) -> torch.device:
        """The home device: inputs arrive and the output returns there."""
        return self.executor.device

    @property
    def held_bytes(self) -> int:
        """Device bytes the engine holds now (weights kept between forwards), all devices."""
        return sum(ex.device_bytes for ex in self.executors)

    @property
    def probe_room_bytes(self) -> int:
        """Device bytes a probe (``bandwidth``: the copy, the matrix product) may take now on the
        home device: its budget less what the engine holds there."""
        budget = dict(self.config.devices).get(self.config.device, self.config.budget_bytes)
        return max(0, budget - self.executor.device_bytes)

    @property
    def held_bytes_by_device(self) -> dict[str, int]:
        """Device bytes the engine holds now, per device."""
        return {str(ex.device): ex.device_bytes for ex in self.executors}

    @property
    def placement(self) -> Placement | None:
        """The placement the last forward ran (None on one device)."""
        got = self._placed.get(self.last_signature) if self.last_signature is not None else None
        return got[0] if got else None

    def run(self, fn: Callable, *args, on_loaded: Callable | None = None, **kwargs):
        """Run ``fn(*args, **kwargs)``, a forward of the module, segmented under the budget.

        ``on_loaded(unit)``, for this forward, is called once a fresh device copy of a unit's
        weights is usable by compute, before any of its modules runs: a host merges weight
        patches (LoRA) into the device copy there."""
        return self.run_as(signature(args, kwargs), fn, *args, on_loaded=on_loaded, **kwargs)

    def run_as(self, sig: tuple, fn: Callable, *args, on_loaded: Callable | None = None, **kwargs):
        """``run`` with the input signature given (for calls whose inputs are not tensors yet,
        such as a text encoder's token lists)."""
        if tracing():  # reached from inside a dry run: its tensors are fakes, nothing to plan
            return fn(*args, **kwargs)
        outers = [ex.on_loaded for ex in self.executors]
        for ex in self.executors:
            ex.on_loaded = on_loaded
        try:
            if self.group is not None:
                return self._run_placed(sig, fn, args, kwargs)
            return self._run_as(sig, fn, args, kwargs)
        finally:
            for ex, outer in zip(self.executors, outers):
                ex.on_loaded = outer

    def _run_as(self, sig: tuple, fn: Callable, args: tuple, kwargs: dict):
        self.revalidate()
        failed = self._failed.get(sig)
        if failed is not None:
            raise failed
        plan = self._plans.get(sig)
        if plan is None:
            try:
                out, stats, meas, source = self._guard(lambda f, a, k: self._first_forward(sig, f, a, k),
                                                       fn, args, kwargs)
                meas = self.measurements[sig] = _grown(self.measurements.get(sig), meas)
                clock = self.executor.take_clock()
                if self.executor.cuda:
                    self.times.measured(sig, clock)
                else:  # the CPU meter's Python at every operator is in that clock: time the next forward
                    self._untimed.add(sig)
                plan = self.planner.measured_plan(meas, source, self.times.seconds(sig))
                why = self._replanned.get(sig)
                if why:  # the node shows why this shape was planned again (the new plan only)
                    plan = dataclasses.replace(plan, warnings=plan.warnings + (f"planned again: {why}",))
                    self._replanned[sig] = ""
            except BudgetError as e:
                self._failed[sig] = e  # the same input will not fit next time either
                raise
            if self.config.verify:
                self.verify_results.append(verify_unpatched(sig, out, fn, args, kwargs))
            self._plans[sig] = plan
            self._record(plan, sig, stats)
            if self.on_plan is not None:
                self.on_plan(self, plan, sig)
            return out
        plan = self._steady(sig, self._retimed(sig, plan))
        timing = sig in self._untimed
        out, stats, _ = self._guard(lambda f, a, k: self.executor.forward(plan, f, *a, clock=timing, **k),
                                    fn, args, kwargs)
        if timing:
            self._untimed.discard(sig)
            self.times.measured(sig, self.executor.take_clock())
            if speed.by_time(self.config):
                self._retime(sig, plan)
        self._record(plan, sig, stats)
        self.steady_stats.add(stats)
        if stats.peak_device_bytes > self.config.budget_bytes and sig not in self._replanned:
            # the host or the input behaved differently from the measured forward (a temporary
            # inside a block grew): measure the next forward again and plan from the larger
            # figures, once (a plan must stay stable)
            why = (f"forward {self.stats.forwards} ({describe_signature(sig)}) peaked at "
                   f"{fmt_bytes(stats.peak_device_bytes)}, above the budget {fmt_bytes(self.config.budget_bytes)}")
            self._replanned[sig] = why
            del self._plans[sig]
            self.traces.pop(sig, None)  # the dry run runs the host's code again too
            log.warning("VRAMCut: %s; the next one measures again and plans once more", why)
        return out

    # -- several devices ---------------------------------------------------------------------

    def _place(self, meas: dict[str, UnitMeasurement], sig: tuple | None = None) -> Placement:
        """The placement of the units on the config's devices from per-unit figures (in the order
        the forward entered them; FLOPs the real forward does not count come from ``sig``'s dry
        run); a ``BudgetError`` when no placement fits."""
        pl = self.planner
        order = [n for n in meas if n in pl.all] + [u.name for u in pl.unitset.units if u.name not in meas]
        # where the config chooses by time: the units' compute times (the dry run's FLOPs over the
        # measured throughput), the placement's time tie-break, and each device's residency by time
        tr = self.traces.get(sig) if sig is not None else None
        counted = {n: m.flops for n, m in ((tr.measurements if tr is not None else None) or {}).items()}
        seconds, source = pl.compute_seconds({n: m if m.flops is not None or n not in counted else
                                              dataclasses.replace(m, flops=counted[n]) for n, m in meas.items()})
        bps = pl.figures.bytes_per_s(self.config) if seconds is not None else None
        units = [pl.plan_unit(pl.all[n], meas, seconds=seconds) for n in order]
        placed = None
        low = self._place_for   # a fallen budget placed a margin below it where that fits (``set_devices``)
        if low is not None and low != self.config.devices:
            try:
                placed = place(units, list(low), pl.options, warnings=pl.unitset.warnings, bytes_per_s=bps)
            except BudgetError:
                pass
        if placed is None:
            placed = place(units, list(self.config.devices), pl.options, warnings=pl.unitset.warnings,
                           bytes_per_s=bps)
        if not bps:
            return placed
        return dataclasses.replace(placed, devices=tuple(
            d if d.plan is None else dataclasses.replace(d, plan=pl.timed(d.plan, source)) for d in placed.devices))

    def _run_placed(self, sig: tuple, fn: Callable, args: tuple, kwargs: dict):
        """``run_as`` on several devices: the first forward of a signature plans from the dry run
        (a budget too small is refused before anything moves), chooses the hop rule on fake
        devices, and runs the placement measuring, within each device's budget (stopped before
        passing one, it plans again from what it saw); later forwards run the placement planned
        from the measured figures. A device over its budget on a later forward sends the
        signature back to measuring, once."""
        self.revalidate()
        failed = self._failed.get(sig)
        if failed is not None:
            raise failed
        placed = self._placed.get(sig)
        replaced = placed is None and sig in self._to_place and sig in self.measurements
        self._to_place.discard(sig)
        if replaced:   # placed again for new budgets (``set_devices``)
            try:
                pl = self._place(self.measurements[sig], sig)
                check = self._hop_rule(pl, fn, args, kwargs)
            except BudgetError as e:
                self._failed[sig] = e
                raise
            placed = self._placed[sig] = (pl, check.rule, check.hops)
        first = placed is None
        if first:
            try:
                out, stats, placed = self._first_placed(sig, fn, args, kwargs)
            except BudgetError as e:
                self._failed[sig] = e
                raise
        else:
            pl, rule, _ = placed
            out, stats, _ = self._guard(lambda f, a, k: self.group.forward(pl, self.planner.unit, rule, f, a, k),
                                        fn, args, kwargs)
            over = [(d, stats[d.device].peak_device_bytes) for d in pl.used
                    if stats[d.device].peak_device_bytes > d.budget_bytes]
            if over and sig not in self._replanned:  # measure again and place once more (see _run_as)
                why = "; ".join(f"{d.device} peaked at {fmt_bytes(p)}, above its budget {fmt_bytes(d.budget_bytes)}"
                                for d, p in over)
                self._replanned[sig] = why
                del self._placed[sig]
                log.warning("VRAMCut: %s; the next forward measures again and places once more", why)
        plan = combined_plan(placed[0], TRACED, self._placed_warnings(sig))
        if self._device_refit is not None:
            plan = dataclasses.replace(plan, refit=self._device_refit)
        self._plans[sig] = plan
        for dev, st in stats.items():
            self.device_stats.setdefault(dev, RunStats()).add(st)
        self.last_device_stats = stats
        one = combined(stats)
        self._record(plan, sig, one)
        if not first:
            self.steady_stats.add(one)
        if self.on_plan is not None and (first or replaced):
            self.on_plan(self, plan, sig)
        return out

    def _retimed(self, sig: tuple, plan: Plan) -> Plan:
        """The plan of ``sig`` made again, once, when its measuring forward's unit times have just
        become readable (CUDA: its events completed; asked without waiting): measured compute
        times replace the dry run's estimate."""
        if not self.times.ready(sig):
            return plan
        return self._retime(sig, plan)

    def _retime(self, sig: tuple, plan: Plan) -> Plan:
        """``plan`` made again from the unit times just measured for ``sig``."""
        if self._plans.get(sig) is not plan or sig not in self.measurements or self.times.seconds(sig) is None:
            return plan
        new = self.planner.measured_plan(self.measurements[sig], plan.source, self.times.seconds(sig))
        again = tuple(w for w in plan.warnings if w.startswith("planned again") and w not in new.warnings)
        new = self._plans[sig] = dataclasses.replace(new, warnings=new.warnings + again, refit=plan.refit)
        if self.on_plan is not None:
            self.on_plan(self, new, sig)
        return new

    def _placed_warnings(self, sig: tuple) -> tuple:
        why = self._replanned.get(sig)
        return (f"planned again: {why}",) if why else ()

    def _first_placed(self, sig: tuple, fn: Callable, args: tuple, kwargs: dict):
        tr = self._trace(sig, fn, args, kwargs)
        if tr.measurements is None:
            raise BudgetError("devices", 0, self.config.budget_bytes, message=(
                f"VRAMCut: a plan across devices needs the dry run, which could not run these inputs "
                f"({tr.reason}); name one device (devices={self.config.device}=GIB, or no devices) to run "
                "on one GPU"))
        meas = {n: dataclasses.replace(m) for n, m in tr.measurements.items()}
        pl = self._place(meas, sig)
        check = self._hop_rule(pl, fn, args, kwargs)
        for _ in range(4):
            try:
                out, stats, got = self._guard(lambda f, a, k: self.group.forward(
                    pl, self.planner.unit, check.rule, f, a, k, measure=True), fn, args, kwargs)
                break
            except OverBudget as e:
                name = self.planner.top(e.unit) if e.unit else None
                if name not in meas:
                    raise
                m = meas[name]
                log.warning("VRAMCut: the first forward on %d devices passed the traced plan in '%s' (%s "
                            "activations); placing again", len(self.config.devices), e.unit,
                            fmt_bytes(e.activation_bytes))
                m.peak_bytes = max(m.peak_bytes, e.activation_bytes) + self.planner.block_bytes
                pl = self._place(meas, sig)
        else:
            raise BudgetError("devices", 0, self.config.budget_bytes, message=(
                "VRAMCut: the first forward across devices passed a device's budget four times; "
                "give the devices more room"))
        meas = self.measurements[sig] = _grown(self.measurements.get(sig), self.planner.aggregate(got))
        if self.config.verify:
            self.verify_results.append(verify_unpatched(sig, out, fn, args, kwargs))
        placed = (self._place(meas, sig), check.rule, check.hops)
        if unit_devices(placed[0], self.planner.unit) != unit_devices(pl, self.planner.unit):
            # the measured figures moved a cut: the hops of the new placement, on fake devices
            check = check_hops(self.module, unit_devices(placed[0], self.planner.unit),
                               torch.device(self.config.device), fn, args, kwargs)
            placed = (placed[0], check.rule or HOME, check.hops)
        self._placed[sig] = placed
        return out, stats, placed

    def _hop_rule(self, pl: Placement, fn: Callable, args: tuple, kwargs: dict):
        """The hop rule of placement ``pl`` from the dry run on fake devices (``check_hops``); a
        ``BudgetError`` naming one device as the way out where no rule runs."""
        check = check_hops(self.module, unit_devices(pl, self.planner.unit), torch.device(self.config.device),
                           fn, args, kwargs)
        if check.rule is None:
            why = (f"the dry run across devices could not run: {check.error}" if check.error else
                   "this model's forward mixes tensors of different devices between its blocks under any "
                   f"hop rule ({'; '.join(f'{r}: {why}' for r, why in check.reasons.items())})")
            raise BudgetError("devices", 0, self.config.budget_bytes, message=(
                f"VRAMCut: {why}; name one device (devices={self.config.device}=GIB, or no devices) to run "
                "on one GPU"))
        return check

    def _steady(self, sig: tuple, plan: Plan) -> Plan:
        """The plan to run ``sig`` with: its own, or, when it alternates with the last shape while
        buffers are held and the two plans lay them out differently, one plan for both (see the
        module docstring)."""
        last, prev = self.last_plan, self.last_signature
        if (not self.executor.cuda or last is None or last is plan or not self.executor.device_bytes
                or self._plans.get(prev) is not last or _buffers(last) == _buffers(plan)):
            return plan
        group = self._joined.get(sig, frozenset((sig,))) | self._joined.get(prev, frozenset((prev,)))
        meas = joint_measurements([self.measurements[s] for s in group if s in self.measurements])
        if meas is None:
            return plan
        try:
            joint = self.planner.measured_plan(meas, plan.source, self.times.seconds(sig))
        except BudgetError:
            return plan
        for s in group:
            self._plans[s], self._joined[s] = joint, group
        if self.on_plan is not None:
            self.on_plan(self, joint, sig)
        return joint

    def _guard(self, run: Callable, fn: Callable, args: tuple, kwargs: dict):
        """``run(fn, args, kwargs)``; a real out-of-memory error inside it comes out naming the
        segment that ran and the bytes the executor held (it has released them by then)."""
        try:
            return run(fn, args, kwargs)
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(_oom_message(self.executor, self.config.budget_bytes, e)) from e

    def reset_stats(self) -> None:
        self.stats = RunStats()
        self.steady_stats = RunStats()

    def _record(self, plan: Plan, sig: tuple, stats: RunStats) -> None:
        self.last_plan, self.last_signature, self.last_stats = plan, sig, stats
        self.stats.add(stats)

    # -- report ----------------------------------------------------------------------------

    def describe(self, plan: Plan | None = None) -> dict:
        plan = plan or self.last_plan or self.weight_plan()
        sig = self.last_signature if plan is self.last_plan else None
        return {
            "family": self.unitset.family,
            "label": self.unitset.label,
            "stage": "measured" if plan.measured else "weights",
            "source": plan.source,
            "trace_reason": (self.traces[sig].reason if sig in self.traces else None) if sig else None,
            "signature": describe_signature(sig) if sig else None,
            "warnings": list(plan.warnings),
            "text": plan_to_text(plan, stats=self.stats if plan.measured else None,
                                 steady=self.steady_stats if plan.measured else None) + "".join(
                f"\nverify {r['signature']}: " + (f"could not run the unpatched forward ({r['error']})" if r["error"]
                                                  else f"max |segmented - unpatched| = {r['max_abs_diff']:g}")
                for r in self.verify_results),
            "plan": self._plan_json(plan, sig),
            "verify": list(self.verify_results),
        }

    def _plan_json(self, plan: Plan, sig: tuple | None) -> dict:
        out = plan_to_json(plan, self.stats if plan.measured else None,
                           self.steady_stats if plan.measured else None)
        placed = self._placed.get(sig) if sig is not None else None
        if placed is not None:
            pl, rule, dry = placed
            ran = self.group.last_hops.summary() if self.group.last_hops is not None else dry
            extra = placement_json(pl, ran, {d: s.peak_device_bytes for d, s in self.device_stats.items()})
            out.update(extra)
            out["hop_rule"] = rule
            out["peak_bytes"] = sum(d["peak_bytes"] for d in extra["devices"])
            out["window_bytes"] = sum(d["window_bytes"] for d in extra["devices"])
        return out


def _stopped_error(base: Plan, e: OverBudget, budget: int, unit_bytes: Callable[[str], int]) -> BudgetError:
    """A measuring forward stopped: what it saw is a lower bound of the budget that works (the
    units after the one it stopped in were never run)."""
    held = base.resident_bytes + (unit_bytes(e.unit) if e.kind == "weights" else base.window_bytes)
    detail = ("this forward runs it and it cannot be cut finer" if e.kind == "weights" else
              "cut as fine as they go; the forward was stopped there")
    return budget_error(e.unit or "?", budget, kind=e.kind, weight_bytes=held,
                        activation_bytes=e.activation_bytes, min_budget_bytes=held + e.activation_bytes,
                        exact=False, detail=detail, bound=STOPPED)


def _oom_message(ex: SegmentedExecutor, budget: int, e: Exception) -> str:
    """A real out-of-memory error, naming the segment that ran and the bytes the executor held
    (it has released them by then)."""
    unit = ex.failed_unit
    where = "before any unit ran" if ex.failed_tracked else "in a resident segment"
    if unit is not None:
        seg = _segment_of(ex.failed_plan, unit) if ex.failed_plan is not None else None
        where = f"in segment '{seg or unit}'"
        if not ex.failed_tracked:  # resident units are not hooked outside measuring
            where += " or a resident segment after it"
    return (f"VRAMCut: out of memory {where}, with {fmt_bytes(ex.failed_device_bytes)} of weights on "
            f"the device under a budget of {fmt_bytes(budget)} (all released; the model is unchanged): {e}")


def _buffers(plan: Plan) -> tuple:
    """What the executor allocates for a plan: resident units, slots and their size."""
    return frozenset(plan.resident_units), plan.slots, plan.slot_bytes


def _grown(old: dict[str, UnitMeasurement] | None, new: dict[str, UnitMeasurement]) -> dict[str, UnitMeasurement]:
    """A re-measured signature keeps the larger figure of each unit (the peak that sent it back)."""
    for n, m in (old or {}).items():
        if n in new:
            new[n] = UnitMeasurement(max(m.entry_bytes, new[n].entry_bytes), max(m.peak_bytes, new[n].peak_bytes),
                                     max(m.calls, new[n].calls), m.modules | new[n].modules)
    return new


def _segment_of(plan: Plan, unit: str) -> str | None:
    for seg in plan.segments:
        if any(plan.units[i].name == unit for i in seg.units):
            return plan.segment_name(seg)
    return None

def verify_unpatched(sig: tuple, out, fn: Callable, args: tuple, kwargs: dict) -> dict:
    """Run ``fn`` unpatched on the same inputs; the largest |difference| from ``out``, logged."""
    res = {"signature": describe_signature(sig), "max_abs_diff": None, "equal": None, "error": None}
    try:
        ref = fn(*args, **kwargs)
        res["max_abs_diff"], res["equal"] = max_abs_diff(out, ref)
    except Exception as e:  # verification must never break the run it checks
        res["error"] = f"{type(e).__name__}: {e}"
    if res["error"]:
        log.warning("VRAMCut verify (%s): the unpatched forward could not run: %s", res["signature"], res["error"])
    else:
        log.warning("VRAMCut verify (%s): max |segmented - unpatched| = %g (%s)", res["signature"],
                    res["max_abs_diff"], "bit-equal" if res["equal"] else "differs")
    return res



__all__ = ["Engine", "EngineConfig", "HostHooks", "BudgetError", "TraceUnavailable"]
