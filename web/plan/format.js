// Words and numbers: how the plan's figures read on the node, in its tooltips and its table.
//
// Owns the byte / GiB / time formats, the answer line ("fits · 0.210 / 0.300 GiB (70 %) · 5 of 7
// blocks streamed · +12 ms / call"), the cost tooltip, the counts and the fix for a budget that is
// too small. One vocabulary (the README's): a block is where the model is cut, a part a piece of
// a block cut finer, a segment blocks or parts kept or copied together, a copy one segment sent
// to the device, a call one forward of the model; budgets and needs at the widget's three
// decimals. Rule: every figure shown is one Python sent (plan.cost from vramcut_core/planning/report.py
// cost_to_json), only formatted here; pure functions, nothing done at import (ComfyUI also loads
// this file on its own as an extension script).

import { asArray, isIdle, isStreamed, unitCount } from "./payload.js";

const KIB = 1024;
const MIB = 1024 ** 2;
const GIB = 1024 ** 3;

/** Bytes as Python writes them (model/tensors.py fmt_bytes), so that the table, drawn from
 * Python's text, and the tooltips read the same figure the same way. */
export function fmtBytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "—";
  const a = Math.abs(n);
  if (a >= GIB) return `${(n / GIB).toFixed(2)} GiB`;
  if (a >= MIB) return `${(n / MIB).toFixed(1)} MiB`;
  if (a >= KIB) return `${(n / KIB).toFixed(1)} KiB`;
  return `${n} B`;
}

/** GiB as the max_vram_gb widget speaks it: three decimals. */
export function gib(n, digits = 3) {
  if (n === null || n === undefined || !Number.isFinite(Number(n))) return "—";
  return (Number(n) / GIB).toFixed(digits);
}

/** A max_vram_gb that holds `bytes`, written as Python's messages write it (plan.py gib_text:
 * rounded up at the widget's 0.001 GiB, at least 0.001), so the node and the error text name
 * the same number, and entering it gives at least `bytes`. */
export function gibText(bytes) {
  let k = Math.max(1, Math.ceil(Number(bytes) / GIB / 0.001 - 1e-9));
  while (Math.floor(Number((k * 0.001).toFixed(3)) * GIB) < Number(bytes)) k += 1;
  return (k * 0.001).toFixed(3);
}

function pct(a, b) {
  return b > 0 ? `${Math.round((100 * a) / b)} %` : "—";
}

export function fmtSeconds(s) {
  if (s === null || s === undefined || !Number.isFinite(Number(s))) return "?";
  s = Number(s);
  if (s >= 10) return `${s.toFixed(0)} s`;
  if (s >= 0.095) return `${s.toFixed(2)} s`;
  if (s >= 0.0005) return `${(s * 1000).toFixed(s >= 0.01 ? 0 : 1)} ms`;
  return "0 s";
}

const plural = (n, one, many) => `${n} ${n === 1 ? one : many}`;

/** "3 copies": a copy is one streamed segment sent to the device. */
export function copies(n) {
  return plural(n, "copy", "copies");
}

/** The block a unit belongs to: a unit of a block cut finer (the plan's `split`) is a part of it. */
function blockOf(unit, split) {
  return split.filter((b) => String(unit).startsWith(`${b}.`)).sort((a, b) => a.length - b.length)[0] ?? String(unit);
}

/** "27 blocks" or "27 blocks (cut into 112 parts)": what the model is cut into, in the node's words. */
export function blockCount(plan) {
  const units = plan.segments.flatMap((s) => asArray(s.units));
  const split = asArray(plan.split);
  const blocks = new Set(units.map((u) => blockOf(u, split))).size;
  const parted = units.some((u) => blockOf(u, split) !== String(u));
  return parted ? `${plural(blocks, "block", "blocks")} (cut into ${units.length} parts)` : plural(blocks, "block", "blocks");
}

