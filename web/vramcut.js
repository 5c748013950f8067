// VRAMCut frontend: draws the plan the "Max VRAM (VRAMCut)" node sends.
//
// This entry registers the one extension and chains the node's prototype methods (never replacing
// them); it owns what ties a plan to a node: the live events, the history a reloaded page gets
// its plans back from, and fitting the node around the plan. The plan's own rooms are in plan/:
// payload.js (reading what Python sent), format.js (its words and numbers), draw.js (the canvas;
// labels.js names its segment bars, pen.js fits and records its text), table.js (the table view)
// and view.js (the DOM widget and its tooltip).
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
// nothing at import and get `app` as an argument; the browser evaluates each once, whether this
// file or ComfyUI imports it first (both name the same URL).

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { answer, refusalFor } from "./plan/format.js";
import { lastPayload } from "./plan/payload.js";
import { PlanView, watchPage } from "./plan/view.js";
import { COLORS, readTheme } from "./plan/theme.js";
import { fitText } from "./plan/pen.js";

// Both Max VRAM nodes send the same payload (the second one is for upscale / CLIP vision models).
const NODE_TYPES = new Set(["VRAMCutMaxVRAM", "VRAMCutMaxVRAMExtras"]);
const EVENT = "vramcut.plan";
const LEGACY_PROPERTY = "vramcut_plan"; // older versions saved the plan here: still shown, never written
const VIEW_PROPERTY = "vramcut_view";   // "details" when the user expanded the node (a user edit)
const WIDGET_NAME = "vramcut_plan";
const MARGIN = 6; // px around the widget inside the node
const MIN_NODE_WIDTH = 360; // a new node's width (the plan reads whole at it)
const MIN_WIDGET_HEIGHT = 24; // the node can be shrunk down to the header row
const HISTORY_ITEMS = 64;
const BUDGET_WIDGETS = new Set(["max_vram_gb", "reserve_gb"]);

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

// -------------------------------------------------------------------------------- events

/** True when an event for `target` ("7", or a subgraph path "12:7") is meant for this node. */
function eventIsFor(node, target) {
  if (target === undefined || target === null) return false;
  const id = String(node.id);
  const t = String(target);
  return t === id || t.split(":").pop() === id;
}

// The prompt the server is running now (from its "execution_start" event). A plan event carries
// the prompt it was sent for; one from another prompt (a model of an earlier run releasing its
// buffers, say) is not for the nodes on screen, even when a node id matches.
let runningPrompt = null;
api.addEventListener("execution_start", (e) => {
  runningPrompt = e?.detail?.prompt_id ?? null;
});

function isCurrentPrompt(detail) {
  return !detail.prompt_id || !runningPrompt || detail.prompt_id === runningPrompt;
}

// ------------------------------------------------------------------------------- history

function graphId() {
  const g = app.rootGraph ?? app.graph;
  return g?.id ? String(g.id) : null;
}

// Plans seen in this page, by workflow and node: a workflow loaded again (tab switch, undo)
// shows its plan without asking the server. Each is kept with the inputs it was planned for.
const seen = new Map();
const seenKey = (node) => `${graphId() ?? ""}:${node.id}`;

/** The node's own inputs (its widgets by name): a plan made for other values is not this
 * node's plan (an example opened again, with the budget it was saved with). */
function inputsOf(node) {
  const out = {};
  for (const w of node.widgets ?? []) if (w.name && w.name !== WIDGET_NAME && w.serialize !== false) out[w.name] = w.value;
  return out;
}

/** True when every input the run had that is one of the node's widgets has the widget's value. */
function sameInputs(ran, node) {
  const now = inputsOf(node);
  return Object.entries(ran ?? {}).every(([k, v]) => !(k in now) || Array.isArray(v) || JSON.stringify(v) === JSON.stringify(now[k]));
}

