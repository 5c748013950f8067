"""What the node says, where it says it: errors on the node that caused them, words and precision
a user reads, and a preview that answers for every connected model. One test per defect a new
user met (each failed before its fix):

* a plan only on the copy of a template (or of any file) whose run made it, never on a fresh
  copy that shares its workflow id, before or after a reload;
* the Devices node's errors on the Devices node and on the Max VRAM node it feeds (whose earlier
  plan goes), a default list of this machine's devices, a budget alone taken as the main
  device's, and a note on the Max VRAM node that its budget widgets yield to the devices;
* three decimals on the Devices node's reserve, a real run's refusal naming its model, and the
  table's footer in the node's words ("1 call", seconds with a space, no "window 0×0 B");
* a long module path in a banner wrapped whole at the default width, never cut;
* a refused model's table: the refusal, not the plan drawn before the run;
* after a tab switch the first "less" shrinks the node, and a short plan replacing a long
  refusal leaves no empty band;
* below one block's weights, with a preview shape, every model previewed and one number that
  makes all of them fit.

The page helpers are test_browser.py's, test_node_look.py's and test_node_truth.py's.
"""
from __future__ import annotations

import copy
import os
import re
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_browser as tb  # noqa: E402
from test_node_look import CANVAS_STRINGS_JS, _set_width, _vae_run, _view  # noqa: E402
from test_node_truth import DEFAULT_WIDTH, PARTS_PAYLOAD, _gib, _preview  # noqa: E402

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

# A tiny model through a Max VRAM node fed by a Devices node, queued (Max VRAM is an output node).
DEVICES_GRAPH_JS = """
const [model, text, firstId, done] = arguments;
(async () => {
  window.confirm = () => true;
  await app.extensionManager.command.execute("Comfy.ClearWorkflow");
  let nextId = firstId;
  const add = (type, pos) => { const n = LiteGraph.createNode(type); n.id = nextId++; n.pos = pos; app.graph.add(n); return n; };
  const u = add("UNETLoader", [20, 60]); u.widgets.find((w) => w.name === "unet_name").value = model;
  const d = add("VRAMCutDevices", [20, 220]);
  const c = add("%(node)s", [360, 60]);
  c.widgets.find((w) => w.name === "max_vram_gb").value = 0.03;
  u.connect(0, c, c.findInputSlot("model"));
  d.connect(0, c, c.inputs.findIndex((i) => i.name === "devices"));
  const dflt = d.widgets.find((w) => w.name === "devices").value;
  if (text !== null) d.widgets.find((w) => w.name === "devices").value = text;
  app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 40]; app.canvas.setDirty(true, true);
  await app.queuePrompt(0);
  done({cut: c.id, devices: d.id, dflt});
})().catch((e) => done({error: String(e && e.stack || e)}));
""" % {"node": tb.NODE_TYPE}

RERUN_JS = """
const [devicesId, text, done] = arguments;
(async () => {
  app.graph.getNodeById(devicesId).widgets.find((w) => w.name === "devices").value = text;
  await app.queuePrompt(0);
  done(true);
})().catch((e) => done({error: String(e && e.stack || e)}));
"""

DEVICES_MESSAGE_JS = """
const n = app.graph.getNodeById(arguments[0]);
const el = n && n.vramcutDevicesMessage;
if (!el) return null;
const r = el.getBoundingClientRect();
return {message: el.dataset.message ?? "", shown: el.style.display !== "none" && r.height > 0, runs: n.__runs || 0};
"""


def _devices_message(browser, node_id):
    return browser.execute_script(DEVICES_MESSAGE_JS, node_id)


# -------------------------------------------------------- 3: the Devices node's errors on the node

