"""The nodes are V3 (``comfy_api.latest``) and keep the contract saved workflows were made with.

``data/node_info_v1_main.json`` is what ``/object_info`` served for the two V1 node classes
before the move (ComfyUI 0.33.0). Saved workflows depend on the node ids, the input names and
their order (``widgets_values`` is positional), the types, the defaults and ranges, and the
output order; the frontend also shows the tooltips and names. All of it must be unchanged.
"""
from __future__ import annotations

import json
import os

import pytest

from pack_nodes import node_classes

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
EXAMPLES = os.path.join(REPO, "example_workflows")
NODE_IDS = ("VRAMCutMaxVRAM", "VRAMCutMaxVRAMExtras")
SHAPE_ID = "VRAMCutPreviewShape"  # added after the V1 classes: no saved contract before it
DEVICES_ID = "VRAMCutDevices"     # likewise
# inputs appended after the saved ones (optional: a saved workflow loads without them)
APPENDED = [("preview_shape", "VRAMCUT_SHAPE"), ("devices", "VRAMCUT_DEVICES"), ("max_ram_gb", "FLOAT")]

with open(os.path.join(HERE, "data", "node_info_v1_main.json"), encoding="utf-8") as f:
    MAIN = json.load(f)


def _served(pack, node_id) -> dict:
    """What ``/object_info`` serves for a V3 node (server.py calls this for V3 classes)."""
    return node_classes(pack)[node_id].GET_NODE_INFO_V1()


def _normalised_inputs(info) -> dict:
    """``{section: [(name, type, options)]}`` for the inputs a workflow saves; a combo written as
    V1 (``[[choices], {...}]``) and as V3 (``["COMBO", {"options": [choices], ...}]``) alike: the
    frontend reads both the same way."""
    out = {}
    for section in ("required", "optional"):
        rows = []
        for name, spec in info["input"].get(section, {}).items():
            spec = list(spec) if isinstance(spec, (list, tuple)) else [spec]
            kind, opts = spec[0], dict(spec[1]) if len(spec) > 1 else {}
            if isinstance(kind, list):
                kind, opts = "COMBO", {"options": kind, **opts}
            if kind == "COMBO" and opts.get("multiselect") is False:
                del opts["multiselect"]  # V3 spells out the V1 default (newer hosts)
            rows.append((name, kind, opts))
        out[section] = rows
    return out


def test_the_pack_registers_through_the_v3_entry_point_only(pack):
    from comfy_api.latest import io

    assert callable(pack.comfy_entrypoint)
    # ComfyUI reads V1 mappings first and would then ignore the entry point
    assert getattr(pack, "NODE_CLASS_MAPPINGS", None) is None
    classes = node_classes(pack)
    assert sorted(classes) == sorted(NODE_IDS + (SHAPE_ID, DEVICES_ID))
    for cls in classes.values():
        assert issubclass(cls, io.ComfyNode)


@pytest.mark.parametrize("node_id", NODE_IDS)
def test_the_served_node_info_is_the_one_saved_workflows_were_made_with(pack, node_id):
    old, new = MAIN[node_id], _served(pack, node_id)
    saved, served = _normalised_inputs(old), _normalised_inputs(new)
    assert served["required"] == saved["required"]
    n = len(saved["optional"])
    assert served["optional"][:n] == saved["optional"]  # the saved inputs, unchanged and in place
    assert [(name, kind) for name, kind, _ in served["optional"][n:]] == APPENDED
    # hidden inputs are not saved in workflows; V3 adds prompt and extra_pnginfo to output nodes
    # (V1 wrote a hidden input as a string, V3 as a one-element tuple)
    first = lambda v: v if isinstance(v, str) else v[0]  # noqa: E731
    assert first(new["input"]["hidden"]["unique_id"]) == first(old["input"]["hidden"]["unique_id"])
    assert new["input_order"]["required"] == old["input_order"]["required"]
    assert new["input_order"]["optional"] == old["input_order"]["optional"] + [a for a, _ in APPENDED]
    for key in ("name", "display_name", "category", "description", "output_node", "output",
                "output_name", "output_is_list", "output_tooltips"):
        as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731  (JSON has no tuples)
        assert as_list(new[key]) == as_list(old[key]), key


@pytest.mark.parametrize("node_id", NODE_IDS + (SHAPE_ID, DEVICES_ID))
def test_every_input_has_a_tooltip(pack, node_id):
    info = _served(pack, node_id)
    for section in ("required", "optional"):
        for name, spec in info["input"].get(section, {}).items():
            assert spec[1].get("tooltip"), f"{node_id}.{name} has no tooltip"


def _widget_value_ok(kind, opts, value) -> bool:
    if kind == "COMBO":
        return value in opts["options"]
    if kind == "BOOLEAN":
        return isinstance(value, bool)
    if kind == "FLOAT":
        return isinstance(value, (int, float)) and opts["min"] <= value <= opts["max"]
    return False


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".json")))
def test_example_workflows_map_onto_the_v3_schema(pack, name):
    """Each saved node's widget values land on the same inputs, its links on inputs of the same
    name and type, and its outputs keep their order (what the frontend does when it loads it)."""
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
        wf = json.load(f)
    ours = [n for n in wf["nodes"] if n["type"] in NODE_IDS]
    assert ours
    for node in ours:
        info = _normalised_inputs(_served(pack, node["type"]))
        # the frontend saves a widget for every primitive input, the optional ones after the required
        widgets = info["required"] + [w for w in info["optional"] if w[1] in ("FLOAT", "INT", "BOOLEAN", "STRING")]
        assert len(node["widgets_values"]) == len(widgets)
        for (wname, kind, opts), value in zip(widgets, node["widgets_values"]):
            assert _widget_value_ok(kind, opts, value), (wname, value)
        slots = {n: k for n, k, _ in info["required"] + info["optional"]}
        for inp in node["inputs"]:
            assert inp["name"] in slots and slots[inp["name"]] == inp["type"], inp
        served = _served(pack, node["type"])
        assert [(o["name"], o["type"]) for o in node["outputs"]] == \
            list(zip(served["output_name"], served["output"]))
