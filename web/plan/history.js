// Which plan is a node's: the live events meant for it, the plans seen in this page, and the
// server's /history a reloaded page gets its plans back from.
//
// A plan belongs to the run that made it, and a run to the workflow (the tab) it was queued from:
// the prompt ids of each workflow's runs are kept in the browser's storage, by the workflow's path,
// from the moment their plans arrive, and forgotten when that workflow is cleared. A workflow id
// is no proof (copies opened from one file, a template opened twice, share it), and neither is a
// look-alike graph: a copy that never ran shows no plan, however like the one that ran it is.
// Rule: nothing happens at import (ComfyUI also loads this file on its own as an extension
// script); `app` and `api` come in as arguments.

import { lastPayload } from "./payload.js";

const HISTORY_ITEMS = 64;
const HISTORY_MAX_AGE_MS = 3000;
const WIDGET_NAME = "vramcut_plan";
const RUNS_KEY = "vramcut.runs"; // {workflow path: prompt ids of its runs}
const MAX_RUNS = 64;     // per workflow
const MAX_WORKFLOWS = 64;

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

function readRuns() {
  try {
    const v = JSON.parse(globalThis.localStorage?.getItem(RUNS_KEY) ?? "{}");
    return v && typeof v === "object" && !Array.isArray(v) ? v : {};
  } catch {
    return {};
  }
}

function writeRuns(runs) {
  const keys = Object.keys(runs);
  for (const k of keys.slice(0, Math.max(0, keys.length - MAX_WORKFLOWS))) delete runs[k];
  try {
    globalThis.localStorage?.setItem(RUNS_KEY, JSON.stringify(runs));
  } catch {
    // storage full or off: a reloaded workflow then finds no plan, never a wrong one
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
    api.addEventListener("graphCleared", () => this.forgetRuns());
    // A loaded workflow's nodes are configured before the frontend makes it the active one:
    // which workflow they are in is known once the load has returned. Content opened from a file
    // or a template (the load names it; not a tab switch, which passes the workflow itself, nor
    // the page's first load, which restores the tabs) starts without runs, even in a tab (a path)
    // that had some.
    this.loading = 0;
    this.loaded = [];
    this.started = false;
    this.gone = new Set(); // runs of content no longer on screen (cleared, or loaded over)
    // A run is the workflow's that queued it: recorded when queued, so its events never land on
    // another tab, or on content loaded since.
    const queue = api.queuePrompt;
    if (typeof queue === "function") {
      const history = this;
      api.queuePrompt = async function (...args) {
        const key = history.workflowKey();
        const r = await queue.apply(this, args);
        if (r?.prompt_id) history.addRun(key, r.prompt_id);
        return r;
      };
    }
    const load = app.loadGraphData;
    if (typeof load === "function") {
      const history = this;
      app.loadGraphData = async function (...args) {
        const fresh = history.started && typeof args[3] === "string";
        history.loading += 1;
        try {
          return await load.apply(this, args);
        } finally {
          history.loading -= 1;
          history.started = true;
          if (fresh) history.forgetRuns();
          if (!history.loading) for (const f of history.loaded.splice(0)) f();
        }
      };
    }
  }

  /** Resolves once no workflow is being loaded (at once when none is). */
  afterLoad() {
    return this.loading ? new Promise((resolve) => this.loaded.push(resolve)) : Promise.resolve();
  }

  graphId() {
    const g = this.app.rootGraph ?? this.app.graph;
    return g?.id ? String(g.id) : null;
  }

  /** The workflow on screen: its path (each open copy has its own), else the graph's id. */
  workflowKey() {
    const wf = this.app.extensionManager?.workflow?.activeWorkflow;
    return String(wf?.path ?? wf?.key ?? this.graphId() ?? "");
  }

  key(node) {
    return `${this.workflowKey()}:${node.id}`;
  }

  /** The prompt ids of the runs of the workflow on screen. */
  runs() {
    return new Set((readRuns()[this.workflowKey()] ?? []).map(String));
  }

  forgetRuns() {
    const runs = readRuns();
    for (const pid of runs[this.workflowKey()] ?? []) this.gone.add(String(pid));
    if (this.runningPrompt) this.gone.add(String(this.runningPrompt)); // still running: not this content's
    delete runs[this.workflowKey()];
    writeRuns(runs);
    for (const k of [...this.seen.keys()]) if (k.startsWith(`${this.workflowKey()}:`)) this.seen.delete(k);
  }

  /** True when a live event is meant for `node`: its id, and a prompt of the workflow on screen
   * (one this page queued from it; else, one it did not queue elsewhere, the prompt running now). */
  isFor(node, detail) {
    if (!detail || !eventIsFor(node, detail.node)) return false;
    return this.ownPrompt(detail.prompt_id ?? this.runningPrompt);
  }

  /** Whether prompt `pid` may draw on the workflow on screen (see isFor). */
  ownPrompt(pid) {
    if (!pid) return true;
    pid = String(pid);
    if (this.runs().has(pid)) return true;
    if (this.gone.has(pid) || Object.values(readRuns()).some((list) => list.map(String).includes(pid))) return false;
    return !this.runningPrompt || pid === String(this.runningPrompt);
  }

  addRun(key, pid) {
    const runs = readRuns();
    const mine = (runs[key] ?? []).map(String);
    if (mine.includes(String(pid))) return;
    delete runs[key]; // newest last: the least recently run workflows are forgotten first
    runs[key] = [...mine, String(pid)].slice(-MAX_RUNS);
    writeRuns(runs);
  }

  /** A plan shown on `node`; `run`: it came from a run of this page (an event or the node's
   * output), which makes the run this workflow's own. */
  remember(node, payload, { run = false } = {}) {
    this.seen.set(this.key(node), { payload, inputs: graphInputs(node.graph) });
    const pid = run ? this.runningPrompt : null;
    if (pid && this.ownPrompt(pid)) this.addRun(this.workflowKey(), pid);
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

  /** After a page reload: the newest plan of a run of this workflow (its own runs, remembered
   * by this browser) that had the node's inputs (the id and type of the node, the widgets of
   * every node it shares with the run). */
  async fromHistory(node) {
    const mine = this.runs();
    if (!mine.size) return null;
    const history = await this.recent();
    const id = String(node.id);
    let found = null;
    for (const [promptId, entry] of Object.entries(history ?? {})) {
      const out = entry?.outputs?.[id]?.vramcut;
      if (!out) continue;
      const prompt = Array.isArray(entry.prompt) ? entry.prompt : [];
      if (!mine.has(String(prompt[1] ?? promptId))) continue;
      if (prompt[2]?.[id]?.class_type !== node.type || !samePrompt(prompt[2], node.graph)) continue;
      found = lastPayload(out) ?? found; // the history lists the newest last
    }
    return found;
  }
}
