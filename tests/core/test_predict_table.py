"""bench/predict_table.py's tables on small units, against timelines worked out by hand."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import predict_table as pt  # noqa: E402
from vramcut_core import PlanUnit  # noqa: E402
from vramcut_core.planning.plan import PlanOptions  # noqa: E402

GB = 10**9


def units(peak=None):
    # four blocks of 1 GB and 30 ms each: a copy takes 40 ms at 25 GB/s, 20 ms at 50 GB/s
    return [PlanUnit(f"blocks.{i}", GB, peak, peak, compute_s=0.03) for i in range(4)]


def test_time_rows_by_hand():
    rows = pt.time_rows("toy", units(), PlanOptions(), budgets=(4, 2, 1, 0.5))
    assert rows == [
        # 4 GiB: everything resident, 4 x 30 ms
        "| toy | 4 GiB | 0.120 s | " + " | ".join(["0.120 s (1.00×)"] * 4) + " |",
        # 2 GiB: nothing resident, two 1 GB slots. 25 GB/s: the copies (40 ms) run back to back,
        # each slot free in time (a copy two places back ended 80 ms before, its compute 70 ms):
        # 4 x 40 ms. 50 GB/s: each 20 ms copy starts when the unit two places back has run and
        # ends before the unit before it has: 4 x 30 ms. No residency fits beside two slots, and
        # one slot (one resident) waits for every copy: by time is the same plan.
        "| toy | 2 GiB | 0.120 s | 0.160 s (1.33×) | 0.160 s (1.33×) | 0.120 s (1.00×) | 0.120 s (1.00×) |",
        # 1 GiB: one slot, no prefetch: each unit waits for its whole copy. 4 x (40 + 30) ms,
        # 4 x (20 + 30) ms
        "| toy | 1 GiB | 0.120 s | 0.280 s (2.33×) | 0.280 s (2.33×) | 0.200 s (1.67×) | 0.200 s (1.67×) |",
        # 0.5 GiB: not even one 1 GB slot (1 GB = 0.9313 GiB, rounded up at the widget's precision)
        "| toy | 0.5 GiB | 0.120 s | " + " | ".join(["refused (needs 0.932 GiB)"] * 4) + " |",
    ]


def test_placement_rows_by_hand():
    mib = 1 << 20
    rows = pt.placement_rows("toy", units(peak=mib), PlanOptions(), traced=True, sizes=(2,))
    assert rows == [
        # one GPU of 2 GiB: two 1 GB slots and 1 MiB of activations leave no room for a
        # resident block: 4 GB streamed per call = 3.73 GiB
        "| toy | one GPU of 2 GiB | 3.73 GiB | 0 | 0 | traced, units per GPU 4 |",
        # two: two blocks resident on each (2 GB + 1 MiB fit 2 GiB); the 1 MiB entering blocks.2 hops
        "| toy | 2×2 GiB | 0.00 GiB | 1 | 1.0 MiB | traced, units per GPU 2 + 2 |",
    ]
    rows = pt.placement_rows("toy", units(), PlanOptions(), traced=False, sizes=(2,))
    assert rows[1] == "| toy | 2×2 GiB | 0.00 GiB | 1 | not measured | weights only, units per GPU 2 + 2 |"


def test_tier_rows_by_hand():
    # four 1 GB blocks of 30 ms. VRAM 2 GiB: two 1 GB slots, nothing resident, 160 ms on PCIe 4.0
    # (see above). RAM 2 GiB: the 128 MiB bounce buffer, then two 1 GB blocks (0.125 + 2 x 0.931
    # = 1.99 GiB; a third does not fit). The other two (2 GB) are read per call on the one reader:
    # 2 GB / 3.5 GB/s = 0.571 s, 2 GB / 7 GB/s = 0.286 s. The call with reads is the timeline's
    # (read ahead from when a slot frees, beside compute): at least the reader's 0.571 s and
    # 0.286 s, at most those added whole to the 0.160 s call (0.731 s, 0.446 s)
    rows = pt.tier_rows("toy", units(), PlanOptions(), pairs=((2, 2), (2, 0.1), (0.5, 2)))
    assert rows[0] == "| toy | 2 / 2 GiB | 0.00 GiB | 1.86 GiB | 1.86 GiB | 0.160 s | 0.644 s | 0.358 s |"
    cells = [float(c.strip().split()[0]) for c in rows[0].strip("|").split("|")[-2:]]
    assert 0.571 < cells[0] < 0.731 and 0.286 < cells[1] < 0.446, cells
    # RAM below the bounce buffer: refused with the RAM it needs; VRAM below one slot: the VRAM
    assert rows[1].startswith("| toy | 2 / 0.1 GiB | refused (needs 0.125 GiB)")
    assert rows[2].startswith("| toy | 0.5 / 2 GiB | refused (needs 0.932 GiB)")
