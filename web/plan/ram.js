// Host RAM beside VRAM: under max_ram_gb, where each block's host copy is (the plan's "tiers":
// on the device, a flat copy in RAM, or read from disk every call), drawn as a row and a bar
// against the RAM budget, and what the model's load cost in host memory (measured when the
// blocks left RAM).
//
// Rule: draw Python's figures (vramcut_core/planning/tiers.py tiers_to_json, the runtime's
// "load"), never recompute the plan; the words and sizes are the table's (Python's tiers_text
// writes sizes as fmtBytes does); nothing done at import (ComfyUI also loads this file on its own
// as an extension script).

import { fmtBytes, fmtSeconds, gib } from "./format.js";
import { COLORS } from "./theme.js";
import { paintTrack, wrapText } from "./pen.js";

const n = (v) => Math.max(0, Number(v) || 0);

/** "3 blocks" (or "3 parts" where blocks were cut finer: the counts are the plan's units). */
function count(k, plan) {
  const word = plan.split?.length ? "part" : "block";
  return `${k} ${word}${k === 1 ? "" : "s"}`;
}

/** The RAM row's figures from the tiers: bytes in RAM (flat copies), the bounce buffer, the
 * streamed blocks' bytes left on disk, the resident blocks' bytes read once from their file. */
function figures(t) {
  return {
    budget: n(t.ram_budget_bytes), ram: n(t.ram_bytes), bounce: n(t.bounce_bytes),
    host: n(t.host_bytes ?? n(t.ram_bytes) + n(t.bounce_bytes)),
    disk: Math.max(0, n(t.disk_bytes) - n(t.resident_disk_bytes)), residentDisk: n(t.resident_disk_bytes),
    perCall: n(t.disk_bytes_per_call), units: t.units ?? {},
  };
}

/** The row above the RAM bar: "RAM 0.017 / 0.020 GiB: 2 blocks on the device, 3 in RAM, 2 on
 * disk", and the bar's tooltip (the same sizes as the table's line). */
export function ramRow(m) {
  const t = m.tiers;
  const f = figures(t);
  const c = f.units;
  const text = `RAM ${gib(f.host)} / ${gib(f.budget)} GiB: ${count(n(c.device), m.plan)} on the device, ` +
    `${n(c.ram)} in RAM, ${n(c.disk)} on disk`;
  const load = t.load;
  const locked = load ? `, ${fmtBytes(n(load.page_locked_bytes))} of them page-locked` +
      (n(load.page_locked_bytes) ? " (underlined)" : "")
    : ", page-locked where the limit allows (measured after the first call)";
  const rate = t.disk_bytes_per_s ? ` at ${(t.disk_bytes_per_s / 1e9).toFixed(2)} GB/s` : "";
  const tip = [
    `RAM ${gib(f.host)} GiB of max_ram_gb ${gib(f.budget)} GiB (the line).`,
    `In RAM: ${fmtBytes(f.ram)}, the flat copies of ${count(n(c.ram), m.plan)}${locked}.`,
    f.bounce ? `Bounce buffer: ${fmtBytes(f.bounce)} (page-locked; the blocks read from disk pass through it to the GPU).`
      : "No bounce buffer: on the CPU the blocks read from disk go straight to where they run.",
    f.perCall ? `On disk (beyond the line): ${fmtBytes(f.disk)}, ${count(n(c.disk), m.plan)} read every call: ` +
      `${fmtBytes(f.perCall)} per call, ` +
      (t.disk_s_per_call == null ? "the disk's read rate not measured yet." : `+${fmtSeconds(t.disk_s_per_call)} predicted${rate}.`)
      : "Nothing is read from disk per call.",
    f.residentDisk ? `The ${count(n(c.device), m.plan)} on the device are read once from their file (${fmtBytes(f.residentDisk)}).` : null,
  ];
  const l = loadLine(m);
  if (l) tip.push(l.tip);
  return { text, tip: tip.filter(Boolean).join("\n"), f };
}

