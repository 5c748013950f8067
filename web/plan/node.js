// What the plan says about the node itself: the answer a collapsed node carries in its title
// (drawn on the canvas, and in Nodes 2.0's page header), and the outputs that lead nowhere.
//
// Rule: these read the node and its graph and draw; they never recompute the plan, and nothing
// happens at import (ComfyUI also loads this file on its own as an extension script).

import { answer, gibText, refusal, refusalFor } from "./format.js";
import { COLORS, readTheme } from "./theme.js";
import { fitText } from "./pen.js";

/**
 * Names of the outputs whose model is used elsewhere unpatched: the matching input is connected,
 * its source also feeds other nodes, and this node's output leads nowhere (the plan never
 * applies). A node that is the model's only user is a preview (the plan-preview example), and a
 * node with VRAMCut off patches nothing: neither is warned.
 */
export function unusedOutputs(node) {
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

/** The answer a collapsed node shows after its title (" · fits 70 % · +12 ms/call", or for a
 * refusal the one budget that makes every connected model fit), and its colour; null when the
 * node is open or has no plan. */
export function collapsedAnswer(node) {
  const p = node.flags?.collapsed ? node.vramcutView?.payload : null;
  if (!p?.models?.length) return null;
  const theme = readTheme(node.vramcutView.el);
  const r = refusal(p);
  if (r && p.models.some((m) => refusalFor(p, m))) {
    // the banner's number, not the first model's: it holds every model
    return { text: r.need ? ` · refused: set ${gibText(r.need)}` : " · refused", color: COLORS.over };
  }
  const a = answer(p.models[0], p.budget_bytes, refusalFor(p, p.models[0]));
  const more = p.models.length > 1 ? ` +${p.models.length - 1}` : "";
  return { text: ` · ${a.short}${more}`, color: a.fits ? theme.fits : COLORS.over };
}

/** The node's name in `room` px: whole, else without its "(VRAMCut)" tag, else cut. */
function nameIn(ctx, title, room) {
  if (ctx.measureText(title).width <= room) return title;
  const bare = title.replace(/\s*\([^)]*\)\s*$/, "");
  if (bare && ctx.measureText(bare).width <= room) return bare;
  return fitText(ctx, bare || title, room);
}

/** The title a collapsed node is sized by (the host sizes it by `getTitle()`): the name without
 * its "(VRAMCut)" tag and the answer, so neither is cut. */
export function collapsedTitle(node, title) {
  const tail = collapsedAnswer(node);
  if (!tail) return title;
  return `${String(title).replace(/\s*\([^)]*\)\s*$/, "") || title}${tail.text}`;
}

/** Draws a collapsed node's header text: the host draws only the first 20 characters of a
 * collapsed title, so the name (whole, or without its tag) and then the answer in its verdict's
 * colour are drawn here. Returns false where the host's own drawing should run. */
export function drawCollapsedTitle(node, ctx, opts) {
  const tail = collapsedAnswer(node);
  const LiteGraph = globalThis.LiteGraph;
  if (!tail || !LiteGraph || node.onDrawTitleText || opts?.low_quality || !ctx) return false;
  const th = opts?.title_height ?? LiteGraph.NODE_TITLE_HEIGHT;
  const room = (node._collapsed_width || node.size[0]) - 2 * th;
  ctx.save();
  ctx.textAlign = "left";
  // the host sizes a collapsed node by its title in the node's inner font: where the title
  // font does not fit that width, the inner one does
  ctx.font = node.titleFontStyle;
  if (ctx.measureText(node.getTitle()).width > room + 0.5 && node.innerFontStyle) ctx.font = node.innerFontStyle;
  const tailW = ctx.measureText(tail.text).width;
  const name = nameIn(ctx, String(node.title || node.constructor.title || ""), room - tailW);
  const y = LiteGraph.NODE_TITLE_TEXT_Y - th;
  ctx.fillStyle = node.selected ? LiteGraph.NODE_SELECTED_TITLE_COLOR
    : node.constructor.title_text_color || opts?.default_title_color || "#999";
  ctx.fillText(name, th, y);
  ctx.fillStyle = tail.color;
  ctx.fillText(tail.text, th + ctx.measureText(name).width, y);
  ctx.restore();
  node.vramcutCollapsedText = name + tail.text; // what the header shows (the tests read it)
  return true;
}

/** Nodes 2.0 draws a node's header in the page (a Vue component showing the title only): the
 * answer of a collapsed node goes in beside the title there. Until the header is mounted (a
 * collapse or a load re-renders it) it is looked for again, a few frames at most. */
export function syncVueHeader(node, tries = 0) {
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
