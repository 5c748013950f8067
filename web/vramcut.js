// VRAMCut frontend: draws the plan the "Max VRAM (VRAMCut)" node sends.
//
// This entry registers the one extension and chains the node's prototype methods (never replacing
// them); everything else is in plan/: payload.js (reading what Python sent), format.js (its words
// and numbers), draw.js (the canvas; labels.js names its segment bars, pen.js fits and records its
// text; ram.js the RAM row under max_ram_gb), table.js (the table view), view.js (the DOM widget, its tooltip, and attaching it to a
// node), fit.js (sizing the node around the plan), node.js (the collapsed title, unused outputs)
// and history.js (which plan is a node's: live events, this page's plans, the server's history).
//
// Python owns the plan; this code only draws it. Data arrives two ways:
//   - the node's output:  onExecuted(message) with message.vramcut = [PAYLOAD]
//   - live updates:       api event "vramcut.plan", detail = {node: "<id or a:b:id>", payload: PAYLOAD}
// (PAYLOAD is described in plan/payload.js.)
//
// A plan is never written into the workflow (node.properties): a run with no edit must not mark
// a saved workflow as changed. After a reload the plan comes back from the server's /history.
//
// ComfyUI imports every .js under web/ as an extension script, plan/ included: those modules do
// nothing at import and get `app` / `api` as arguments; the browser evaluates each once, whether
// this file or ComfyUI imports it first (both name the same URL).

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { lastPayload } from "./plan/payload.js";
import { attachPlan } from "./plan/view.js";
import { watchPage } from "./plan/tip.js";
import { PlanHistory } from "./plan/history.js";
import { collapsedTitle, drawCollapsedTitle, syncVueHeader } from "./plan/node.js";
import { attachDevicesMessage, showDevicesMessage } from "./plan/devices.js";

// Both Max VRAM nodes send the same payload (the second one is for upscale / CLIP vision models).
const NODE_TYPES = new Set(["VRAMCutMaxVRAM", "VRAMCutMaxVRAMExtras"]);

const DEVICES_TYPE = "VRAMCutDevices";

const history = new PlanHistory(app, api);
watchPage();

/**
 * Chains `fn` onto the prototype's method `name`, never replacing it: `fn` runs with the node as
 * `this`, gets `base` (the method it chains, called with this call's arguments; call it once,
 * where the order matters) and then the arguments, and returns the result.
 */
function chain(proto, name, fn) {
  const earlier = proto[name];
  proto[name] = function (...args) {
    return fn.call(this, () => earlier?.apply(this, args), ...args);
  };
}

/** The Devices node: its reserve to the thousandth, and its message on the node. */
function wireDevices(proto) {
  chain(proto, "onNodeCreated", function (base) {
    const r = base();
    attachDevicesMessage(this);
    return r;
  });
  chain(proto, "onExecuted", function (base, message) {
    const r = base();
    showDevicesMessage(this, lastPayload(message?.vramcut));
    return r;
  });
}

app.registerExtension({
  name: "vramcut.MaxVRAM",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name === DEVICES_TYPE) return wireDevices(nodeType.prototype);
    if (!NODE_TYPES.has(nodeData?.name)) return;
    const proto = nodeType.prototype;

    chain(proto, "onNodeCreated", function (base) {
      const r = base();
      attachPlan(this, app, api, history);
      return r;
    });

    // The node's plan methods (the view does the work): show a payload (`fit: false`, a plan
    // shown again in a loaded workflow, keeps the saved size unless it would cut the plan), fit
    // the node, open or close the details.
    proto.vramcutShow = function (payload, { fit = true } = {}) {
      if (!this.vramcutView) return;
      if (payload) history.remember(this, payload);
      this.vramcutView.show(payload, { restore: !fit });
    };
    proto.vramcutFit = function (how) {
      this.vramcutView?.fit.fit(how);
    };
    proto.vramcutSetDetails = function (on) {
      this.vramcutView?.chooseDetails(on);
    };

    chain(proto, "onExecuted", function (base, message) {
      const r = base();
      const payload = lastPayload(message?.vramcut);
      // the host hands a run's output to the node of that id on screen, whichever workflow ran
      if (payload && this.vramcutView && history.ownPrompt(history.runningPrompt)) {
        history.remember(this, payload, { run: true });
        this.vramcutView.show(payload);
      }
      return r;
    });

    chain(proto, "onConfigure", function (base) {
      const r = base();
      this.vramcutView?.restore(history);
      return r;
    });

    chain(proto, "onConnectionsChange", function (base) {
      const r = base();
      this.vramcutView?.checkLinks();
      // once the change is complete (a link replaced is removed here before the new one exists)
      requestAnimationFrame(() => this.vramcutView?.checkLinks());
      return r;
    });

    // Collapsed, the node's header carries the answer: getTitle gives it (the host sizes a
    // collapsed node to its title) and drawTitleText draws it (the host draws only the first 20
    // characters of a collapsed title).
    chain(proto, "getTitle", function (base) {
      return collapsedTitle(this, base() ?? this.title);
    });

    chain(proto, "collapse", function (base) {
      const r = base();
      requestAnimationFrame(() => syncVueHeader(this));
      return r;
    });

    chain(proto, "drawTitleText", function (base, ctx, opts) {
      if (!drawCollapsedTitle(this, ctx, opts)) return base();
    });

    // Cleanup first, so that a failing handler further down the chain cannot leave the listener.
    chain(proto, "onRemoved", function (base) {
      this.vramcutView?.destroy();
      return base();
    });
  },
});