/** A segment's contents in the node's words: "3 blocks", "1 block in 4 parts". */
export function segmentContents(plan, seg) {
  const units = asArray(seg.units);
  const split = asArray(plan.split);
  const blocks = new Set(units.map((u) => blockOf(u, split))).size;
  const parted = units.some((u) => blockOf(u, split) !== String(u));
  return parted ? `${plural(blocks, "block", "blocks")} in ${plural(units.length, "part", "parts")}`
    : plural(blocks, "block", "blocks");
}

/** "1 resident · 3 streamed · 9 idle segments": the chart's and the table's one count, from the
 * flags Python sent on each segment. */
export function segmentCounts(plan) {
  const segs = plan.segments;
  const nIdle = segs.filter(isIdle).length;
  return `${segs.filter((s) => s.resident).length} resident · ${segs.filter(isStreamed).length} streamed` +
    (nIdle ? ` · ${nIdle} idle` : "") + " segments";
}

/** "double_blocks.0 … double_blocks.15" -> "double_blocks.0…15" */
export function shortSegmentName(name) {
  const parts = String(name).split(" … ");
  if (parts.length !== 2) return String(name);
  const [a, b] = parts;
  const cut = a.lastIndexOf(".") + 1;
  if (cut > 0 && b.startsWith(a.slice(0, cut))) return `${a}…${b.slice(cut)}`;
  return `${a}…${b}`;
}

/** The dotted prefix every segment name of a model shares ("joint_blocks."), or "". */
export function sharedPrefix(names) {
  if (names.length < 2) return "";
  let p = names[0];
  for (const n of names) while (p && !n.startsWith(p)) p = p.slice(0, -1);
  const cut = p.lastIndexOf(".") + 1;
  return cut > 0 ? p.slice(0, cut) : "";
}

/**
 * The answer to "will it fit, and what does it cost?" for one model, from the figures Python
 * sent (plan.cost; older payloads without it get the counts from the segments, and no time).
 * Returns the parts, so the line can be drawn with the verdict coloured, and short forms.
 */
export function answer(m, payloadBudget, refused = null) {
  const plan = m.plan;
  if (refused) return refusedAnswer(m, payloadBudget, refused);
  const c = plan.cost ?? {};
  const budget = Number(plan.budget_bytes ?? payloadBudget ?? 0);
  const peak = Number(plan.peak_bytes ?? 0);
  const fits = c.fits ?? (budget > 0 && peak <= budget);
  const lower = c.peak_is_lower_bound ?? plan.activation_reserve_bytes == null;
  const blocks = Number.isFinite(c.blocks) ? c.blocks : unitCount(plan);
  const streamedBlocks = Number.isFinite(c.blocks_streamed) ? c.blocks_streamed
    : plan.segments.filter(isStreamed).reduce((n, s) => n + asArray(s.units).length, 0);
  const verdict = fits ? "fits" : "over budget";
  const vram = `${lower ? "≥" : ""}${gib(peak)} / ${gib(budget)} GiB (${pct(peak, budget)})`;
  const stream = streamedBlocks > 0 ? `${streamedBlocks} of ${blocks} blocks streamed` : `all ${blocks} blocks resident`;
  const source = c.added_source ?? null;
  // one badge per plan: a measured plan whose time is only estimated says so without the word
  // "estimate" beside its "measured" badge (the tooltip gives the estimate)
  const timeMeasured = source === "measured";
  let time;
  if (streamedBlocks === 0 && (source === null || source === "estimate")) time = "+0 s / call";
  else if (timeMeasured) time = `+${fmtSeconds(c.added_s_per_forward)} / call`;
  else if (source === "estimate" && m.stage !== "measured") time = `+${fmtSeconds(c.added_s_per_forward)} / call (estimate)`;
  else time = "time not measured";
  const short = `${verdict} ${pct(peak, budget)} · ${timeMeasured || (source === "estimate" && m.stage !== "measured")
    ? `+${fmtSeconds(c.added_s_per_forward)}/call` : stream}`;
  // the time line under the answer says what the plan is predicted (then measured) to take
  if (m.time) time = null;
  if (plan.devices?.length) return devicesAnswer(m, c, time, source);
  const disk = diskAnswer(m.tiers);
  const line = [verdict, vram, stream, disk, time].filter(Boolean).join(" · ");
  return { fits, verdict, vram, stream, disk, time, source, short, line };
}

