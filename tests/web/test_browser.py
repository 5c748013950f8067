"""End to end: the real pack in a real ComfyUI server, the plan drawn by web/vramcut.js in
headless Chromium.

1. The server answers an API prompt ``UNETLoader -> VRAMCutMaxVRAM`` with the node's ``ui``
   output holding a plan (the data contract the frontend draws).
2. The example workflows are valid UI-format workflows and the server lists and serves them as
   this pack's templates.
3. In the browser: load ``example_workflows/vramcut_plan_preview.json`` (fetched from the
   template route), point it at the tiny model, queue it, and check the plan is drawn: the
   widget's data attributes (DOM) and its pixels (resident and streamed colours on screen).
   A screenshot is saved under tests/web/artifacts/ (or $VRAMCUT_WEB_ARTIFACTS).
4. The drawing survives a reload of the saved workflow (no re-run), and a live
   ``vramcut.plan`` event (as sent during sampling, here for a subgraph path id) updates it.

Install for CI: ``apt-get install -y chromium chromium-driver`` and ``pip install selenium``.
"""
from __future__ import annotations

import io
import json
import os
import time

import pytest

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "example_workflows")
ARTIFACTS = os.environ.get("VRAMCUT_WEB_ARTIFACTS", os.path.join(HERE, "artifacts"))
NODE_TYPE = "VRAMCutMaxVRAM"
RUNNABLE_EXAMPLE = "vramcut_plan_preview"
WIDGETS = ["max_vram_gb", "budget_mode", "reserve_gb", "prefetch", "residency"]

PROMPT_TIMEOUT_S = 120
UI_TIMEOUT_S = 60
COLOR_TOLERANCE = 10


def _api_prompt(model: str, budget_gb: float) -> dict:
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": model, "weight_dtype": "default"}},
        "2": {"class_type": NODE_TYPE, "inputs": {
            "max_vram_gb": budget_gb, "budget_mode": "fixed", "reserve_gb": 1.0, "prefetch": True,
            "residency": True, "model": ["1", 0]}},
    }


def _wait_history(server, prompt_id: str) -> dict:
    deadline = time.monotonic() + PROMPT_TIMEOUT_S
    while time.monotonic() < deadline:
        h = server.get(f"/history/{prompt_id}")
        entry = h.get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None:
            return entry
        time.sleep(0.25)
    pytest.fail(f"prompt {prompt_id} did not finish in {PROMPT_TIMEOUT_S}s:\n{server.log_tail()}")


def test_prompt_returns_plan(comfy_server):
    s = comfy_server
    r = s.post("/prompt", {"prompt": _api_prompt(s.tiny_model, s.tiny_budget_gb), "client_id": "vramcut-test"})
    assert not r.get("node_errors"), r
    entry = _wait_history(comfy_server, r["prompt_id"])
    assert entry["status"]["status_str"] == "success", (entry["status"], comfy_server.log_tail())

    payloads = entry["outputs"]["2"]["vramcut"]
    assert isinstance(payloads, list) and len(payloads) == 1
    payload = payloads[0]
    assert payload["enabled"] is True and payload["message"] is None
    assert payload["budget_bytes"] == int(s.tiny_budget_gb * 1024**3)
    (model,) = payload["models"]
    assert model["kind"] == "MODEL" and model["stage"] in ("weights", "measured")
    assert isinstance(model["text"], str) and model["text"]
    plan = model["plan"]
    for key in ("budget_bytes", "peak_bytes", "streamed_bytes_per_forward", "resident_bytes",
                "window_bytes", "activation_reserve_bytes", "measured", "units", "segments"):
        assert key in plan, key
    segs = plan["segments"]
    assert any(s["resident"] for s in segs) and any(not s["resident"] for s in segs), model["text"]
    assert plan["peak_bytes"] <= plan["budget_bytes"]
    assert sum(len(s["units"]) for s in segs) == len(plan["units"])


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(EXAMPLES) if f.endswith(".json")))
def test_example_workflow_is_a_template(comfy_server, name):
    with open(os.path.join(EXAMPLES, name + ".json"), encoding="utf-8") as f:
        wf = json.load(f)
    # UI format as the frontend saves it: nodes with widgets_values, links as arrays
    assert {"nodes", "links", "last_node_id", "last_link_id", "version"} <= set(wf)
    nodes = [n for n in wf["nodes"] if n["type"] == NODE_TYPE]
    assert nodes, "the example has no Max VRAM node"
    info = comfy_server.get(f"/object_info/{NODE_TYPE}")[NODE_TYPE]
    assert info["input_order"]["required"] == WIDGETS  # the widget order the examples were saved with
    for n in nodes:
        assert len(n["widgets_values"]) == len(WIDGETS)
        assert n["widgets_values"][1] in info["input"]["required"]["budget_mode"][0]
        assert "vramcut_plan" not in n.get("properties", {}), "an example must not carry a stale plan"
    ids = {n["id"] for n in wf["nodes"]}
    for link in wf["links"]:
        assert link[1] in ids and link[3] in ids

    listed = comfy_server.get("/workflow_templates")
    assert name in listed.get(comfy_server.pack_folder, []), listed
    served = comfy_server.get(f"/api/workflow_templates/{comfy_server.pack_folder}/{name}.json")
    assert served == wf


