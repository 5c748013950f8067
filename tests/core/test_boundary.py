"""The layout is the architecture: the engine never imports ComfyUI; only nodes/ does."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_engine_imports_no_comfy():
    host = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "server", "nodes",
            "node_helpers", "execution"}
    for path in (ROOT / "vramcut_core").rglob("*.py"):
        bad = imported_modules(path) & host
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_engine_imports_in_a_clean_interpreter_without_comfy():
    code = "import sys, vramcut_core; assert not any(m.startswith('comfy') for m in sys.modules); print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_pack_modules_import_each_other_relatively():
    """Inside ComfyUI the pack is a package named after its folder, and ComfyUI has its own
    top-level ``nodes``: the adapter must never import ``nodes`` or ``vramcut_core`` absolutely."""
    for path in list((ROOT / "nodes").rglob("*.py")) + [ROOT / "__init__.py"]:
        mods = imported_modules(path)
        assert "vramcut_core" not in mods and "nodes" not in mods, path.relative_to(ROOT)


def test_the_adapter_reaches_the_engine_only_through_its_public_face():
    """``nodes/`` imports only the names ``vramcut_core/__init__.py`` exports (no submodule, no
    ``runtime``) and never reaches behind the engine (``engine.executor``, ``engine.planner``):
    the adapter changes with each host release, the engine with each performance fix, and the
    two meet at one door."""
    import vramcut_core

    public = set(vramcut_core.__all__)
    for path in (ROOT / "nodes").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and (node.module or "").startswith("vramcut_core"):
                assert node.module == "vramcut_core", f"{where}:{node.lineno} imports {node.module}"
                names = {a.name for a in node.names}
                assert names <= public, f"{where}:{node.lineno} imports {names - public}, not exported"
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("executor", "planner"), f"{where}:{node.lineno} reaches .{node.attr}"
