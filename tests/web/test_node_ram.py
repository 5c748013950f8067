"""RAM beside VRAM: under max_ram_gb the node draws where each block's host copy is (on the
device, in RAM, on disk), the bounce buffer and the budget line; its answer line says the bytes
read from disk per call and their predicted time, the plan's; the RAM bar's tooltip and the table
(Python's text) name the same sizes; the details say what the load cost (measured); every word is
the node's, nothing is cut at the default width, and a plan without a RAM budget looks as before.
A real VAE decode in ComfyUI (test_browser.py's graph) with max_ram_gb well below its weights.
The page helpers are test_browser.py's and test_node_look.py's.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_browser as tb
from test_node_look import _set_width, _view
from test_node_truth import DEFAULT_WIDTH, DEVELOPER_WORDS, _tips

from vramcut_core.model.tensors import fmt_bytes, fmt_seconds

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

RAM_BUDGET_GB = 0.05     # the SD VAE's weights are about 320 MiB: most of its blocks on disk
RAM_COLOR = "#009e73"    # web/plan/theme.js COLORS.ram
DISK_COLOR = "#d55e00"   # COLORS.disk
BOUNCE_COLOR = "#cc79a7" # COLORS.bounce

# fmtBytes and fmtSeconds (web/plan/format.js) on each number, in the page
FMT_JS = """
const [folder, sizes, seconds, done] = arguments;
import(`/extensions/${folder}/plan/format.js`)
  .then((f) => done([sizes.map((n) => f.fmtBytes(n)), seconds.map((s) => f.fmtSeconds(s))]))
  .catch((e) => done({error: String(e)}));
