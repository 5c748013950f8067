// The plan as a table: one row per segment (from the segments Python sent), then Python's own
// summary lines (budget, peak, what streams, the measured run), each model under its answer line.
//
// The table is as wide as the node: names wrap at their dots (never inside a name's part),
// numbers stay whole, nothing scrolls sideways; the node grows to show every row.
// Rule: every figure is one Python sent, only formatted here (format.js); nothing done at import
// (ComfyUI also loads this file on its own as an extension script).

import { isIdle } from "./payload.js";
import { answer, blockCount, fmtBytes, refusalFor, segmentCounts } from "./format.js";
import { loadLine } from "./ram.js";

const COLUMNS = [
  // [heading, width, align]; the segment column takes what is left (the names in execution order)
  ["segment", "", "left"],
  ["where", "4.7em", "left"],
  ["weights", "4.8em", "right"],
  ["activ.", "4.8em", "right"],
  ["peak", "4.8em", "right"],
];

/** A segment's name that wraps only after a dot, an underscore or an ellipsis ("decoder.up.3"
 * never breaks inside "decoder"), anywhere only where one part is wider than the column. */
function nameCell(name) {
  const c = cell("td", "", { textAlign: "left", overflowWrap: "anywhere", whiteSpace: "normal" });
  for (const piece of String(name).split(/(?<=[._…])/)) {
    c.append(document.createTextNode(piece), document.createElement("wbr"));
  }
  return c;
}

function cell(tag, text, style = {}) {
  const c = document.createElement(tag);
  c.textContent = text;
  Object.assign(c.style, { padding: "1px 3px", verticalAlign: "top", ...style });
  return c;
}

function line(text, style = {}) {
  const d = document.createElement("div");
  d.textContent = text;
  Object.assign(d.style, { overflowWrap: "anywhere", ...style });
  return d;
}

function segmentTable(plan) {
  const t = document.createElement("table");
  Object.assign(t.style, { width: "100%", tableLayout: "fixed", borderCollapse: "collapse", margin: "3px 0" });
  const cols = document.createElement("colgroup");
  for (const [, w] of COLUMNS) {
    const c = document.createElement("col");
    if (w) c.style.width = w;
    cols.append(c);
  }
  t.append(cols);
  const head = document.createElement("tr");
  for (const [h, , align] of COLUMNS)
    head.append(cell("th", h, { textAlign: align, fontWeight: "600", borderBottom: "1px solid var(--border-color, #4e4e4e)" }));
  t.append(head);
  plan.segments.forEach((s) => {
    const where = s.resident ? "resident" : isIdle(s) ? "idle" : "streamed";
    const row = document.createElement("tr");
    row.dataset.where = where;
    const bytes = (v) => (v == null ? "—" : fmtBytes(Number(v)));
    [null, where, bytes(s.weight_bytes), bytes(s.activation_bytes), bytes(s.peak_bytes)].forEach((v, k) =>
      row.append(k === 0 ? nameCell(s.name) : cell("td", v, { textAlign: COLUMNS[k][2], whiteSpace: "nowrap" })));
    t.append(row);
  });
  return t;
}

/** Fill `el` with the payload's table (a short text without one). */
export function fillTable(el, payload) {
  el.replaceChildren();
  if (!payload) {
    el.append(line("No plan yet: queue the workflow."));
    return;
  }
  if (payload.message) el.append(line(`! ${payload.message}`, { fontWeight: "600", marginBottom: "4px" }));
  if (!payload.models.length && !payload.message) el.append(line("No model connected."));
  payload.models.forEach((m, idx) => {
    const block = document.createElement("div");
    block.className = "vramcut-plan-table-model";
    if (idx) Object.assign(block.style, { marginTop: "8px", paddingTop: "6px", borderTop: "1px solid var(--border-color, #4e4e4e)" });
    block.append(line(m.label, { fontWeight: "700" }));
    const refused = refusalFor(payload, m);
    block.append(line(answer(m, payload.budget_bytes, refused).line));
    if (refused) {
      // the plan drawn before the run does not answer any more: the refusal does
      block.append(line(refused.message, { color: "var(--descrip-text, #999)" }));
      el.append(block);
      return;
    }
    block.append(line(`${blockCount(m.plan)} in ${segmentCounts(m.plan)}`, { color: "var(--descrip-text, #999)" }));
    block.append(segmentTable(m.plan));
    // Python's summary: the lines after its own fixed-width table (which the rows above replace)
    const text = String(m.text || "");
    const cut = text.indexOf("\n\n");
    for (const l of (cut >= 0 ? text.slice(cut + 2) : "").split("\n").filter(Boolean))
      block.append(line(l, { color: "var(--descrip-text, #999)" }));
    const load = loadLine(m);  // under max_ram_gb, once the blocks moved: what the load cost
    if (load) block.append(line(load.text, { color: "var(--descrip-text, #999)" }));
    if (m.traced_at) block.append(line(`traced at ${m.traced_at} (a dry run: nothing has run yet)`, { color: "var(--descrip-text, #999)" }));
    else if (m.inputs) block.append(line(`measured at ${m.inputs}`, { color: "var(--descrip-text, #999)" }));
    el.append(block);
  });
}
