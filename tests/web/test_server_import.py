"""ComfyUI starts with the pack in custom_nodes/, lists its nodes, and logs nothing about it."""
import re

NODES = ("VRAMCutMaxVRAM", "VRAMCutMaxVRAMExtras")


def test_pack_loads_without_errors_or_warnings(comfy_server):
    info = comfy_server.get("/object_info")
    for n in NODES:
        assert n in info, n
        assert info[n]["category"] == "VRAMCut"
        assert info[n]["output_node"] is True
        for name, spec in info[n]["input"]["required"].items():
            assert spec[1].get("tooltip"), f"{n}.{name} has no tooltip"
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