"""


def _ram_run(browser, s, first_id):
    """The VAE decode graph at max_ram_gb RAM_BUDGET_GB, its details open, queued; until measured."""
    tb._open(browser, s)
    ids = browser.execute_async_script(tb.BUILD_VAE_GRAPH_JS, s.sd_vae, tb.VAE_BUDGET_GB, first_id)
    assert "error" not in ids, ids["error"]
    cut = ids["cut"]
    browser.execute_script("app.graph.getNodeById(arguments[0]).widgets.find((w) => w.name === 'max_ram_gb').value = arguments[1]",
                           cut, RAM_BUDGET_GB)
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutSetDetails(true)", cut)
    assert browser.execute_async_script(tb.QUEUE_JS, [ids["decode"], ids["preview"]], 0) is True
    tb._wait_run(browser, s, cut, "measured")
    time.sleep(0.5)  # drawn
    return cut


def _table(browser, cut) -> str:
    return browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.pre.textContent", cut)


def test_ram_is_drawn_beside_vram_and_the_answer_says_the_disk_reads_per_call(comfy_server, browser):
    s = comfy_server
    cut = _ram_run(browser, s, 5101)
    raw = json.loads(json.dumps(browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.raw", cut)))
    (m,) = raw["models"]
    t = m["tiers"]
    assert t["ram_budget_bytes"] == int(RAM_BUDGET_GB * (1 << 30)) and t["host_bytes"] <= t["ram_budget_bytes"]
    assert t["units"]["disk"] > 0 and t["disk_bytes_per_call"] > 0, t

    # the widget reads to the thousandth, as the node writes the RAM budget ("0.050", not "0.1")
    assert browser.execute_script("return app.graph.getNodeById(arguments[0]).widgets.find("
                                  "(w) => w.name === 'max_ram_gb').options.precision", cut) == 3

    v = _set_width(browser, cut, DEFAULT_WIDTH)
    texts = v["texts"]
    kinds = lambda k: " ".join(x["text"] for x in texts if x["kind"] == k)  # noqa: E731

    # the RAM row: the pack's host bytes against max_ram_gb, the blocks in each tier
    c = t["units"]
    ram_row = kinds("ram")
    gib = lambda b: f"{b / (1 << 30):.3f}"  # noqa: E731
    assert ram_row == (f"RAM {gib(t['host_bytes'])} / {gib(t['ram_budget_bytes'])} GiB: {c['device']} "
                       f"block{'' if c['device'] == 1 else 's'} on the device, {c['ram']} in RAM, {c['disk']} on disk"), ram_row
    px = browser.execute_script(tb.NODE_PIXELS_JS, cut, {"ram": (RAM_COLOR, tb.COLOR_TOLERANCE),
                                                         "disk": (DISK_COLOR, tb.COLOR_TOLERANCE)})
    assert px["disk"] > 100 and (px["ram"] > 100 or not t["ram_bytes"]), px
    assert "RAM" in kinds("legend") and "disk" in kinds("legend"), kinds("legend")

    # the answer line: the bytes read from disk per call (the plan's) and their predicted time
    answer = v["data"]["answers"]
    disk = f"{fmt_bytes(t['disk_bytes_per_call'])} from disk / call"
    assert disk in answer, (disk, answer)
    assert ("predicted)" in answer) == (t["disk_s_per_call"] is not None), answer

    # the RAM bar's tooltip and the table name the same sizes
    tips = _tips(browser, cut)
    (ram_tip,) = [x for x in tips if x.startswith("RAM ")]
    table = _table(browser, cut)
    for size in (fmt_bytes(t["ram_bytes"]), fmt_bytes(t["disk_bytes_per_call"])):
        assert size in ram_tip and size in table, (size, ram_tip, table)
    if t["bounce_bytes"]:
        assert fmt_bytes(t["bounce_bytes"]) in ram_tip and fmt_bytes(t["bounce_bytes"]) in table
    assert disk in table, table  # the answer line heads the table too
    if t["disk_s_per_call"] is not None:  # the reads' predicted time, written alike in both
        when = fmt_seconds(t["disk_s_per_call"])
        assert f"+{when} predicted" in answer and f", {when} predicted at " in table, (when, answer, table)

    # the load: measured once the blocks left RAM, on the node (details), its tooltip and the table
    load = t["load"]  # (the decode ran under the tiers: its blocks left RAM)
    line = kinds("load")
    assert line.startswith("load: ") and line in table, (line, table)
    for key in ("mapped_bytes", "cached_bytes"):  # read from the checkpoint the host mapped, or cached
        if load[key]:
            assert fmt_bytes(load[key]) in line and fmt_bytes(load[key]) in ram_tip, (load, line, ram_tip)
    assert load["mapped_bytes"] or load["cached_bytes"], load
    tb._save("ram_node.png", tb._node_crop(browser, cut, 1.0))

    # the node's words, and nothing cut or outside the node at the default width
    said = [w for w in [x["text"] for x in texts] + tips + [table] if DEVELOPER_WORDS.search(w)]
    assert not said, said
    assert v["fits"] and not [x for x in texts if x["text"].endswith("…")], texts
    assert all(x["x"] >= -0.5 and x["x"] + x["w"] <= v["W"] + 0.5 for x in texts), [x for x in texts if x["x"] + x["w"] > v["W"]]

    # on a GPU (figures as the CUDA path sends them): the bounce buffer drawn, the page-locked part said
    gpu = json.loads(json.dumps(raw))
    g = gpu["models"][0]["tiers"]
    g["bounce_bytes"] = g["load"]["bounce_bytes"] = 4 << 20
    g["host_bytes"] = g["ram_bytes"] + g["bounce_bytes"]
    g["load"]["page_locked_bytes"] = g["ram_bytes"]
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutShow(arguments[1])", cut, gpu)
    time.sleep(0.5)
    px = browser.execute_script(tb.NODE_PIXELS_JS, cut, {"bounce": (BOUNCE_COLOR, tb.COLOR_TOLERANCE)})
    assert px["bounce"] > 20, px
    (gpu_tip,) = [x for x in _tips(browser, cut) if x.startswith("RAM ")]
    assert f"Bounce buffer: {fmt_bytes(4 << 20)}" in gpu_tip, gpu_tip
    assert f"{fmt_bytes(g['ram_bytes'])} of them page-locked (underlined)" in gpu_tip, gpu_tip
    assert "bounce" in " ".join(x["text"] for x in _view(browser, cut)["texts"] if x["kind"] == "legend")

    # without a RAM budget the node is as before: no RAM row, no disk in the answer, no RAM legend
    plain = json.loads(json.dumps(raw))
    plain["models"][0].pop("tiers")
    plain["models"][0]["plan"].pop("tiers")
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutShow(arguments[1])", cut, plain)
    time.sleep(0.5)
    v = _view(browser, cut)
    assert not [x for x in v["texts"] if x["kind"] in ("ram", "load")], v["texts"]
    assert "from disk" not in v["data"]["answers"] and "RAM" not in " ".join(
        x["text"] for x in v["texts"] if x["kind"] == "legend"), v["data"]["answers"]


def test_sizes_read_the_same_on_the_node_and_in_pythons_text(comfy_server, browser):
    """fmtBytes / fmtSeconds (the node) and fmt_bytes / fmt_seconds (Python's table lines) write
    every size and time alike, ties included (toFixed rounds a tie away from zero, Python's
    format to even: 1.25 MiB and 0.125 s read 1.2 MiB and 0.12 s there)."""
    tb._open(browser, comfy_server)
    sizes = [0, 1000, 1024, 1536, 1280, 10 << 20, 99 << 20, 100 << 20, 128 << 20, 5 << 18, 1000 << 20, 1 << 30,
             3 * (1 << 30) // 2, 1.125 * (1 << 30), -(5 << 18)]
    seconds = [0, 0.0004, 0.0005, 0.00125, 0.0095, 0.01, 0.0125, 0.094, 0.095, 0.125, 0.135, 1.5, 9.99, 10, 12.5, 300]
    got = browser.execute_async_script(FMT_JS, comfy_server.pack_folder, sizes, seconds)
    assert got == [[fmt_bytes(n) for n in sizes], [fmt_seconds(s) for s in seconds]], got