def test_devices_errors_are_said_on_the_devices_node_and_on_the_max_vram_node(comfy_server, browser):
    """A list this host cannot use (cuda:0 on a CPU host) is said on the Devices node and on the
    Max VRAM node, whose plan from the run before goes; the default list is this machine's, a
    budget alone ("free") is the main device's, and the Max VRAM node notes that the devices'
    budgets replace its own widgets."""
    s = comfy_server
    tb._open(browser, s)
    ids = browser.execute_async_script(DEVICES_GRAPH_JS, s.tiny_model, None, 4101)
    assert "error" not in ids, ids["error"]
    assert ids["dflt"] == "cpu=free", ids  # this machine's devices (a CPU host), not two GPUs it lacks
    cut, dev = ids["cut"], ids["devices"]
    tb._wait(browser, "the plan of the default devices", lambda: (
        (d := _view(browser, cut)["data"]).get("hasPlan") == "true" and d.get("models") == "1" and not d.get("message")),
        timeout=tb.PROMPT_TIMEOUT_S)
    v = _view(browser, cut)
    assert v["data"].get("devicesLinked") == "true", v["data"]
    note = " ".join(t["text"] for t in v["texts"] if t["kind"] == "devices-note")
    assert "max_vram_gb only turns VRAMCut off" in note and "budget_mode is not used" in note, v["texts"]

    assert browser.execute_async_script(RERUN_JS, dev, "cuda:0=4") is True
    said = tb._wait(browser, "the message on the Devices node", lambda: (
        (m := _devices_message(browser, dev)) and m["shown"] and m), timeout=tb.PROMPT_TIMEOUT_S)
    assert "cuda:0 is not a device this host can see" in said["message"], said
    d = tb._wait(browser, "the message on the Max VRAM node", lambda: (
        (x := _view(browser, cut)["data"]).get("message") and x), timeout=tb.PROMPT_TIMEOUT_S)
    assert "cuda:0 is not a device this host can see" in d["message"], d
    assert d.get("models") == "0" and d.get("segments") == "0", ("the earlier plan is still shown", d)
    tb._close_error_dialog(browser)

    assert browser.execute_async_script(RERUN_JS, dev, "free") is True  # the README's "a budget may be free"
    tb._wait(browser, "the plan with a budget alone", lambda: (
        (x := _view(browser, cut)["data"]).get("models") == "1" and not x.get("message")), timeout=tb.PROMPT_TIMEOUT_S)
    assert not _devices_message(browser, dev)["shown"]
    tb._save("devices_error_cleared.png", tb._node_crop(browser, cut, 1.0))


# ------------------------------------------------------------------ 5: precision and words

def test_three_decimals_a_refusal_naming_its_model_and_the_tables_words(comfy_server, browser):
    """The Devices node's reserve reads 30.123 (not 30.12); a real decode refused names the VAE,
    not "VRAMCut:"; a measured table's footer says "1 call", seconds with a space, and never a
    window of 0×0 B."""
    s = comfy_server
    tb._open(browser, s)
    browser.execute_script("""
      app.graph.clear();
      const d = LiteGraph.createNode("VRAMCutDevices"); d.pos = [40, 60]; app.graph.add(d);
      d.widgets.find((w) => w.name === "reserve_gb").value = 30.1234;
      app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 40]; app.canvas.setDirty(true, true);""")
    drawn = browser.execute_script(CANVAS_STRINGS_JS)
    assert any("30.123" in t for t in drawn) and not any(t.strip() == "30.12" for t in drawn), drawn

    ids = _vae_run(browser, s, 0.05, 4201, latent=256)  # the weights fit; the decode's activations do not
    st = tb._wait_events(browser, ids["cut"], "execution_error", "execution_success")
    raw = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.raw", ids["cut"])
    assert raw and raw.get("message_level") == "error", (raw, st["log"])
    assert raw["message"].startswith("VAE: ") and "VRAMCut:" not in raw["message"], raw["message"]
    tb._close_error_dialog(browser)

    ids = _vae_run(browser, s, 8.0, 4301)  # all resident: no streaming window
    tb._wait_run(browser, s, ids["cut"], "measured")
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutView.toggleTable(true)", ids["cut"])
    table = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.pre.innerText", ids["cut"])
    assert "call(s)" not in table and "×0 B" not in table and "no streaming window" in table, table
    assert re.search(r"measured: 1 call\b(?!\(s\))", table) and not re.search(r"\d\.\d{3}s\b", table), table


# -------------------------------------------------- 6: below one block, every model still previewed

def test_below_one_blocks_weights_every_model_is_previewed_and_one_number_fits_all(comfy_server, browser):
    """At 0.001 GiB (less than one block of either model) with a preview shape: the MODEL and the
    VAE are both previewed and refused with their own smallest budgets at that shape, the banner
    gives the largest (no "at least" lower bound from the weights), and that number runs clean."""
    s = comfy_server
    _, raw, v = _preview(browser, s, 0.001, first_id=4401)
    entries = {m["kind"]: m for m in raw["models"]}
    assert set(entries) == {"MODEL", "VAE"} and all(m.get("refused") for m in entries.values()), raw
    assert all(m.get("min_budget_exact") for m in entries.values()), raw
    both = _gib(max(m["min_budget_bytes"] for m in entries.values()))
    assert v["data"]["fix"] == f"Set max_vram_gb to {both}.", v["data"]
    _, raw, _ = _preview(browser, s, float(both), first_id=4501)
    assert raw["message_level"] != "error", raw["message"]