/** Under max_ram_gb: the bytes read from disk per call and their predicted time (the plan's
 * tiers: blocks on disk, read at the disk's measured rate); null without a RAM budget. */
function diskAnswer(t) {
  if (!t) return null;
  const b = Number(t.disk_bytes_per_call ?? 0);
  if (!(b > 0)) return "nothing from disk";
  const s = t.disk_s_per_call;
  return `${fmtBytes(b)} from disk / call ` +
    (s === null || s === undefined ? "(disk rate not measured)" : `(+${fmtSeconds(s)} predicted)`);
}

/** The answer across devices: fits (every device within its own budget, Python's verdict), the
 * peak of each device against its budget, the bytes streamed from host memory per call and the
 * hops per call (the activations crossing from one device to the next). */
function devicesAnswer(m, c, time, source) {
  const plan = m.plan;
  const fits = c.fits ?? plan.devices.every((d) => Number(d.peak_bytes) <= Number(d.budget_bytes));
  const verdict = fits ? "fits" : "over budget";
  const vram = "peak " + plan.devices.map((d) => `${d.device} ${gib(d.peak_bytes)}/${gib(d.budget_bytes)} GiB`).join(", ");
  const sbytes = Number(c.streamed_bytes_per_forward ?? plan.streamed_bytes_per_forward ?? 0);
  const stream = sbytes > 0 ? `${fmtBytes(sbytes)} streamed per call` : "nothing streamed";
  const nHops = Number(c.hops_per_call ?? plan.hops_per_call ?? plan.hops.length);
  const hops = `${nHops} hop${nHops === 1 ? "" : "s"} per call`;
  const over = plan.devices.filter((d) => Number(d.peak_bytes) > Number(d.budget_bytes)).map((d) => d.device);
  const short = `${verdict} on ${plan.devices.length} devices${over.length ? ` (${over.join(", ")})` : ""}`;
  const line = [verdict, vram, stream, hops, time].filter(Boolean).join(" · ");
  return { fits, verdict, vram, stream, hops, time, source, short, line };
}

/** The signed error of a prediction, as a share of the measured time ("+8 %", "−12 %"). */
function signedPct(x) {
  const p = Math.round(Math.abs(Number(x)) * 100);
  return `${Number(x) < 0 && p ? "−" : "+"}${p} %`;
}

/** The time line under the answer, from Python's figures (the node's "time", per call): before
 * a call "predicted +0.42 s / call (1.8× resident)"; after one "measured 1.23 s / call ·
 * predicted 1.10 s (−11 %)". null when nothing was predicted. */
export function timeLine(m) {
  const t = m.time;
  if (!t) return null;
  if (Number.isFinite(Number(t.measured_s)) && t.measured_s !== null) {
    const err = t.error === null || t.error === undefined ? "" : ` (${signedPct(t.error)})`;
    return {
      measured: true,
      text: `measured ${fmtSeconds(t.measured_s)} / call · predicted ${fmtSeconds(t.predicted_s)}${err}`,
      tip: `A call took ${fmtSeconds(t.measured_s)} (measured); the plan predicted ${fmtSeconds(t.predicted_s)}` +
        (t.error === null || t.error === undefined ? "." : `, off by ${signedPct(t.error)} of the measured time.`) +
        ` All resident it would take about ${fmtSeconds(t.resident_s)}.`,
    };
  }
  const ratio = Number.isFinite(Number(t.ratio)) && t.ratio !== null ? ` (${Number(t.ratio).toFixed(2)}× resident)` : "";
  const from = t.source === "measured" ? "block times measured on an earlier call" : "each block's operations counted in the dry run";
  return {
    measured: false,
    text: `predicted +${fmtSeconds(t.added_s)} / call${ratio}`,
    tip: `Predicted before running: ${fmtSeconds(t.predicted_s)} per call against ${fmtSeconds(t.resident_s)} with every ` +
      `block resident (${from}; copies hidden behind the compute they overlap).`,
  };
}