# ------------------------------------------------------------------------------------ browser

READY_JS = """
const [nodeType, timeoutMs, done] = arguments;
const t0 = Date.now();
(function poll() {
  const ok = window.app && window.app.graph && window.LiteGraph &&
    LiteGraph.registered_node_types[nodeType] &&
    (window.app.extensions || []).some((e) => e.name === "vramcut.MaxVRAM");
  if (ok) return done(true);
  if (Date.now() - t0 > timeoutMs) return done(false);
  setTimeout(poll, 200);
})();
"""

# Load the example from the template route, point it at the tiny model, queue it.
RUN_EXAMPLE_JS = """
const [url, model, budget, done] = arguments;
(async () => {
  const wf = await (await fetch(url)).json();
  await app.loadGraphData(wf);
  const unet = app.graph.nodes.find((n) => n.type === "UNETLoader");
  const cut = app.graph.nodes.find((n) => n.type === "%(node)s");
  unet.widgets.find((w) => w.name === "unet_name").value = model;
  cut.widgets.find((w) => w.name === "max_vram_gb").value = budget;
  app.canvas.ds.scale = 1;
  app.canvas.ds.offset = [20, 50];  // the whole example in view, below the tab bar
  app.canvas.setDirty(true, true);
  await app.queuePrompt(0);
  done({id: cut.id});
})().catch((e) => done({error: String(e && e.stack || e)}));
""" % {"node": NODE_TYPE}

PLAN_STATE_JS = """
const el = document.querySelector(".vramcut-plan");
if (!el) return null;
const node = app.graph.nodes.find((n) => n.type === "%(node)s");
return {data: {...el.dataset}, width: el.clientWidth, height: el.clientHeight,
        size: node ? [node.size[0], node.size[1]] : null,
        min: node ? node.computeSize() : null,
        stored: !!(node && node.properties && node.properties.vramcut_plan)};
""" % {"node": NODE_TYPE}

# Count canvas pixels close to the resident / streamed colours (the drawing itself, read back).
CANVAS_PIXELS_JS = """
const el = document.querySelector(".vramcut-plan");
const c = el.querySelector("canvas");
const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
const hex = (h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16));
const want = {resident: hex(el.dataset.residentColor), streamed: hex(el.dataset.streamedColor)};
const out = {resident: 0, streamed: 0, painted: 0, total: c.width * c.height};
for (let i = 0; i < px.length; i += 4) {
  if (px[i + 3] > 0) out.painted++;
  for (const k of ["resident", "streamed"]) {
    const w = want[k];
    if (Math.abs(px[i] - w[0]) <= %(tol)d && Math.abs(px[i + 1] - w[1]) <= %(tol)d &&
        Math.abs(px[i + 2] - w[2]) <= %(tol)d && px[i + 3] > 200) out[k]++;
  }
}
return out;
""" % {"tol": COLOR_TOLERANCE}


def _wait(browser, what: str, fn, timeout: float = UI_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last state {last!r}; "
                f"console: {_console_errors(browser)}")