# --------------------------------------------------- 1: a plan belongs to the run that made it

# The example's copy on screen pointed at the tiny model, the shape and budget set; queued or not.
EDIT_EXAMPLE_JS = """
const [model, budget, queue, done] = arguments;
(async () => {
  const unet = app.graph.nodes.find((n) => n.type === "UNETLoader");
  const cut = app.graph.nodes.find((n) => n.type === "%(node)s");
  unet.widgets.find((w) => w.name === "unet_name").value = model;
  cut.widgets.find((w) => w.name === "max_vram_gb").value = budget;
  %(shape)s
  if (queue) await app.queuePrompt(0);
  done({id: cut.id, path: app.extensionManager?.workflow?.activeWorkflow?.path ?? null});
})().catch((e) => done({error: String(e && e.stack || e)}));
""" % {"node": tb.NODE_TYPE, "shape": tb.SHAPE_JS}

HAS_PLAN_JS = ("const n = app.graph.getNodeById(arguments[0]);"
               "return n && n.vramcutView ? n.vramcutView.el.dataset.hasPlan : null")


def test_a_fresh_copy_of_a_template_never_shows_the_plan_of_another_copys_run(comfy_server, browser):
    """Open the plan-preview template, run it; open the template again and make the same edits
    without running: the fresh copy (the same workflow id, the same inputs) shows no plan, in
    this page and after a reload."""
    s = comfy_server
    url = tb._template_url(s, tb.RUNNABLE_EXAMPLE)
    tb._open_runnable_example(browser, s)
    ran = browser.execute_async_script(EDIT_EXAMPLE_JS, s.tiny_model, 1.0, True)  # a plan preview: an output kept
    assert "error" not in ran, ran
    tb._wait(browser, "the run's traced plan", lambda: browser.execute_script(
        "return app.graph.getNodeById(arguments[0]).vramcutView.el.dataset.stage", ran["id"]) == "traced",
        timeout=tb.PROMPT_TIMEOUT_S)
    time.sleep(1.0)  # the run has ended

    assert "error" not in browser.execute_async_script(tb.OPEN_EXAMPLE_JS, url)
    fresh = browser.execute_async_script(EDIT_EXAMPLE_JS, s.tiny_model, 1.0, False)
    assert "error" not in fresh, fresh  # (a tab of its own, or the same tab loaded again)
    time.sleep(3.0)  # the history has been asked and answered
    assert browser.execute_script(HAS_PLAN_JS, fresh["id"]) == "false", "a fresh copy shows another copy's run"

    time.sleep(1.5)  # the open workflows are kept in the browser's storage
    tb._open(browser, s, fresh=False)
    tb._wait(browser, "the node after the reload", lambda: browser.execute_script(HAS_PLAN_JS, fresh["id"]) is not None)
    time.sleep(3.0)
    assert browser.execute_script(HAS_PLAN_JS, fresh["id"]) == "false", "after a reload the unrun copy shows the run"


# ------------------------------------------------ 4 and 2: what a long refusal and its table say

NODE_JS = """
app.graph.clear();
const c = LiteGraph.createNode("%(node)s"); c.pos = [40, 60]; app.graph.add(c);
app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 40]; app.canvas.setDirty(true, true);
return c.id;
""" % {"node": tb.NODE_TYPE}

SHOW_JS = "app.graph.getNodeById(arguments[0]).vramcutShow(arguments[1]); app.canvas.setDirty(true, true);"
LONG_UNIT = "clip_l.transformer.text_model.encoder.layers.0.mlp.fc1"


def _refused_payload() -> dict:
    """PARTS_PAYLOAD's plan, then its run refused: the CLIP's unit alone is over the budget."""
    p = copy.deepcopy(PARTS_PAYLOAD)
    m = p["models"][0]
    msg = (f"MODEL: VRAM budget 0.293 GiB is too small: unit '{LONG_UNIT}' needs 0.400 GiB of weights on the "
           "device (cannot be cut finer); max_vram_gb must be at least 0.400")
    m.update(refused=True, message=msg, need_bytes=int(0.4 * (1 << 30)))
    p.update(message=msg, message_level="error", need_bytes=m["need_bytes"])
    return p