/** "re-planned: free VRAM fell to 5.00 GiB (was 8.00)": the engine planned again because free
 * VRAM moved (Python's "refit"); null otherwise. */
export function refitLine(m) {
  const r = m.refit;
  if (!r) return null;
  const now = Number(r.budget_bytes);
  const was = Number(r.previous_budget_bytes);
  const moved = Number.isFinite(was) && now > was ? "rose" : "fell";
  return {
    text: `re-planned: free VRAM ${moved} to ${gib(now)} GiB` + (Number.isFinite(was) ? ` (was ${gib(was)})` : ""),
    tip: r.reason ? String(r.reason) : "Free VRAM moved since the last plan: the budget followed it and the plan was made again.",
  };
}

/** The hops between devices: "cuda:0 → cuda:1 before double_blocks.9 (3.0 MiB)". */
export function hopTexts(plan) {
  return asArray(plan.hops).map((h) => `${h.src} → ${h.dst} before ${h.unit}, ${fmtBytes(Number(h.bytes))}`);
}

/** One device's row: its name and peak against its budget, and what its bar shows. */
export function deviceRow(d) {
  const peak = Number(d.peak_bytes ?? 0);
  const budget = Number(d.budget_bytes ?? 0);
  const copies = Number(d.copies_per_call ?? 0);
  const streamed = Number(d.streamed_bytes_per_call ?? 0);
  return {
    name: String(d.device),
    text: `${d.device} · ${gib(peak)} / ${gib(budget)} GiB · ` +
      (streamed > 0 ? `${fmtBytes(streamed)} streamed per call` : "nothing streamed"),
    tip: `${d.device}: peak ${gib(peak)} GiB of its ${gib(budget)} GiB budget: resident ${fmtBytes(Number(d.resident_bytes ?? 0))}, ` +
      `streaming window ${fmtBytes(Number(d.window_bytes ?? 0))}, activations ${fmtBytes(Number(d.activation_bytes ?? 0))}` +
      (copies > 0 ? `; ${fmtBytes(streamed)} copied from host memory in ${copies} cop${copies === 1 ? "y" : "ies"} per call.` : "."),
    fits: peak <= budget,
  };
}

/**
 * The refusal of a run (a budget error Python reported) as the model's state: the plan drawn
 * before the run no longer answers, the budget the error names does. `null` when the payload
 * holds no refusal. `need`: the smallest budget Python found (min_budget_bytes), else the one
 * block that alone does not fit (need_bytes), else null.
 */
export function refusal(payload) {
  if (!payload || !payload.enabled || !payload.message || payload.message_level === "notice") return null;
  const min = payload.min_budget_bytes ?? null;
  const need = min ?? payload.need_bytes ?? null;
  return { need, exact: min !== null, fix: budgetFix(payload), message: payload.message };
}

/** The refusal that concerns model `m`: Python marks the refused model (`refused`); a payload
 * that marks none (an error outside a model's call) concerns them all. */
export function refusalFor(payload, m) {
  const r = refusal(payload);
  if (!r) return null;
  if (!m.refused && payload.models.some((x) => x.refused)) return null;
  // the model's own smallest budget (the node's figure is the largest of them)
  const own = m.min_budget_bytes ?? m.need_bytes ?? null;
  return own ? { ...r, need: own, exact: m.min_budget_bytes !== null, message: m.message ?? r.message } : r;
}

function refusedAnswer(m, payloadBudget, r) {
  const budget = Number(m.plan.budget_bytes ?? payloadBudget ?? 0);
  const vram = r.need ? `needs ${r.exact ? "" : "> "}${gibText(r.need)} / ${gib(budget)} GiB` : `${gib(budget)} GiB refused`;
  const short = r.need ? `refused: needs ${gibText(r.need)} GiB` : "refused";
  return { fits: false, refused: true, verdict: "refused", vram, stream: "not run", time: "raise max_vram_gb",
    source: null, short, need: r.need, line: `refused · ${vram} · not run · raise max_vram_gb` };
}

