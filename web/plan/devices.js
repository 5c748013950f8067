// The Devices node's own face: its reserve to the thousandth, and its message (a list this host
// cannot use, a reserve no device can leave free) said on the node, from the node's own output,
// where the host would otherwise show it only in its error panel. And on a Max VRAM node, whether
// a Devices node feeds it (its budgets then replace max_vram_gb and budget_mode).
// Rule: draw what Python sends; nothing happens at import (ComfyUI also loads this file on its
// own as an extension script).

import { COLORS, FONT_FALLBACK } from "./theme.js";

const MESSAGE_WIDGET = "vramcut_devices_message";
const GIB_WIDGETS = new Set(["max_vram_gb", "reserve_gb", "max_ram_gb"]);

/** Budgets step by 0.05 GiB and round to 0.001 GiB; the host shows (and keeps) as many decimals
 * as the step has, so 30.1234 read and stored 30.12: show and keep the three the rounding keeps. */
export function showThousandths(node) {
  for (const w of node.widgets ?? []) {
    if (!GIB_WIDGETS.has(w.name) || !w.options) continue;
    w.options.precision = 3;
  }
}

/** True when a Devices node feeds this Max VRAM node's `devices` input. */
export function devicesLinked(node) {
  const input = (node.inputs ?? []).find((i) => i.name === "devices");
  return input?.link !== null && input?.link !== undefined;
}

/** Gives a new Devices node its message line (a DOM widget, not saved with the workflow). */
export function attachDevicesMessage(node) {
  showThousandths(node);
  const el = document.createElement("div");
  el.className = "vramcut-devices-message";
  Object.assign(el.style, {
    display: "none", boxSizing: "border-box", padding: "4px 6px", borderRadius: "4px",
    font: `600 12px/1.35 ${FONT_FALLBACK}`, color: "var(--input-text, #ddd)", whiteSpace: "normal",
    overflowWrap: "anywhere", border: `1px solid ${COLORS.message}`, background: "rgba(239, 68, 68, 0.18)",
  });
  const widget = node.addDOMWidget(MESSAGE_WIDGET, "vramcut_devices_message", el, {
    serialize: false, hideOnZoom: false, getValue: () => "", setValue: () => {},
    getMinHeight: () => (el.style.display === "none" ? 0 : el.scrollHeight + 4),
  });
  widget.serialize = false;
  node.vramcutDevicesMessage = el;
  return el;
}

/** The node's output arrived: its message shown (or, none, hidden) and the node sized to it. */
export function showDevicesMessage(node, ui) {
  const el = node.vramcutDevicesMessage;
  if (!el) return;
  const message = ui?.message ? String(ui.message) : "";
  el.textContent = message;
  el.style.display = message ? "block" : "none";
  el.dataset.message = message;
  requestAnimationFrame(() => {
    const size = node.computeSize?.();
    if (size) node.setSize([Math.max(node.size[0], size[0]), size[1]]);
    node.setDirtyCanvas?.(true, true);
  });
}
