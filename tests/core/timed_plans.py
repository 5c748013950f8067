"""Plans of hand-picked and random shapes run by the executor on the simulated accelerator with
durations, against the timeline's prediction of the same plan (``timeline.predict``).

A stack of MLP blocks (``Block``: hidden width and passes chosen per block) is cut into units;
a plan is made from a residency given as a string over the units in execution order ("S R S S":
streamed, resident) with one or two slots of the largest streamed unit's size, and run by a
``SegmentedExecutor`` directly. Each unit's compute time is its FLOPs (torch's count, as the
simulator charges them) over the simulated throughput, so the prediction and the simulator see
the same figures; what is compared is the schedule.

With ``disk`` (a read rate) every unit is on the disk tier (``tiers.choose`` under a RAM budget of
the bounce buffer alone): each call reads the streamed units from the model's cache file through
the page-locked bounce buffer on the reader thread, the resident ones once a session, and the
simulator times the reads on its one reader lane (``set_durations(disk_bytes_per_s=...)``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from sim_cuda import flop_seconds
from toys import seeded
from vramcut_core import SegmentedExecutor, find_units
from vramcut_core.planning.plan import PlanOptions, PlanUnit, plan_from_residency  # noqa: F401  (the tests use them)
from vramcut_core.runtime.layout import layout_of

D, N = 32, 16      # width, tokens
FLOPS = 1e9        # the simulated device's throughput (FLOP/s)


class Block(nn.Module):
    """An MLP of hidden width ``h`` run ``r`` times: weight 2·D·h floats, 4·N·D·h·r FLOPs."""

    def __init__(self, h: int, r: int = 1) -> None:
        super().__init__()
        self.fc1, self.fc2, self.r = nn.Linear(D, h), nn.Linear(h, D), r

    def forward(self, x):
        for _ in range(self.r):
            x = x + 0.1 * self.fc2(torch.tanh(self.fc1(x)))
        return x


class Stack(nn.Module):
    """The blocks in order; ``loop`` (lo, hi, k): blocks lo .. hi - 1 run k times over, one pass
    after another (a video VAE's decoder, frame by frame), each block entered k times."""

    def __init__(self, blocks, loop: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.loop = loop

    def forward(self, x):
        lo, hi, k = self.loop or (len(self.blocks), len(self.blocks), 0)
        for b in self.blocks[:lo]:
            x = b(x)
        for _ in range(k):
            for b in self.blocks[lo:hi]:
                x = b(x)
        for b in self.blocks[hi if self.loop else lo:]:
            x = b(x)
        return x


@dataclasses.dataclass
class Case:
    model: nn.Module
    x: torch.Tensor
    ref: torch.Tensor
    units: list            # PlanUnit, compute times filled
    lookup: object         # name -> Unit


def build(sim, blocks, loop: tuple[int, int, int] | None = None) -> Case:
    """The stack in host memory, its input, its plain output and its plan units (each with its
    compute seconds at ``FLOPS``, all passes; a looped block's ``calls`` its passes)."""
    with sim.host_memory(), torch.no_grad():
        model = seeded(Stack(blocks, loop))
        x = torch.randn(1, N, D, generator=torch.Generator().manual_seed(1))
        ref = model(x)
    us = find_units(model)
    by_name = {u.name: u for u in us.units}
    pus = []
    h = x
    lo, hi, k = loop or (0, 0, 1)
    for i, u in enumerate(us.units):
        mod = model.get_submodule(u.name)
        with FlopCounterMode(display=False) as fc, sim.host_memory(), torch.no_grad():
            h = mod(h)   # (a block's FLOPs do not depend on its input's values)
        calls = k if lo <= i < hi else 1
        pus.append(PlanUnit(u.name, layout_of(u).nbytes, calls=calls,
                            compute_s=calls * fc.get_total_flops() / FLOPS))
    return Case(model, x, ref, pus, by_name.__getitem__)


def plan_of(case: Case, shape: str, slots: int):
    """The plan with the residency ``shape`` ("S R S": one letter per unit) and ``slots`` slots
    of the largest streamed unit's size, every unit its own segment."""
    flags = shape.split()
    assert len(flags) == len(case.units), (shape, len(case.units))
    resident = {i for i, f in enumerate(flags) if f == "R"}
    size = max((u.weight_bytes for i, u in enumerate(case.units) if i not in resident), default=0)
    budget = sum(case.units[i].weight_bytes for i in resident) + slots * size
    return plan_from_residency(case.units, budget, PlanOptions(), resident, slots if size else 0, size)


def on_disk(case: Case, plan):
    """``plan`` with every unit on the disk tier (the smallest RAM budget: the bounce buffer), and
    the bytes a read of each moves (``timeline.predict``'s ``reads``)."""
    from vramcut_core.planning.tiers import HostUnit, bounce_for, choose
    from vramcut_core.runtime import host_memory

    host = {}
    for u in plan.units:
        lay = layout_of(case.lookup(u.name))
        read = sum(n for _, _, n in lay.flat) + sum(n for sp in lay.quant.values() for _, n in sp)
        host[u.name] = HostUnit(lay.nbytes, read, fileable=not lay.other and lay.nbytes > 0)
    bounce = bounce_for(host, host_memory.BOUNCE_PIECE, host_memory.BOUNCE_PIECES)
    tiers = choose(plan, host, bounce, bounce)
    assert not tiers.in_ram, tiers.in_ram
    reads = on_disk.last = {n: host[n].read_bytes for n in host}
    return dataclasses.replace(plan, tiers=tiers), reads


def run_calls(sim, case: Case, plan, calls: int = 4, session: bool = True, bps: float = 2e7,
              latency_s: float = 0.0, call_host_s: float = 0.0, disk: float | None = None) -> list[float]:
    """Simulated seconds of each of ``calls`` forwards of ``plan`` (from one forward's end on the
    compute stream to the next one's), outputs checked bit-equal. ``call_host_s``: the host's own
    work of each executor call; ``disk``: the read rate of the disk tier (``plan.tiers``)."""
    sim.set_durations(copy_bytes_per_s=bps, op_seconds=flop_seconds(FLOPS), copy_latency_s=latency_s,
                      call_host_s=call_host_s, disk_bytes_per_s=disk)
    ex = SegmentedExecutor(case.lookup, "cuda", module=case.model)
    out = []
    t = max(sim.compute.t, sim.host_t)
    with torch.no_grad():
        ctx = ex.session() if session else _null()
        with ctx:
            for _ in range(calls):
                y, _stats, _ = ex.forward(plan, case.model, case.x)
                assert torch.equal(y, case.ref)
                end = max(sim.compute.t, sim.host_t)
                out.append(end - t)
                t = end
    ex.release()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def random_errors(sim, rng, disk: bool = False) -> tuple[float, float | None, tuple]:
    """One random plan (4 to 8 blocks of random widths and passes, each streamed or resident, one
    or two slots, one of three link speeds, in a session or not; one plan in three loops over a
    run of its blocks, 2 to 4 times; ``disk``: every unit on the disk tier, at one of three read
    rates, and no loop) run and predicted: (|error| of the steady call, |error| of a session's
    first call or None outside one, what was drawn)."""
    from vramcut_core.planning import timeline

    n = rng.randint(4, 8)
    blocks = [Block(rng.choice([64, 128, 256, 512]), rng.choice([1, 1, 2, 6])) for _ in range(n)]
    flags = [rng.choice("SR") for _ in range(n)]
    loop = None
    if not disk and rng.random() < 1 / 3:
        lo = rng.randrange(n - 1)
        loop = (lo, rng.randint(lo + 1, n), rng.randint(2, 4))
        flags[rng.randrange(*loop[:2])] = "S"   # a streamed group entered on every pass
    else:
        flags[rng.randrange(n)] = "S"
    shape, slots, session = " ".join(flags), rng.choice([1, 2]), rng.random() < 0.75
    bps = rng.choice([5e6, 2e7, 1e8])
    rate = rng.choice([2e6, 1e7, 5e7]) if disk else None
    case = build(sim, blocks, loop)
    plan, reads = plan_of(case, shape, slots), None
    if disk:
        plan, reads = on_disk(case, plan)
    times = run_calls(sim, case, plan, calls=3, session=session, bps=bps, disk=rate)
    tl = timeline.predict(plan, bps, session=session, reads=reads, disk_bytes_per_s=rate)
    first = abs(tl.first_s / times[0] - 1) if session else None
    return abs(tl.step_s / times[-1] - 1), first, (shape, slots, session, bps, loop, rate, times, tl)
