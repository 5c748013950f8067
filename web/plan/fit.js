// Fitting the node around its plan: the one state machine that sizes a Max VRAM node.
//
// A NodeFit belongs to one PlanView (view.js), which asks it to fit when what it shows changed
// (a plan, the details, the table, a warning) and lets it look every frame until the host has
// laid the fit out. Rules: the node's height follows its content both ways, but only when the
// content's height changed (a height the user chose stays through every run that draws the same
// kind of plan), and a node's saved height is only ever grown (a plan restored into a loaded
// workflow grows a node too short to show it; opening and running a workflow changes nothing);
// nothing happens at import (ComfyUI also loads this file on its own as an extension script).

export const MARGIN = 6;             // px around the widget inside the node
export const MIN_NODE_WIDTH = 360;   // a new node's width (the plan reads whole at it)
const MIN_WIDGET_HEIGHT = 24;        // the node can be shrunk down to the header row
const LAYOUT_TRIES = 10;             // frames a fit waits for the host to lay out the last one
const RECHECK_MS = 250;              // a fit undone by the host is tried again after this

export class NodeFit {
  constructor(node, view) {
    this.node = node;
    this.view = view;
    this.wantContent = false; // while true, the widget's minimum is its content's height
    this.lastFit = null;      // {h, area} of the last size set, until the host lays it out
    this.settled = false;     // false while a fit is wanted and not yet seen on screen
    this.checked = null;      // {key, at}: the last time `check` asked for a fit again
    this.pending = null;      // a fit asked for before the widget was laid out
    this.fittedHeight = null; // the content height the node was last fitted to
    this.restorePending = false;
  }

  /** The content's height at the node's width now (before a change the user asks for). */
  contentHeightNow() {
    return this.view.contentHeight((this.node.size?.[0] ?? MIN_NODE_WIDTH) - 2 * MARGIN);
  }

  /** The widget's minimum height: no locked minimum (the node can be made as small as the
   * header), except while this code fits the node, when it is the content's height. */
  minHeight() {
    if (!this.wantContent) return MIN_WIDGET_HEIGHT;
    return this.view.contentHeight((this.node.size?.[0] ?? MIN_NODE_WIDTH) - 2 * MARGIN);
  }

  /** Size the node to its content: grown where it is too short, and with `shrink` made exactly
   * as tall. Mounted, the widget's own height says how much the node must change; before that
   * (or while the host has not laid out the last change yet) the node's computed size does. */
  fit({ shrink = false, tries = 0 } = {}) {
    const node = this.node;
    const view = this.view;
    if (node.flags?.collapsed) return;
    this.settled = false;
    const w = node.size[0]; // a new node starts at MIN_NODE_WIDTH; a width the user chose stays
    const area = view.el.clientHeight;
    if (area > 0 && this.lastFit && this.lastFit.h === node.size[1] && this.lastFit.area === area) {
      // the host has not laid out the last size yet: look again in a frame
      if (tries < LAYOUT_TRIES) {
        requestAnimationFrame(() => this.fit({ shrink, tries: tries + 1 }));
        return;
      }
    }
    this.lastFit = null;
    if (area === 0 && tries === 0) {
      this.pending = { shrink }; // not laid out yet: fitted on its first draw
      return;
    }
    let h;
    if (area > 0) {
      const need = view.contentHeight(view.el.clientWidth || w - 2 * MARGIN) - area;
      h = node.size[1] + (shrink ? need : Math.max(0, need));
    } else {
      this.wantContent = true;
      try {
        const min = node.computeSize();
        h = shrink ? min[1] : Math.max(node.size[1], min[1]);
      } finally {
        this.wantContent = false;
      }
    }
    if (Math.abs(w - node.size[0]) > 0.5 || Math.abs(h - node.size[1]) > 0.5) {
      node.setSize([w, h]);
      this.lastFit = { h: node.size[1], area };
    }
    node.setDirtyCanvas?.(true, true);
  }

  /** What the view shows changed: fit the node when the content's height changed since it was
   * last fitted, both ways (no empty band stays below shorter content). `restore`: a plan shown
   * again in a loaded workflow, which keeps its saved size unless that is too short to show it. */
  contentChanged({ restore = false, shown = null } = {}) {
    const h = this.view.contentHeight((this.node.size?.[0] ?? MIN_NODE_WIDTH) - 2 * MARGIN);
    // the user changed the view (details, table): the content shown until then counts as fitted,
    // so a shorter view shrinks the node even when this code never fitted it (a workflow loaded
    // again, as a tab switch does, keeps its saved height until then)
    if (shown !== null && this.fittedHeight === null && this.view.el.clientHeight + 1 >= shown) this.fittedHeight = shown;
    if (restore) {
      this.settled = true; // a loaded workflow keeps its saved size...
      const area = this.view.el.clientHeight;
      if (!area) {
        this.restorePending = true; // not laid out yet: looked at on its first draw
        return;
      }
      if (area + 1 < h) {
        this.fittedHeight = h;
        this.fit(); // ...unless the plan would be cut: then it grows, never shrinks
      } else {
        this.fittedHeight = null; // the saved height, not one fitted here (what the node showed before the plan came does not count)
      }
      return;
    }
    if (h === this.fittedHeight) return;
    // shorter than the content this code fitted: shrink (a saved node's own height, never fitted
    // here, only grows: opening and running a workflow leaves it as saved)
    const shrink = this.fittedHeight !== null && h < this.fittedHeight;
    this.fittedHeight = h;
    this.fit({ shrink });
  }

  /** A loaded workflow keeps its saved size: nothing is fitted until its content changes. */
  settle() {
    this.settled = true;
  }

  /** The first draw of a widget that was not laid out when a fit was asked for. */
  drawn() {
    if (this.restorePending) {
      this.restorePending = false;
      this.contentChanged({ restore: true });
    }
    if (!this.pending) return;
    const how = this.pending;
    this.pending = null;
    this.fit({ ...how, tries: 1 });
  }

  /** Every frame: the host sizes a node again after a fit (a node added from the search box is
   * sized after our first fit; a plan can arrive before the last size is laid out): until the
   * plan area has been seen at its content's height, look again. */
  check() {
    const node = this.node;
    if (this.settled || node.flags?.collapsed) return;
    const area = this.view.el.clientHeight;
    // not laid out yet: no height, or one the node cannot hold (a first layout can measure the
    // element at the page's size)
    if (!area || area > node.size[1]) return;
    if (area + 1 >= this.view.contentHeight(this.view.el.clientWidth)) {
      this.settled = true;
      return;
    }
    // the last fit not laid out yet, or undone by the host (a node from the search box follows
    // the pointer as a "ghost" until placed, and is sized again): look again a little later
    const key = `${node.size[1]}|${area}`;
    if (key === this.checked?.key && performance.now() - this.checked.at < RECHECK_MS) return;
    this.checked = { key, at: performance.now() };
    this.fit();
  }
}