/** The graph's inputs in the shape of an API prompt ({id: {class_type, inputs}}), widgets only. */
function graphInputs(graph) {
  const out = {};
  for (const n of graph?.nodes ?? []) out[n.id] = { class_type: n.type, inputs: inputsOf(n) };
  return out;
}

/** True when the nodes of a run (the API prompt) that are in this graph had the inputs they have
 * now: the plan depends on the loaders above the node too (another model, another plan). */
function samePrompt(prompt, graph) {
  return Object.entries(prompt ?? {}).every(([id, p]) => {
    const n = graph?.getNodeById?.(id);
    return !n || n.type !== p?.class_type || sameInputs(p.inputs, n);
  });
}

// After a page reload the plans come from the server's history: the newest output of a node
// with this id and type, from this workflow when the history says which.
let historyRequest = null;
let historyAt = 0;

function recentHistory() {
  if (!historyRequest || performance.now() - historyAt > 3000) {
    historyAt = performance.now();
    historyRequest = api.fetchApi(`/history?max_items=${HISTORY_ITEMS}`)
      .then((r) => (r.ok ? r.json() : {}))
      .catch(() => ({}));
  }
  return historyRequest;
}

// A cleared workflow ("Clear Workflow", or a new blank one) has this id until it is saved or
// loaded again, when the frontend gives it a new one: its runs cannot be found by id.
const NO_GRAPH_ID = "00000000-0000-0000-0000-000000000000";

/** The workflow a run was queued from has the same nodes (ids and types) as this node's. */
function sameWorkflow(saved, node) {
  const nodes = Array.isArray(saved?.nodes) ? saved.nodes : [];
  const ids = (list) => list.map((n) => `${n?.id}:${n?.type}`).sort().join(",");
  return ids(nodes) === ids(node.graph?.nodes ?? []);
}

async function planFromHistory(node) {
  const history = await recentHistory();
  const id = String(node.id);
  const gid = graphId();
  let found = null;
  for (const entry of Object.values(history ?? {})) {
    const out = entry?.outputs?.[id]?.vramcut;
    if (!out) continue;
    const prompt = Array.isArray(entry.prompt) ? entry.prompt : [];
    if (prompt[2]?.[id]?.class_type !== node.type || !samePrompt(prompt[2], node.graph)) continue;
    // only this workflow's own runs (a prompt sent through the API names no workflow); a run of
    // a cleared workflow is known by its nodes, as its id changed when it was loaded again
    const saved = prompt[3]?.extra_pnginfo?.workflow;
    const wf = saved?.id ? String(saved.id) : null;
    if (!wf || !gid) continue;
    if (wf !== gid && !(wf === NO_GRAPH_ID && sameWorkflow(saved, node))) continue;
    found = lastPayload(out) ?? found; // the history lists the newest last
  }
  return found;
}

// ---------------------------------------------------------------------------------- the node

/**
 * Names of the outputs whose model is used elsewhere unpatched: the matching input is connected,
 * its source also feeds other nodes, and this node's output leads nowhere (the plan never
 * applies). A node that is the model's only user is a preview (the plan-preview example), and a
 * node with VRAMCut off patches nothing: neither is warned.
 */
function unusedOutputs(node) {
  const out = [];
  const graph = node.graph;
  const budget = node.widgets?.find((w) => w.name === "max_vram_gb");
  const mode = node.widgets?.find((w) => w.name === "budget_mode");
  if (budget && Number(budget.value) === 0 && (!mode || mode.value === "fixed")) return out;
  for (const input of node.inputs ?? []) {
    if (input.link === null || input.link === undefined) continue;
    const o = (node.outputs ?? []).find((x) => x.name === input.name) ??
      (node.outputs ?? []).find((x) => x.type === input.type);
    if (!o || (o.links && o.links.length)) continue;
    const link = graph?.links?.get?.(input.link) ?? graph?.links?.[input.link];
    const src = link ? graph.getNodeById(link.origin_id) : null;
    const srcLinks = src?.outputs?.[link.origin_slot]?.links ?? [];
    if (srcLinks.some((id) => id !== input.link)) out.push(String(o.type ?? o.name).toUpperCase());
  }
  return out;
}

