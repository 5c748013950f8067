// What every plan on the page shares: the one styled tooltip, the hover that finds the plan under
// the pointer, and the palette watch that redraws plans whose colours no longer match.
// Rule: nothing happens at import (ComfyUI also loads this file on its own as an extension
// script): the listeners start in `watchPage()`, called once by the extension.

import { FONT_FALLBACK } from "./theme.js";

// One small styled tooltip for every plan on the page (a canvas `title` would be a raw dump in
// the browser's own font).
let tipEl = null;

function tooltip() {
  if (tipEl) return tipEl;
  tipEl = document.createElement("div");
  tipEl.className = "vramcut-tip";
  Object.assign(tipEl.style, {
    position: "fixed", zIndex: "10000", pointerEvents: "none", display: "none", maxWidth: "320px",
    padding: "6px 9px", borderRadius: "6px", whiteSpace: "pre-line",
    font: `500 12px/1.4 ${FONT_FALLBACK}`, color: "var(--fg-color, #eee)",
    background: "var(--comfy-menu-bg, #2b2b2b)", border: "1px solid var(--border-color, #4e4e4e)",
    boxShadow: "0 4px 14px rgba(0, 0, 0, 0.35)",
  });
  document.body.append(tipEl);
  return tipEl;
}

function showTip(text, clientX, clientY) {
  const t = tooltip();
  if (!text) {
    t.style.display = "none";
    return;
  }
  if (t.textContent !== text) t.textContent = text;
  t.style.display = "block";
  const r = t.getBoundingClientRect();
  const x = Math.min(clientX + 14, window.innerWidth - r.width - 6);
  const y = clientY + 18 + r.height > window.innerHeight ? clientY - r.height - 10 : clientY + 18;
  t.style.left = `${Math.max(4, x)}px`;
  t.style.top = `${Math.max(4, y)}px`;
}

// Hover is followed from the window (the plan hands its own pointer events to LiteGraph).
export const views = new Set();
let tipOwner = null;
export function hover(e) {
  let hit = null;
  for (const v of views) {
    const tip = v.tipAt(e.clientX, e.clientY);
    if (tip !== null) {
      hit = [v, tip];
      break;
    }
  }
  if (hit) {
    tipOwner = hit[0];
    showTip(hit[1], e.clientX, e.clientY);
  } else if (tipOwner) {
    tipOwner = null;
    showTip(null);
  }
}

// A palette switch changes the page's CSS variables (a class on <html>, its style, or a style
// sheet): redraw every plan whose colours no longer match, without waiting for the next plan.
let themeCheck = 0;
function onThemeMaybeChanged() {
  if (themeCheck) return;
  themeCheck = requestAnimationFrame(() => {
    themeCheck = 0;
    for (const v of views) v.checkTheme();
  });
}

let watching = false;

/** Start the page-wide listeners the plans share (hover, palette switches); once per page. */
export function watchPage() {
  if (watching) return;
  watching = true;
  window.addEventListener("pointermove", hover, { passive: true });
  new MutationObserver(onThemeMaybeChanged).observe(document.documentElement, { attributes: true, attributeFilter: ["class", "style"] });
  new MutationObserver(onThemeMaybeChanged).observe(document.head, { childList: true, subtree: true, characterData: true });
  window.addEventListener("pointerdown", () => tipOwner && showTip(null), { passive: true, capture: true });
}

/** A view goes away: it is no longer hovered, and its tooltip (if shown) goes with it. */
export function forgetView(view) {
  views.delete(view);
  if (tipOwner === view) showTip(null);
}
