"""ComfyUI starts with the pack in custom_nodes/, lists its nodes, logs nothing about it, and
runs workflows saved before the nodes moved to the V3 API, unchanged: an API prompt
(``data/saved_api_prompt.json``, both nodes, every widget) and the runnable example workflow
converted as the frontend converts it (its model file name pointed at the tiny model)."""
import json
import os
import re


HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "example_workflows")
PROMPT_TIMEOUT_S = 120

NODES = ("VRAMCutMaxVRAM", "VRAMCutMaxVRAMExtras")


def test_pack_loads_without_errors_or_warnings(comfy_server):
    info = comfy_server.get("/object_info")
    for n in NODES:
        assert n in info, n
        assert info[n]["category"] == "VRAMCut"
        assert info[n]["output_node"] is True
        for name, spec in info[n]["input"]["required"].items():
            assert spec[1].get("tooltip"), f"{n}.{name} has no tooltip"
    assert info["VRAMCutPreviewShape"]["output"] == ["VRAMCUT_SHAPE"]
    assert info["VRAMCutMaxVRAM"]["output"] == ["MODEL", "CLIP", "VAE"]
    assert info["VRAMCutMaxVRAM"]["display_name"] == "Max VRAM (VRAMCut)"
    log = open(comfy_server.log_path, encoding="utf-8", errors="replace").read()
    startup = log.split("Starting server")[0]
    failed = [ln for ln in startup.splitlines() if "IMPORT FAILED" in ln]
    assert not [ln for ln in failed if "vramcut" in ln.lower()], failed  # (ComfyUI's audio nodes fail without torchaudio)
    pack_lines = [ln for ln in startup.splitlines() if re.search(r"vramcut", ln, re.I)]
    bad = [ln for ln in pack_lines if re.search(r"warn|error|traceback|fail", ln, re.I)]
    assert not bad, bad
    # the import-time listing names the pack's folder among the custom nodes that loaded
    assert any("ComfyUI-VRAMCut" in ln for ln in pack_lines), startup[-2000:]


def test_web_extension_is_served(comfy_server):
    exts = comfy_server.get("/extensions")
    assert any(e.endswith("ComfyUI-VRAMCut/vramcut.js") for e in exts), exts


def _run(server, prompt: dict) -> dict:
    r = server.post("/prompt", {"prompt": prompt, "client_id": "vramcut-saved"})
    assert not r.get("node_errors"), r
    entry = server.wait_history(r["prompt_id"], PROMPT_TIMEOUT_S)
    assert entry["status"]["status_str"] == "success", (entry["status"], server.log_tail())
    return entry


def test_saved_api_prompt_runs_unchanged(comfy_server):
    with open(os.path.join(HERE, "data", "saved_api_prompt.json"), encoding="utf-8") as f:
        prompt = json.load(f)
    entry = _run(comfy_server, prompt)
    for node_id, node in prompt.items():
        if node["class_type"] not in NODES:
            continue
        (payload,) = entry["outputs"][node_id]["vramcut"]  # the ui key web/vramcut.js reads
        connected = [k for k in ("model", "clip", "vae") if k in node["inputs"]]
        assert [m["kind"] for m in payload["models"]] == [k.upper() for k in connected], payload
    assert entry["outputs"]["3"]["vramcut"][0]["enabled"] is True


def _api_prompt_from_ui(wf: dict) -> dict:
    """The frontend's conversion of a saved UI workflow for the nodes in the examples: widget
    values in the order of the node's widget inputs, links as ``[source id, output slot]``."""
    links = {link[0]: link for link in wf["links"]}
    prompt = {}
    for node in wf["nodes"]:
        if node["type"] == "Note":
            continue
        widgets = [i["name"] for i in node["inputs"] if i.get("widget")]
        assert len(widgets) == len(node["widgets_values"] or []), node  # no control_after_generate here
        inputs = dict(zip(widgets, node["widgets_values"] or []))
        for i in node["inputs"]:
            if i.get("link") is not None:
                link = links[i["link"]]
                inputs[i["name"]] = [str(link[1]), link[2]]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def test_saved_example_workflow_runs(comfy_server):
    with open(os.path.join(EXAMPLES, "VRAMCut - plan preview.json"), encoding="utf-8") as f:
        prompt = _api_prompt_from_ui(json.load(f))
    (loader,) = [n for n in prompt.values() if n["class_type"] == "UNETLoader"]
    loader["inputs"]["unet_name"] = comfy_server.tiny_model  # a model file that is here
    (shape,) = [n for n in prompt.values() if n["class_type"] == "VRAMCutPreviewShape"]
    shape["inputs"].update(width=64, height=64)  # and a shape it takes (the tiny SD3: up to 256 px)
    (ours,) = [k for k, n in prompt.items() if n["class_type"] == "VRAMCutMaxVRAM"]
    assert prompt[ours]["inputs"]["max_vram_gb"] == 6 and "model" in prompt[ours]["inputs"]
    entry = _run(comfy_server, prompt)
    (payload,) = entry["outputs"][ours]["vramcut"]
    assert [m["kind"] for m in payload["models"]] == ["MODEL"] and payload["message"] is None, payload
    # the example previews the MODEL as a sampler with CFG above 1 runs it (cond and uncond batched)
    assert payload["models"][0]["stage"] == "traced" and payload["models"][0]["traced_at"] == "64×64, batch 1 (×2: cond + uncond)"