export function costTip(m) {
  const c = m.plan.cost;
  if (!c) return "The added time is not known: this plan came from an older version.";
  const bw = c.bandwidth_bytes_per_s ? `${(c.bandwidth_bytes_per_s / GIB).toFixed(1)} GiB/s` : "not measured";
  const where = c.bandwidth_device === "cpu" ? "a memory copy on this CPU" : `host to ${c.bandwidth_device ?? "device"}`;
  const lines = [];
  const planned = Number.isFinite(c.transfers_per_forward)
    ? `The plan streams ${fmtBytes(c.streamed_bytes_per_forward)} per call in ${copies(c.transfers_per_forward)} (a copy is one streamed segment).`
    : null;
  if (c.added_source === "measured") {
    const n = c.measured_forwards;
    lines.push(`Measured over ${plural(n, "call", "calls")} after the measuring one: ` +
      `compute waited ${fmtSeconds(c.measured_s_per_forward)} per call for copies.`);
    if (Number.isFinite(c.measured_bytes_per_forward)) {
      const k = Math.round(c.measured_copies_per_forward * 10) / 10;
      lines.push(`Measured ${fmtBytes(c.measured_bytes_per_forward)} streamed per call in ${copies(k)} · ` +
        `copying ${fmtSeconds(c.measured_copy_s_per_forward)}, computing ${fmtSeconds(c.measured_compute_s_per_forward)}.`);
    }
    if (planned && c.streamed_bytes_per_forward > 0) lines.push(planned);
  } else if (!(c.streamed_bytes_per_forward > 0)) {
    lines.push("Nothing streams: every block that runs stays on the device, so streaming adds no time.");
  } else {
    const est = `${fmtBytes(c.streamed_bytes_per_forward)} streamed per call ÷ ${bw} = +${fmtSeconds(c.added_s_per_forward)} per call`;
    lines.push(m.stage === "measured" ? `Time not measured yet: ${est} by the bandwidth.` : `Estimate until a call runs the plan: ${est}.`);
    if (planned) lines.push(planned);
  }
  if (c.added_source !== "measured" && m.plan.stats?.forwards)
    lines.push("The first call only measured the shapes (every block through one slot, once per shape).");
  if (m.tiers) lines.push(...diskTip(m));
  if (m.kind === "MODEL")
    lines.push("A call is one run of the model through its blocks: with CFG above 1 a sampler step is usually one call of batch 2.");
  lines.push(`Bandwidth ${bw} (${where}, measured once on this machine).`);
  return lines.join("\n");
}

/** The answer's disk part explained: the blocks read from disk each call, at what rate, and
 * (after calls that ran the plan) what they read, measured. */
function diskTip(m) {
  const t = m.tiers;
  const b = Number(t.disk_bytes_per_call ?? 0);
  if (!(b > 0)) return ["Nothing is read from disk: every block that runs is on the device or in RAM."];
  const rate = t.disk_bytes_per_s ? `${(t.disk_bytes_per_s / 1e9).toFixed(2)} GB/s` : null;
  const out = [`Read from disk per call: ${fmtBytes(b)} (the blocks that do not fit max_ram_gb, every call)` +
    (rate ? `, +${fmtSeconds(t.disk_s_per_call)} predicted at ${rate} (this disk's cold reads, measured once).`
      : "; the disk's read rate is not measured yet.")];
  const st = m.plan.steady_stats;
  if (st?.forwards > 0 && Number.isFinite(Number(st.disk_bytes_read)))
    out.push(`Measured: ${fmtBytes(Number(st.disk_bytes_read) / st.forwards)} read from disk per call ` +
      `over ${plural(st.forwards, "call", "calls")} after the measuring one.`);
  return out;
}

/** The fix for a budget that is too small, from what the error carried: one number, the one
 * the error text names. */
export function budgetFix(payload) {
  if (payload.min_budget_bytes) {
    // Python says whether the number is the smallest budget that works or only a lower bound
    const to = payload.min_budget_exact ? "to" : "to at least";
    return `Set max_vram_gb ${to} ${gibText(payload.min_budget_bytes)}.`;
  }
  if (payload.need_bytes) return `Set max_vram_gb above ${gibText(payload.need_bytes)} (one block alone needs that).`;
  return null;
}