def _console_errors(browser) -> list[str]:
    try:
        return [e["message"] for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    except Exception:
        return []


def _open(browser, server):
    browser.get(server.url + "/")
    assert browser.execute_async_script(READY_JS, NODE_TYPE, 45000), \
        f"the ComfyUI frontend or the vramcut extension did not load; console: {_console_errors(browser)}"


def _plan_drawn(browser):
    st = browser.execute_script(PLAN_STATE_JS)
    if st and st["data"].get("hasPlan") == "true" and int(st["data"].get("segments", 0)) > 0 \
            and int(st["data"].get("drawn", 0)) > 0:
        return st
    return None


def _count_on_screen(png: bytes, hex_color: str) -> int:
    import numpy as np
    from PIL import Image

    want = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    px = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
    return int((np.abs(px - want) <= COLOR_TOLERANCE).all(axis=-1).sum())


def _save(name: str, png: bytes) -> str:
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = os.path.join(ARTIFACTS, name)
    with open(path, "wb") as f:
        f.write(png)
    print(f"\nscreenshot: {path}")
    return path


def _run_example(browser, server):
    _open(browser, server)
    url = f"{server.url}/api/workflow_templates/{server.pack_folder}/{RUNNABLE_EXAMPLE}.json"
    r = browser.execute_async_script(RUN_EXAMPLE_JS, url, server.tiny_model, server.tiny_budget_gb)
    assert "error" not in r, r["error"]
    return r["id"], _wait(browser, "the plan to be drawn", lambda: _plan_drawn(browser))


def test_plan_drawn_in_browser(comfy_server, browser):
    from selenium.webdriver.common.by import By

    node_id, st = _run_example(browser, comfy_server)
    d = st["data"]
    assert int(d["resident"]) >= 1 and int(d["streamed"]) >= 1, d
    assert int(d["segments"]) == int(d["resident"]) + int(d["streamed"]) + int(d["idle"])
    assert d["stage"] in ("weights", "measured") and d["models"] == "1"
    assert "message" not in d, d
    # the node is at least as big as its content, and wide enough to read
    assert st["size"][1] >= st["min"][1] - 1 and st["width"] >= 300, st
    assert st["stored"], "the payload was not kept in node.properties"

    px = browser.execute_script(CANVAS_PIXELS_JS)
    assert px["painted"] > 0.05 * px["total"], px
    assert px["resident"] > 100 and px["streamed"] > 100, px

    time.sleep(0.3)  # let LiteGraph paint the frame that positions the widget
    page = browser.get_screenshot_as_png()
    _save("plan_page.png", page)
    element = browser.find_element(By.CSS_SELECTOR, ".vramcut-plan").screenshot_as_png
    _save("plan_widget.png", element)
    # what is on screen, not only in the canvas buffer
    assert _count_on_screen(element, d["residentColor"]) > 100
    assert _count_on_screen(element, d["streamedColor"]) > 100

    errors = [m for m in _console_errors(browser) if "vramcut" in m.lower()]
    assert not errors, errors


RELOAD_JS = """
const [nodeId, done] = arguments;
(async () => {
  const saved = JSON.parse(JSON.stringify(app.graph.serialize()));
  app.graph.clear();
  await app.loadGraphData(saved);
  const node = app.graph.getNodeById(nodeId);
  done({type: node && node.type, stored: !!(node && node.properties.vramcut_plan)});
})().catch((e) => done({error: String(e && e.stack || e)}));
"""

LIVE_EVENT_JS = """
const [nodeId, done] = arguments;
(async () => {
  const { api } = await import("/scripts/api.js");
  const node = app.graph.getNodeById(nodeId);
  const payload = JSON.parse(JSON.stringify(node.properties.vramcut_plan));
  payload.message = "live update from the test";
  payload.models[0].stage = "measured";
  // a node inside a subgraph is addressed by its path; the last part is the node's own id
  const send = (detail) => api.dispatchEvent(new CustomEvent("vramcut.plan", {detail}));
  send({node: "99:" + nodeId, payload});
  send({node: String(nodeId) + "0", payload: {models: []}});
  done(true);
})().catch((e) => done({error: String(e && e.stack || e)}));
"""


def test_plan_survives_reload_and_follows_live_events(comfy_server, browser):
    node_id, before = _run_example(browser, comfy_server)

    r = browser.execute_async_script(RELOAD_JS, node_id)
    assert "error" not in r and r["type"] == NODE_TYPE and r["stored"], r
    after = _wait(browser, "the plan after reload", lambda: _plan_drawn(browser))
    for k in ("segments", "resident", "streamed", "stage"):
        assert after["data"][k] == before["data"][k], (k, before, after)

    r = browser.execute_async_script(LIVE_EVENT_JS, node_id)
    assert r is True, r
    live = _wait(browser, "the live event to be shown",
                 lambda: (s := browser.execute_script(PLAN_STATE_JS)) and s["data"].get("message") and s)
    assert live["data"]["message"] == "live update from the test"
    assert live["data"]["stage"] == "measured"
    assert live["data"]["segments"] == before["data"]["segments"]  # the event for node "<id>0" was ignored
    _save("plan_live_message.png", browser.get_screenshot_as_png())


def test_decode_updates_the_plan_with_measured_shapes_in_history(comfy_server):
    """A VAE decode through the node: the node runs first (weights-only plan), the decode then
    measures the real shapes and the live update lands in the node's output in /history."""
    s = comfy_server
    prompt = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": s.sd_vae}},
        "2": {"class_type": NODE_TYPE, "inputs": {
            "max_vram_gb": 0.08, "budget_mode": "fixed", "reserve_gb": 1.0, "prefetch": True,
            "residency": True, "vae": ["1", 0]}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "4": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["2", 2]}},
        "5": {"class_type": "PreviewImage", "inputs": {"images": ["4", 0]}},
    }
    r = s.post("/prompt", {"prompt": prompt, "client_id": "vramcut-test"})
    assert not r.get("node_errors"), r
    entry = _wait_history(s, r["prompt_id"])
    assert entry["status"]["status_str"] == "success", (entry["status"], s.log_tail())
    (payload,) = entry["outputs"]["2"]["vramcut"]
    (vae,) = payload["models"]
    assert vae["kind"] == "VAE" and vae["stage"] == "measured", vae["text"]
    assert vae["signature"] and "1x4x8x8" in vae["signature"]
    plan = vae["plan"]
    assert plan["measured"] and plan["activation_reserve_bytes"] > 0
    assert plan["peak_bytes"] <= plan["budget_bytes"] == int(0.08 * 1024**3)
    assert plan["streamed_bytes_per_forward"] > 0
    assert any(not s["idle"] for s in plan["segments"]) and any(s["idle"] for s in plan["segments"]), \
        "a decode never runs the encoder: its units are idle"
    assert "images" in entry["outputs"]["5"]
