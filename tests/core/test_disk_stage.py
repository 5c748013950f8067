"""The disk read stage (issue 40): a disk-tier group's read is a stage before its copy, issued
when its slot frees and run on the reader thread beside the compute of the groups before it; the
group's entry waits for it. Shown by order, not by time: each read waits until a unit computes
after it was issued, which a host that waited for the read before computing would never do."""
from __future__ import annotations

import threading

import torch

from test_tiers import _cache_dir, cpu_engine, reference  # noqa: F401 (the cache dir fixture)
from test_file_backed import mapped
from test_executor import ids
from toys import TransformerStack
from vramcut_core.runtime import disk


def test_cpu_a_disk_group_is_read_while_the_groups_before_it_compute(tmp_path, monkeypatch):
    model = mapped(lambda: TransformerStack(d=64), tmp_path)
    ref = reference()
    eng = cpu_engine(model, 40_000)
    computed = [0]  # compute ends seen (forward hooks on every leaf module, the host thread)
    for m in model.modules():
        if not list(m.children()):
            m.register_forward_hook(lambda *_a: computed.__setitem__(0, computed[0] + 1))
    log: list[tuple[str, bool]] = []
    real = disk.read_into

    def gated(dest, reads):
        # the read finishes only once a unit's compute has ended after it began (or 2 s passed:
        # a host blocked on this read computes nothing meanwhile)
        seen, lock = computed[0], threading.Event()
        overlapped = False
        for _ in range(400):
            if computed[0] > seen:
                overlapped = True
                break
            lock.wait(0.005)
        log.append((threading.current_thread().name, overlapped))
        return real(dest, reads)

    with torch.no_grad(), eng.session():
        for _ in range(2):  # the plan is made and measured; the session's slots are kept
            assert torch.equal(eng.run(model, ids()), ref)
        plan = eng.last_plan
        disk_groups = [g for g in plan.streamed_groups if any(n in plan.tiers.disk_units for n in g)]
        assert plan.slots == 2 and len(disk_groups) >= 3
        monkeypatch.setattr(disk, "read_into", gated)
        outs = [eng.run(model, ids()) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs), "exact output"
    assert eng.last_stats.disk_bytes_read == plan.tiers.disk_bytes_per_call, "the bytes read are the plan's"
    assert log and all(name.startswith("vramcut-disk") for name, _ in log), "on the reader thread"
    # every read of a steady call overlaps compute: its group's read was issued before the units
    # ahead of it were done (the next call's first group: read while the next call's first units
    # run); the last read is for a call that never comes (nothing computes after it)
    assert [ok for _, ok in log] == [True] * (len(log) - 1) + [False], log
