"""The node across devices and with time, in the browser: a plan carrying the plan JSON's
"devices", "hops" and the node's "time" / "refit" (the shapes the engine and the node agree on) is
drawn with one row per device (its peak against its budget, its bar), the hops, the answer line
(fits, peak per device, bytes streamed per call, hops per call), the predicted and then measured
time line and the re-plan notice, every text whole at the node's default width; a plan without
those keys is drawn as before. The Devices node's output connects to the Max VRAM node's devices
input.

The page helpers are test_browser.py's and test_node_look.py's; this module starts its own server
and its own browser (the server is the session's, its prompt cache dropped for each module: conftest.py).
"""
from __future__ import annotations

import copy
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_browser as tb  # noqa: E402
import test_node_look as look  # noqa: E402

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

GIB = 1 << 30
MIB = 1 << 20

# A Max VRAM node and a Devices node, linked as a user links them, at the default width.
BUILD_JS = """
const [nodeType, done] = arguments;
(async () => {
  window.confirm = () => true;
  await app.extensionManager.command.execute("Comfy.ClearWorkflow");
  const c = LiteGraph.createNode(nodeType); c.pos = [360, 60]; app.graph.add(c);
  const d = LiteGraph.createNode("VRAMCutDevices"); d.pos = [20, 60]; app.graph.add(d);
  const slot = c.inputs.findIndex((i) => i.name === "devices");
  d.connect(0, c, slot);
  app.canvas.ds.scale = 1;
  app.canvas.ds.offset = [0, 40];
  app.canvas.setDirty(true, true);
  done({id: c.id, slot, linked: c.inputs[slot] && c.inputs[slot].link != null, type: c.inputs[slot] && c.inputs[slot].type,
        last: c.inputs.filter((i) => !i.widget).pop().name,
        widgets: d.widgets.filter((w) => w.serialize !== false).map((w) => [w.name, w.value])});
})().catch((e) => done({error: String(e && e.stack || e)}));
"""

SHOW_JS = "app.graph.getNodeById(arguments[0]).vramcutShow(arguments[1]); app.canvas.setDirty(true, true);"


def _segment(name, resident, weight=GIB):
    return {"name": name, "units": [name], "weight_bytes": weight, "activation_bytes": 64 * MIB,
            "peak_bytes": weight + 64 * MIB, "resident": resident, "idle": False}


def _payload() -> dict:
    """Two devices (cuda:1 over its budget), one hop, a predicted time and no re-plan."""
    segs = [_segment("double_blocks.0 … double_blocks.8", True, 7 * GIB), _segment("double_blocks.9", False),
            _segment("double_blocks.10 … single_blocks.37", True, 5 * GIB)]
    plan = {
        "budget_bytes": 16 * GIB, "peak_bytes": 15 * GIB, "streamed_bytes_per_forward": 2 * GIB,
        "transfers_per_forward": 2, "resident_bytes": 12 * GIB, "window_bytes": GIB, "slots": 2,
        "activation_reserve_bytes": GIB, "measured": False, "source": "traced", "split": [], "warnings": [],
        "units": [{"name": s["name"], "weight_bytes": s["weight_bytes"]} for s in segs], "segments": segs,
        "devices": [
            {"device": "cuda:0", "budget_bytes": 10 * GIB, "peak_bytes": 9 * GIB, "resident_bytes": 7 * GIB,
             "window_bytes": GIB, "activation_bytes": GIB, "streamed_bytes_per_call": 2 * GIB, "copies_per_call": 2,
             "measured_peak_bytes": None, "segments": segs[:2]},
            {"device": "cuda:1", "budget_bytes": 6 * GIB, "peak_bytes": int(6.5 * GIB), "resident_bytes": 5 * GIB,
             "window_bytes": 0, "activation_bytes": GIB, "streamed_bytes_per_call": 0, "copies_per_call": 0,
             "measured_peak_bytes": None, "segments": segs[2:]}],
        "hops": [{"src": "cuda:0", "dst": "cuda:1", "unit": "double_blocks.10", "bytes": 3 * MIB}],
        "hop_bytes_per_call": 3 * MIB, "hops_per_call": 1,
        "cost": {"fits": False, "peak_is_lower_bound": False, "blocks": 3, "blocks_streamed": 1,
                 "streamed_bytes_per_forward": 2 * GIB, "transfers_per_forward": 2, "bandwidth_bytes_per_s": 2.5e10,
                 "bandwidth_device": "cuda:0", "bandwidth_source": "measured", "estimate_s_per_forward": 0.086,
                 "added_s_per_forward": 0.086, "added_source": "estimate", "measured_forwards": 0,
                 "devices": 2, "hops_per_call": 1, "hop_bytes_per_call": 3 * MIB},
    }
    model = {"kind": "MODEL", "label": "MODEL · Flux", "stage": "traced", "traced_at": "1024×1024, batch 1",
             "signature": None, "warnings": [], "text": "", "plan": plan,
             "time": {"predicted_s": 1.2, "resident_s": 1.0, "added_s": 0.2, "ratio": 1.2, "source": "flops",
                      "measured_s": None, "error": None}}
    return {"budget_bytes": 16 * GIB, "enabled": True, "message": None, "message_level": None,
            "devices": [{"device": "cuda:0", "budget_bytes": 10 * GIB}, {"device": "cuda:1", "budget_bytes": None}],
            "models": [model]}


def _shown(browser, node_id, payload, what, ready):
    browser.execute_script(SHOW_JS, node_id, payload)
    look._set_width(browser, node_id, look.DEFAULT_WIDTH)
    return tb._wait(browser, what, lambda: (v := look._view(browser, node_id))["texts"] and ready(v) and v)