/** The answer a collapsed node shows after its title (" · fits 70 % · +12 ms/step"), and its
 * colour; null when the node is open or has no plan. */
function collapsedAnswer(node) {
  const p = node.flags?.collapsed ? node.vramcutView?.payload : null;
  if (!p?.models?.length) return null;
  const a = answer(p.models[0], p.budget_bytes, refusalFor(p, p.models[0]));
  const more = p.models.length > 1 ? ` +${p.models.length - 1}` : "";
  const theme = readTheme(node.vramcutView.el);
  return { text: ` · ${a.short}${more}`, color: a.fits ? theme.fits : COLORS.over };
}

/** Nodes 2.0 draws a node's header in the page (a Vue component showing the title only): the
 * answer of a collapsed node goes in beside the title there. Until the header is mounted (a
 * collapse or a load re-renders it) it is looked for again, a few frames at most. */
function syncVueHeader(node, tries = 0) {
  if (!globalThis.LiteGraph?.vueNodesMode) return;
  const title = document.querySelector(`[data-testid="node-header-${node.id}"] [data-testid="node-title"]`);
  if (!title) {
    if (tries < 30 && node.flags?.collapsed) requestAnimationFrame(() => syncVueHeader(node, tries + 1));
    return;
  }
  const tail = collapsedAnswer(node);
  let span = title.querySelector(".vramcut-collapsed-answer");
  if (!tail) {
    span?.remove();
    return;
  }
  if (!span) {
    span = document.createElement("span");
    span.className = "vramcut-collapsed-answer";
    Object.assign(span.style, { flex: "0 0 auto", whiteSpace: "nowrap", fontWeight: "600", marginLeft: "0.5em", paddingRight: "4px" });
    title.append(span);
  }
  span.textContent = tail.text.replace(/^ · /, "");
  span.style.color = tail.color;
}

