"""Load the adapter's list of host names (``nodes/host_surface.py``, data only) without importing
the ``nodes`` package (which imports ComfyUI), and read the ComfyUI names the adapter's source
uses."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
NODES = ROOT / "nodes"
HOST_ROOTS = ("comfy", "comfy_api", "comfy_extras", "comfy_execution", "server", "folder_paths", "execution")


def load_surface():
    spec = importlib.util.spec_from_file_location("vramcut_host_surface", NODES / "host_surface.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _aliases(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in HOST_ROOTS:
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in HOST_ROOTS:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(expr, aliases) -> str | None:
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name) and expr.id in aliases:
        return ".".join([aliases[expr.id]] + parts[::-1])
    return None


def _is_named_lookup(node) -> bool:
    """``getattr(x, "name", ...)`` or ``hasattr(x, "name")``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))


def used_host_names(path: pathlib.Path) -> set[str]:
    """Dotted host names one adapter file uses: attribute chains on imported host modules and
    classes, ``getattr``/``hasattr`` with a literal name on them, and ``super().name`` in
    classes deriving from a host class."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = _aliases(tree)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            d = _dotted(node, aliases)
            if d:
                names.add(d)
        elif isinstance(node, ast.Name) and node.id in aliases:
            names.add(aliases[node.id])
        if _is_named_lookup(node):
            base = _dotted(node.args[0], aliases)
            if base:
                names.add(f"{base}.{node.args[1].value}")
        if isinstance(node, ast.ClassDef):
            bases = [b for b in (_dotted(b, aliases) for b in node.bases) if b]
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Call) \
                        and isinstance(sub.value.func, ast.Name) and sub.value.func.id == "super" \
                        and not sub.value.args:
                    names.update(f"{b}.{sub.attr}" for b in bases)
    # only maximal chains: drop a name that is the prefix of a longer one used here
    return {n for n in names if not any(m.startswith(n + ".") for m in names)}


def adapter_files() -> list[pathlib.Path]:
    return sorted(p for p in NODES.glob("*.py") if p.name != "host_surface.py")


def covered(name: str, listed: set[str]) -> bool:
    return any(n == name or n.startswith(name + ".") for n in listed)


def listed_names(surface) -> set[str]:
    return {u.name.replace("()", "") for u in surface.SURFACE}