def test_a_long_refusal_wraps_whole_and_its_table_shows_the_refusal(comfy_server, browser):
    """At the default width, a banner naming a long module path wraps it at its dots (every row
    within the node, the path whole when the rows are joined), and the table of the refused model
    shows the refusal instead of the segments of the plan drawn before the run."""
    s = comfy_server
    tb._open(browser, s)
    cut = browser.execute_script(NODE_JS)
    browser.execute_script(SHOW_JS, cut, _refused_payload())
    v = _set_width(browser, cut, DEFAULT_WIDTH)
    banner = [t for t in v["texts"] if t["kind"] == "banner"]
    assert banner and all("…" not in t["text"] for t in banner), [t["text"] for t in banner]
    assert LONG_UNIT in "".join(t["text"] for t in banner), [t["text"] for t in banner]
    assert all(t["x"] + t["w"] <= v["W"] + 0.5 for t in banner), [(t["text"], t["x"], t["w"], v["W"]) for t in banner]

    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutView.toggleTable(true)", cut)
    table = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.pre.innerText", cut)
    assert "refused" in table and LONG_UNIT in table, table
    assert "blocks.1.2" not in table and "streamed per call" not in table, ("the plan drawn before the run", table)


# ------------------------------------------- 4: the node follows its content after a reload

CONTENT_JS = """
const v = app.graph.getNodeById(arguments[0]).vramcutView;
return {H: v.el.clientHeight, content: v.contentHeight(v.el.clientWidth), node: app.graph.getNodeById(arguments[0]).size[1],
        details: v.details, state: v.el.dataset.state};
"""


# to a new workflow tab and back, as a user switches tabs: the graph is loaded again
TAB_SWITCH_JS = """
const done = arguments[0];
(async () => {
  const run = (id) => app.extensionManager.command.execute(id);
  await run("Comfy.NewBlankWorkflow");
  await new Promise((r) => setTimeout(r, 300));
  await run("Workspace.PreviousOpenedWorkflow");
  done(true);
})().catch((e) => done({error: String(e && e.stack || e)}));
"""


def _fitted(browser, cut, what):
    """The node as tall as its content (no empty band below it), once the host laid it out."""
    return tb._wait(browser, what, lambda: (
        (x := browser.execute_script(CONTENT_JS, cut))["H"] > 0 and abs(x["H"] - x["content"]) <= 1 and x), timeout=10)


def test_after_a_reload_less_shrinks_the_node_and_a_short_plan_replaces_a_long_refusal(comfy_server, browser):
    """The workflow loaded again after switching to another workflow tab and back, with its
    details open: the first "less" shrinks the node to the shorter content; then a long refusal,
    replaced by the short plan of the next run, leaves no empty band below that plan."""
    from selenium.webdriver.common.by import By

    s = comfy_server
    ids = _vae_run(browser, s, tb.VAE_BUDGET_GB, 5401, details=True)
    cut = ids["cut"]
    tb._wait_run(browser, s, cut, "measured")
    raw = browser.execute_script("return app.graph.getNodeById(arguments[0]).vramcutView.raw", cut)
    opened = _fitted(browser, cut, "the details fitted")
    browser.execute_async_script(TAB_SWITCH_JS)
    tb._wait(browser, "the plan shown again with its details", lambda: browser.execute_script(
        "const n = app.graph.getNodeById(arguments[0]); return !!(n && n.vramcutView && n.vramcutView.payload"
        " && n.vramcutView.details && n.vramcutView.el.clientHeight > 0)", cut))
    time.sleep(0.5)
    assert abs(browser.execute_script(CONTENT_JS, cut)["node"] - opened["node"]) <= 1, "the reload resized the node"
    browser.find_element(By.CSS_SELECTOR, ".vramcut-plan-details").click()  # "less"
    less = _fitted(browser, cut, "the node shrunk to the plan without its details")
    assert not less["details"] and less["node"] < opened["node"] - 40, (opened, less)

    long = _refused_payload()
    long["models"][0]["message"] = long["message"] = " ".join([long["message"]] * 4)
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutShow(arguments[1])", cut, long)
    tall = _fitted(browser, cut, "the long refusal shown whole")
    assert tall["state"] == "refused" and tall["node"] > less["node"], (less, tall)
    browser.execute_script("app.graph.getNodeById(arguments[0]).vramcutShow(arguments[1])", cut, raw)
    short = _fitted(browser, cut, "the short plan with no empty band below it")
    assert short["state"] == "plan" and abs(short["node"] - less["node"]) <= 2, (less, tall, short)