def _whole(v):
    for t in v["texts"]:
        assert t["x"] >= -0.5 and t["x"] + t["w"] <= v["W"] + 0.5, ("text outside the node", t, v["W"])
        assert not t["text"].endswith("…"), ("text cut", t)


def _kind(v, kind) -> list[str]:
    return [t["text"] for t in v["texts"] if t["kind"] == kind]


def test_devices_node_links_to_the_max_vram_nodes_last_input(comfy_server, browser):
    s = comfy_server
    tb._open(browser, s)
    r = browser.execute_async_script(BUILD_JS, tb.NODE_TYPE)
    assert "error" not in r, r
    assert r["linked"] and r["type"] == "VRAMCUT_DEVICES" and r["last"] == "devices", r
    assert r["widgets"] == [["devices", "cpu=free"], ["reserve_gb", 1.0]], r  # this host's devices (a CPU host)


def test_one_row_per_device_the_hops_and_the_time_line_at_the_default_width(comfy_server, browser):
    """Before a call: a row per device (cuda:1 over its budget: the verdict says so), the hop,
    the answer line across devices and the predicted time; after one: the measured time with the
    prediction's error and the re-plan; every text whole and inside the node at its default
    width, each device's bar drawn in the plan's colours."""
    s = comfy_server
    tb._open(browser, s)
    r = browser.execute_async_script(BUILD_JS, tb.NODE_TYPE)
    assert "error" not in r, r
    node = r["id"]
    payload = _payload()
    v = _shown(browser, node, payload, "the rows per device", lambda v: len(_kind(v, "device")) >= 2)
    tb._save("devices_360.png", tb._node_crop(browser, node, 1.0))
    _whole(v)
    rows = " ".join(_kind(v, "device"))
    assert "cuda:0 · 9.000 / 10.000 GiB · 2.00 GiB streamed per call" in rows, rows
    assert "cuda:1 · 6.500 / 6.000 GiB · nothing streamed" in rows, rows
    answer = " ".join(_kind(v, "answer"))
    assert answer.startswith("over budget") and "peak cuda:0 9.000/10.000 GiB, cuda:1 6.500/6.000 GiB" in answer, answer
    assert "2.00 GiB streamed per call" in answer and "1 hop per call" in answer, answer
    assert "/ step" not in answer, "the time is the time line's, once"
    assert _kind(v, "hops") == ["hop: cuda:0 → cuda:1 before double_blocks.10, 3.0 MiB"], v["texts"]
    assert _kind(v, "time") == ["predicted +0.20 s / call (1.20× resident)"], v["texts"]
    assert _kind(v, "refit") == []
    assert _kind(v, "budget") == ["cuda:0 10.000 GiB · cuda:1 free"], v["texts"]
    # each device's bar: resident blue below its row's text, the over-budget row's text in red
    device_texts = [t for t in v["texts"] if t["kind"] == "device"]
    assert device_texts[-1]["color"].lower() == "#ef4444" and device_texts[0]["color"].lower() != "#ef4444"
    for t in device_texts:
        box = [0, t["y"] + t["h"], v["W"], 24]
        (px,) = browser.execute_script(look.PIXELS_JS, node, [box], True)
        want = look._hex(tb.RESIDENT_COLOR)
        n = sum(1 for i in range(0, len(px["px"]), 4) if px["px"][i + 3] > 200
                and all(abs(px["px"][i + j] - want[j]) <= tb.COLOR_TOLERANCE for j in range(3)))
        assert n > 100, (t["text"], n)

    after = copy.deepcopy(payload)
    m = after["models"][0]
    m["stage"] = "measured"
    m["time"].update(measured_s=1.35, error=(1.2 - 1.35) / 1.35, source="measured")
    m["refit"] = {"reason": "free VRAM on cuda:0 fell from 8.00 to 5.00 GiB", "budget_bytes": 5 * GIB,
                  "previous_budget_bytes": 8 * GIB}
    v = _shown(browser, node, after, "the measured time", lambda v: any("measured" in t for t in _kind(v, "time")))
    tb._save("devices_measured_360.png", tb._node_crop(browser, node, 1.0))
    _whole(v)
    assert _kind(v, "time") == ["measured 1.35 s / call · predicted 1.20 s (−11 %)"], v["texts"]
    assert _kind(v, "refit") == ["re-planned: free VRAM fell to 5.000 GiB (was 8.000)"], v["texts"]

    # narrower: still whole (rows wrap), nothing under the buttons
    for width in look.NARROW_WIDTHS[:1]:
        v = look._set_width(browser, node, width)
        for t in v["texts"]:
            if t["kind"] in ("device", "hops", "time", "refit", "answer"):
                assert not t["text"].endswith("…") and t["x"] + t["w"] <= v["W"] + 0.5, (width, t)


def test_a_plan_without_devices_or_time_is_drawn_as_before(comfy_server, browser):
    s = comfy_server
    tb._open(browser, s)
    r = browser.execute_async_script(BUILD_JS, tb.NODE_TYPE)
    assert "error" not in r, r
    plain = _payload()
    del plain["devices"]
    m = plain["models"][0]
    del m["time"]
    for k in ("devices", "hops", "hop_bytes_per_call", "hops_per_call"):
        del m["plan"][k]
    for k in ("devices", "hops_per_call", "hop_bytes_per_call"):
        del m["plan"]["cost"][k]
    m["plan"]["cost"]["fits"] = True
    v = _shown(browser, r["id"], plain, "the plan", lambda v: _kind(v, "answer"))
    assert not any(t["kind"] in ("device", "hops", "time", "refit") for t in v["texts"]), v["texts"]
    answer = " ".join(_kind(v, "answer"))
    assert answer.startswith("fits") and "blocks streamed" in answer and "/ call (estimate)" in answer, answer
    assert _kind(v, "budget") == ["16.000 GiB per model"], v["texts"]