/** Adds the plan widget to a new node, with the node's plan methods (fit, details, links, events). */
function attachPlan(node) {
  const view = new PlanView(node, app);
  node.vramcutView = view;
  let wantContent = false;

  const widget = node.addDOMWidget(WIDGET_NAME, "vramcut_plan", view.el, {
    serialize: false,
    hideOnZoom: false, // zoomed out the plan still answers (LiteGraph draws no text there)
    margin: MARGIN,
    getValue: () => "",
    setValue: () => {},
    // No locked minimum: the node can be made as small as the header. Only while this code
    // fits the node does the minimum become the content's height.
    getMinHeight: () => (wantContent
      ? view.contentHeight((node.size?.[0] ?? MIN_NODE_WIDTH) - 2 * MARGIN)
      : MIN_WIDGET_HEIGHT),
    onDraw: () => view.checkFrame(),
  });
  widget.serialize = false; // keep widgets_values to the real inputs
  node.vramcutWidget = widget;
  // The budgets step by 0.05 GiB and round to 0.001 GiB; the host shows as many decimals as the
  // step has, so 0.001 read "0.00": show the three the rounding keeps.
  for (const w of node.widgets ?? []) {
    if (BUDGET_WIDGETS.has(w.name) && w.options) w.options.precision = 3;
  }

  // Grow the node to show the plan; shrink only on the user's own request (`shrink`). A plan
  // that fits changes nothing, so a run with no edit leaves a saved workflow unchanged.
  // Mounted, the widget's own height says how much the node must change; before that (or
  // while the host has not laid out the last change yet) the node's computed size does.
  let lastFit = null;
  // false while a fit is wanted and not yet seen on screen (vramcutCheckFit looks every frame)
  let settled = false;
  node.vramcutFit = ({ shrink = false, tries = 0 } = {}) => {
    if (node.flags?.collapsed) return;
    settled = false;
    const w = node.size[0]; // a new node starts at MIN_NODE_WIDTH; a width the user chose stays
    const area = view.el.clientHeight;
    if (area > 0 && lastFit && lastFit.h === node.size[1] && lastFit.area === area) {
      // the host has not laid out the last size yet: look again in a frame
      if (tries < 10) {
        requestAnimationFrame(() => node.vramcutFit({ shrink, tries: tries + 1 }));
        return;
      }
    }
    lastFit = null;
    if (area === 0 && tries === 0) {
      view.fitPending = { shrink }; // not laid out yet: fitted on its first draw
      return;
    }
    let h;
    if (area > 0) {
      const need = view.contentHeight(view.el.clientWidth || w - 2 * MARGIN) - area;
      h = node.size[1] + (shrink ? need : Math.max(0, need));
    } else {
      wantContent = true;
      try {
        const min = node.computeSize();
        h = shrink ? min[1] : Math.max(node.size[1], min[1]);
      } finally {
        wantContent = false;
      }
    }
    if (Math.abs(w - node.size[0]) > 0.5 || Math.abs(h - node.size[1]) > 0.5) {
      node.setSize([w, h]);
      lastFit = { h: node.size[1], area };
    }
    node.setDirtyCanvas?.(true, true);
  };

  // The host sizes a node again after a fit (a node added from the search box is sized after
  // our first fit; a plan can arrive before the last size is laid out): until the plan area has
  // been seen at its content's height, every frame checks it again. A loaded node keeps its
  // saved size.
  let checked = null;
  node.vramcutSettle = () => {
    settled = true;
  };
  node.vramcutCheckFit = () => {
    if (settled || node.flags?.collapsed) return;
    const area = view.el.clientHeight;
    // not laid out yet: no height, or one the node cannot hold (a first layout can measure the
    // element at the page's size)
    if (!area || area > node.size[1]) return;
    if (area + 1 >= view.contentHeight(view.el.clientWidth)) {
      settled = true;
      return;
    }
    // the last fit not laid out yet, or undone by the host (a node from the search box follows
    // the pointer as a "ghost" until placed, and is sized again): look again a little later
    const key = `${node.size[1]}|${area}`;
    if (key === checked?.key && performance.now() - checked.at < 250) return;
    checked = { key, at: performance.now() };
    node.vramcutFit();
  };

  node.vramcutSetDetails = (on) => {
    view.setDetails(on);
    // a user's choice, kept with the workflow like any other edit
    node.properties = node.properties || {};
    if (on) node.properties[VIEW_PROPERTY] = "details";
    else delete node.properties[VIEW_PROPERTY];
    node.vramcutFit({ shrink: true });
  };

  node.vramcutCheckLinks = () => {
    if (view.setUnused(unusedOutputs(node))) node.vramcutFit();
  };

  node.vramcutOnEvent = (e) => {
    const detail = e?.detail;
    if (!detail || !eventIsFor(node, detail.node) || !isCurrentPrompt(detail)) return;
    node.vramcutShow(detail.payload);
  };
  api.addEventListener(EVENT, node.vramcutOnEvent);

  if (node.size[0] < MIN_NODE_WIDTH) node.setSize([MIN_NODE_WIDTH, node.size[1]]);
  requestAnimationFrame(() => !settled && node.vramcutFit?.());
}

