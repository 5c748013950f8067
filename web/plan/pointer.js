// The plan hands its pointer events to LiteGraph, so it acts like the rest of the node: a
// right-click or a wheel on the plan acts on the node and the graph as anywhere else, and a
// left-button drag moves the node. The buttons and the table keep their own events.
// Rule: nothing happens at import (ComfyUI also loads this file on its own as an extension script).

import { hover } from "./tip.js";

/** Forward `view.el`'s pointer events to the graph's canvas (`view.app`: ComfyUI's app). The host
 * wraps the widget in an element that takes pointer events; LiteGraph treats a press on a widget
 * as the widget's, never as a node drag, so a left-button drag on the plan moves the node here. */
export function handPointerToGraph(view) {
  const forward = (e) => {
    const target = view.app.canvas?.canvas;
    if (!target || e.target.closest?.("button, .vramcut-plan-table")) return;
    if (e.type === "pointerdown" && e.button === 0) return dragNode(view, e);
    if (e.type === "wheel" || e.type === "contextmenu" || e.type === "pointerdown") e.preventDefault();
    e.stopPropagation();
    const Ctor = e.type === "wheel" ? WheelEvent : e.type.startsWith("pointer") ? PointerEvent : MouseEvent;
    target.dispatchEvent(new Ctor(e.type, e));
    if (e.type === "pointermove") hover(e);
  };
  for (const type of ["pointerdown", "pointermove", "pointerup", "contextmenu", "wheel"])
    view.el.addEventListener(type, forward, { passive: false });
}

/** Move the node with the pointer (selected and brought to the front, as LiteGraph does). */
function dragNode(view, e) {
  e.preventDefault();
  e.stopPropagation();
  const node = view.node;
  const lg = view.app.canvas;
  if (!lg) return;
  lg.selectNode?.(node, e.shiftKey || e.ctrlKey);
  lg.bringToFront?.(node);
  const scale = lg.ds?.scale || 1;
  const start = [e.clientX, e.clientY];
  const from = [node.pos[0], node.pos[1]];
  const el = view.el;
  try {
    el.setPointerCapture(e.pointerId);
  } catch {
    // a synthetic event has no pointer to capture: the moves still arrive while over the plan
  }
  const move = (ev) => {
    node.pos[0] = from[0] + (ev.clientX - start[0]) / scale;
    node.pos[1] = from[1] + (ev.clientY - start[1]) / scale;
    lg.setDirty?.(true, true);
    ev.stopPropagation();
  };
  const up = (ev) => {
    el.removeEventListener("pointermove", move, true);
    el.removeEventListener("pointerup", up, true);
    el.removeEventListener("pointercancel", up, true);
    try {
      el.releasePointerCapture(ev.pointerId);
    } catch {
      // already released
    }
    ev.stopPropagation();
    // the workflow changed like any node move (the change tracker sees it now, with an undo step)
    // (captureCanvasState on newer frontends, where checkState is deprecated)
    const ct = view.app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
    if (typeof ct?.captureCanvasState === "function") ct.captureCanvasState();
    else ct?.checkState?.();
  };
  el.addEventListener("pointermove", move, true);
  el.addEventListener("pointerup", up, true);
  el.addEventListener("pointercancel", up, true);
}
