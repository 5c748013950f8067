// Which plan is a node's: the live events meant for it, the plans seen in this page, and the
// server's /history a reloaded page gets its plans back from.
//
// A plan belongs to the run that made it. A run of a saved workflow is known by the workflow's
// id; a workflow that was cleared (Clear Workflow, a new blank one) has no id of its own until it
// is saved, so its runs are remembered by prompt id in the browser's storage from the moment
// their plans arrive, and forgotten when that workflow is cleared: a look-alike graph built after
// a clear never gets the plan of the one before.
// Rule: nothing happens at import (ComfyUI also loads this file on its own as an extension
// script); `app` and `api` come in as arguments.

import { lastPayload } from "./payload.js";

const HISTORY_ITEMS = 64;
const HISTORY_MAX_AGE_MS = 3000;
const WIDGET_NAME = "vramcut_plan";
// A cleared workflow ("Clear Workflow", or a new blank one) has this id until it is saved or
// loaded again, when the frontend gives it a new one: its runs cannot be found by id.
const NO_GRAPH_ID = "00000000-0000-0000-0000-000000000000";
const RUNS_KEY = "vramcut.unsavedRuns"; // prompt ids of the runs of the cleared workflow on screen
const MAX_RUNS = 64;

/** True when an event for `target` ("7", or a subgraph path "12:7") is meant for this node. */
function eventIsFor(node, target) {
  if (target === undefined || target === null) return false;
  const id = String(node.id);
  const t = String(target);
  return t === id || t.split(":").pop() === id;
}

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

/** The workflow a run was queued from has the same nodes (ids and types) as this node's. */
function sameWorkflow(saved, node) {
  const nodes = Array.isArray(saved?.nodes) ? saved.nodes : [];
  const ids = (list) => list.map((n) => `${n?.id}:${n?.type}`).sort().join(",");
  return ids(nodes) === ids(node.graph?.nodes ?? []);
}

function readRuns() {
  try {
    const v = JSON.parse(globalThis.localStorage?.getItem(RUNS_KEY) ?? "[]");
    return Array.isArray(v) ? v.map(String) : [];
  } catch {
    return [];
  }
}

function writeRuns(list) {
  try {
    globalThis.localStorage?.setItem(RUNS_KEY, JSON.stringify(list.slice(-MAX_RUNS)));
  } catch {
    // storage full or off: a reloaded cleared workflow then finds no plan, never a wrong one
  }
}

export class PlanHistory {
  /** `app`, `api`: ComfyUI's. Starts listening to the server's events (once per page). */
  constructor(app, api) {
    this.app = app;
    this.api = api;
    this.seen = new Map(); // plans seen in this page, by workflow and node, with the run's inputs
    this.runningPrompt = null;
    this.request = null;
    this.requestAt = 0;
    // The prompt the server is running now: a plan event carries the prompt it was sent for;
    // one from another prompt (a model of an earlier run releasing its buffers, say) is not for
    // the nodes on screen, even when a node id matches.
    api.addEventListener("execution_start", (e) => {
      this.runningPrompt = e?.detail?.prompt_id ?? null;
    });
    // the cleared workflow's runs end with it
    api.addEventListener("graphCleared", () => writeRuns([]));
  }

  graphId() {
    const g = this.app.rootGraph ?? this.app.graph;
    return g?.id ? String(g.id) : null;
  }

  key(node) {
    return `${this.graphId() ?? ""}:${node.id}`;
  }

  /** True when a live event is meant for `node` and for the prompt running now. */
  isFor(node, detail) {
    if (!detail || !eventIsFor(node, detail.node)) return false;
    return !detail.prompt_id || !this.runningPrompt || detail.prompt_id === this.runningPrompt;
  }

  /** A plan shown on `node`; `run`: it came from a run of this page (an event or the node's
   * output), which makes the run this workflow's own. */
  remember(node, payload, { run = false } = {}) {
    this.seen.set(this.key(node), { payload, inputs: graphInputs(node.graph) });
    const pid = run ? this.runningPrompt : null;
    if (pid && this.graphId() === NO_GRAPH_ID) {
      const runs = readRuns();
      if (!runs.includes(String(pid))) writeRuns([...runs, String(pid)]);
    }
  }

  /** The plan this page showed on `node` for the inputs it has now, or null. */
  known(node) {
    const kept = this.seen.get(this.key(node));
    return kept && samePrompt(kept.inputs, node.graph) ? kept.payload : null;
  }

  recent() {
    if (!this.request || performance.now() - this.requestAt > HISTORY_MAX_AGE_MS) {
      this.requestAt = performance.now();
      this.request = this.api.fetchApi(`/history?max_items=${HISTORY_ITEMS}`)
        .then((r) => (r.ok ? r.json() : {}))
        .catch(() => ({}));
    }
    return this.request;
  }

  /** After a page reload: the newest plan of a run of this workflow that had the node's inputs
   * (the id and type of the node, the widgets of every node it shares with the run). */
  async fromHistory(node) {
    const history = await this.recent();
    const id = String(node.id);
    const gid = this.graphId();
    if (!gid) return null;
    const unsaved = new Set(readRuns());
    let found = null;
    for (const [promptId, entry] of Object.entries(history ?? {})) {
      const out = entry?.outputs?.[id]?.vramcut;
      if (!out) continue;
      const prompt = Array.isArray(entry.prompt) ? entry.prompt : [];
      if (prompt[2]?.[id]?.class_type !== node.type || !samePrompt(prompt[2], node.graph)) continue;
      // only this workflow's own runs (a prompt sent through the API names no workflow)
      const saved = prompt[3]?.extra_pnginfo?.workflow;
      const wf = saved?.id ? String(saved.id) : null;
      if (!wf) continue;
      // a cleared workflow's runs are the ones this page made since it was cleared (it gets an
      // id of its own when loaded again): a look-alike graph built after another clear is not
      // the one that ran
      if (wf === NO_GRAPH_ID ? !(unsaved.has(String(prompt[1] ?? promptId)) && sameWorkflow(saved, node)) : wf !== gid) continue;
      found = lastPayload(out) ?? found; // the history lists the newest last
    }
    return found;
  }
}