app.registerExtension({
  name: "vramcut.MaxVRAM",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.has(nodeData?.name)) return;
    const proto = nodeType.prototype;

    chain(proto, "onNodeCreated", function (base) {
      const r = base();
      attachPlan(this);
      return r;
    });

    proto.vramcutShow = function (payload, { fit = true } = {}) {
      const view = this.vramcutView;
      if (!view) return;
      view.setPayload(payload);
      if (payload) seen.set(seenKey(this), { payload, inputs: graphInputs(this.graph) });
      syncVueHeader(this);
      // Grow only when the content's height changed since it was last fitted: a node the user
      // made smaller keeps its size through every run that draws the same kind of plan.
      // A plan shown again after a load leaves the saved size alone (and counts as not fitted).
      if (fit) {
        const h = view.contentHeight((this.size?.[0] ?? MIN_NODE_WIDTH) - 2 * MARGIN);
        const changed = h !== view.fittedHeight;
        view.fittedHeight = h;
        if (changed) this.vramcutFit?.();
      }
      this.setDirtyCanvas?.(true, false);
    };


    chain(proto, "onExecuted", function (base, message) {
      const r = base();
      const payload = lastPayload(message?.vramcut);
      if (payload) this.vramcutShow(payload);
      return r;
    });

    chain(proto, "onConfigure", function (base) {
      const r = base();
      const view = this.vramcutView;
      if (!view) return r;
      this.vramcutSettle?.(); // a loaded workflow keeps its saved size
      view.setDetails(this.properties?.[VIEW_PROPERTY] === "details");
      // A loaded workflow keeps its saved size: showing its plan again must not change it.
      const kept = seen.get(seenKey(this));
      const known = (kept && samePrompt(kept.inputs, this.graph) ? kept.payload : null) ?? this.properties?.[LEGACY_PROPERTY];
      if (known) this.vramcutShow(known, { fit: false });
      else {
        planFromHistory(this).then((p) => {
          if (p && !view.payload && this.vramcutView === view) this.vramcutShow(p, { fit: false });
        });
      }
      return r;
    });

    chain(proto, "onConnectionsChange", function (base) {
      const r = base();
      this.vramcutCheckLinks?.();
      // once the change is complete (a link replaced is removed here before the new one exists)
      requestAnimationFrame(() => this.vramcutCheckLinks?.());
      return r;
    });

    // Collapsed, the node's header carries the answer. getTitle gives it (the host sizes a
    // collapsed node to its title), and the header is drawn here, because the host draws only
    // the first 20 characters of a collapsed title: the name, cut first, then the answer in its
    // verdict's colour.
    chain(proto, "getTitle", function (base) {
      const title = base() ?? this.title;
      const tail = collapsedAnswer(this);
      return tail ? `${title}${tail.text}` : title;
    });

    chain(proto, "collapse", function (base) {
      const r = base();
      requestAnimationFrame(() => syncVueHeader(this));
      return r;
    });

    chain(proto, "drawTitleText", function (base, ctx, opts) {
      const tail = collapsedAnswer(this);
      const LiteGraph = globalThis.LiteGraph;
      if (!tail || !LiteGraph || this.onDrawTitleText || opts?.low_quality || !ctx) return base();
      const th = opts?.title_height ?? LiteGraph.NODE_TITLE_HEIGHT;
      const room = (this._collapsed_width || this.size[0]) - 2 * th;
      ctx.save();
      ctx.textAlign = "left";
      // the host sizes a collapsed node by its title in the node's inner font: where the title
      // font does not fit that width, the inner one does
      ctx.font = this.titleFontStyle;
      if (ctx.measureText(this.getTitle()).width > room + 0.5 && this.innerFontStyle) ctx.font = this.innerFontStyle;
      const tailW = ctx.measureText(tail.text).width;
      const name = fitText(ctx, String(this.title || this.constructor.title || ""), room - tailW);
      const y = LiteGraph.NODE_TITLE_TEXT_Y - th;
      ctx.fillStyle = this.selected ? LiteGraph.NODE_SELECTED_TITLE_COLOR
        : this.constructor.title_text_color || opts?.default_title_color || "#999";
      ctx.fillText(name, th, y);
      ctx.fillStyle = tail.color;
      ctx.fillText(tail.text, th + ctx.measureText(name).width, y);
      ctx.restore();
    });

    // Cleanup first, so that a failing handler further down the chain cannot leave the listener.
    chain(proto, "onRemoved", function (base) {
      if (this.vramcutOnEvent) api.removeEventListener(EVENT, this.vramcutOnEvent);
      this.vramcutOnEvent = null;
      this.vramcutView?.destroy();
      return base();
    });
  },
});
