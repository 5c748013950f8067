"""Graphs the browser tests build in the page: written once, used by every test file that needs
them (a test module imports these beside test_browser's page helpers)."""
from __future__ import annotations

NODE_TYPE = "VRAMCutMaxVRAM"

# Clear the workflow ("Clear Workflow", as a user does), build a UNETLoader feeding a Max VRAM
# node at 0.03 GiB, and queue it (or, not queued, keep the workflow as the user's last mouse-up
# does, for a reload). Arguments: the model's file name, whether to queue; answers {id, graph}.
CLEAR_BUILD_JS = """
const [model, queue, done] = arguments;
const capture = () => {
  const ct = app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
  if (typeof ct?.captureCanvasState === "function") ct.captureCanvasState(); else ct?.checkState?.();
};
(async () => {
  window.confirm = () => true;  // "Clear workflow?"
  await app.extensionManager.command.execute("Comfy.ClearWorkflow");
  const u = LiteGraph.createNode("UNETLoader"); u.pos = [20, 90]; app.graph.add(u);
  u.widgets.find((w) => w.name === "unet_name").value = model;
  const c = LiteGraph.createNode("%(node)s"); c.pos = [340, 90]; app.graph.add(c);
  c.widgets.find((w) => w.name === "max_vram_gb").value = 0.03;
  u.connect(0, c, 0);
  if (queue) await app.queuePrompt(0);
  else capture();
  done({id: c.id, graph: app.graph.id});
})().catch((e) => done({error: String(e && e.stack || e)}));
""" % {"node": NODE_TYPE}


def clear_and_build(browser, model: str, queue: bool = True) -> dict:
    """CLEAR_BUILD_JS in the page: the Max VRAM node's id (and the graph's)."""
    r = browser.execute_async_script(CLEAR_BUILD_JS, model, queue)
    assert "error" not in r, r
    return r