/** What the model's load cost in host memory, measured when its blocks left RAM (the first
 * call under max_ram_gb); null before. */
export function loadLine(m) {
  const load = m.tiers?.load;
  if (!load) return null;
  const mapped = n(load.mapped_bytes);
  const cached = n(load.cached_bytes);
  const released = load.released_bytes == null ? null : n(load.released_bytes);
  const parts = [];
  const tip = ["The load, measured when the blocks left RAM:"];
  if (mapped) {
    parts.push(`${fmtBytes(mapped)} read from the checkpoint`);
    tip.push(`${fmtBytes(mapped)} are read from the checkpoint the host mapped when it loaded the model: ` +
      "no copy in RAM (the kernel may drop the file's pages under pressure).");
  }
  if (cached) {
    parts.push(`${fmtBytes(cached)} the host held in RAM, cached in ${fmtSeconds(load.write_s)}`);
    tip.push(`${fmtBytes(cached)} were in RAM as the host loaded them (its loader read them in or converted them): ` +
      `written once to VRAMCut's cache file in ${fmtSeconds(load.write_s)}, then dropped.`);
  }
  if (released !== null) {
    parts.push(`RAM −${fmtBytes(released)}`);
    tip.push(`The process's RAM fell by ${fmtBytes(released)} while the blocks left it (measured; less where ` +
      "something else still holds the host's copy).");
  }
  tip.push(`Moving them took ${fmtSeconds(load.move_s)}.`);
  return { text: `load: ${parts.join(" · ") || "nothing moved"}`, tip: tip.join("\n") };
}

/** The RAM row and bar under the VRAM bar: flat copies in RAM and the bounce buffer against
 * max_ram_gb (the line), the blocks on disk beyond it; with the details, the load line. */
export function drawRam(pen, m, details) {
  const { ctx, W, theme } = pen;
  const row = ramRow(m);
  const f = row.f;
  const top = pen.y;
  ctx.font = pen.font(12, 500);
  for (const l of wrapText(ctx, row.text, W, 3)) {
    pen.text(l, 0, pen.y + 8, f.host > f.budget ? COLORS.over : theme.fg, pen.font(12, 500), "left", null, "ram");
    pen.y += 16;
  }
  const barH = 10;
  const edge = Math.max(f.budget, f.host, 1);
  const scale = edge + f.disk;
  const bx = (b) => (b / scale) * W;
  pen.y += 3;
  const y = pen.y;
  paintTrack(pen, y, bx(f.budget), barH);
  pen.rect(0, y + 1, bx(f.ram), barH - 2, COLORS.ram);
  // the page-locked part of the flat copies (measured once they were made), underlined
  const locked = Math.min(f.ram, n(m.tiers.load?.page_locked_bytes));
  if (locked) pen.rect(0, y + barH - 3, bx(locked), 2, theme.strong);
  pen.rect(bx(f.ram), y + 1, bx(f.bounce), barH - 2, COLORS.bounce);
  if (f.disk) pen.rect(bx(edge) + 2, y + 1, Math.max(1, bx(f.disk) - 2), barH - 2, COLORS.disk);
  const lx = Math.min(W - 1, Math.max(1, bx(f.budget)));
  pen.rect(lx - 1, y - 3, 2, barH + 6, theme.strong);
  pen.y += barH + 5;
  pen.tip(0, top, W, pen.y - top, row.tip);
  const l = details ? loadLine(m) : null;
  if (!l) return;
  const at = pen.y;
  ctx.font = pen.font(12);
  for (const s of wrapText(ctx, l.text, W, 4)) {
    pen.text(s, 0, pen.y + 8, theme.muted, pen.font(12), "left", null, "load");
    pen.y += 16;
  }
  pen.tip(0, at, W, pen.y - at, l.tip);
  pen.y += 1;
}
