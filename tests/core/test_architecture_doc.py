"""docs/architecture.md is the map of the engine: every module of ``vramcut_core`` is listed there,
each ``Calls:`` line names exactly the package's modules it imports, and no part (folder) imports
a part listed below it."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "vramcut_core"
DOC = ROOT / "docs" / "architecture.md"
# The parts in the order the page gives them; a part may import itself and the parts before it
# (engine.py and the modules beside it are one part, the door).
RANK = {"model": 0, "figures": 1, "planning": 2, "formats": 3, "runtime": 4, "engine": 5, "devices": 5, "config": 5,
        "shape": 5, "one_device": 5, "cli": 6}


def modules() -> dict[str, pathlib.Path]:
    """Dotted names under ``vramcut_core`` (``planning.plan``, ``__init__``); the folders'
    docstring-only ``__init__`` files and ``__main__`` left out."""
    out = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = path.relative_to(CORE).with_suffix("").parts
        if parts[-1] == "__main__" or (parts[-1] == "__init__" and len(parts) > 1):
            continue
        out[".".join(parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known) -> set[str]:
    """The package's modules ``path`` imports, at module level or inside functions."""
    package = name.split(".")[:-1]
    got = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{mod}.{alias.name}" if mod else alias.name
                got.add(full if full in known else mod)
    return got


def listed(page: str) -> dict[str, set[str]]:
    """``{module: names its Calls: line gives}`` from the bullets of the engine's sections (those
    before ``## nodes/``)."""
    out = {}
    for bullet in re.split(r"\n(?=- \*\*`)", page.split("\n## nodes/")[0]):
        m = re.match(r"- \*\*`([\w/]+)\.py`\*\*:", bullet)
        if not m:
            continue
        name = m.group(1).replace("/", ".")
        calls = bullet.split("Calls:", 1)
        assert len(calls) == 2, f"{name}: no 'Calls:' in its entry"
        out[name] = set(re.findall(r"`([\w.]+)`", calls[1].split("\n\n")[0].split("\n- ")[0]))
    return out


def wrong_calls(page: str) -> list[str]:
    mods, doc = modules(), listed(page)
    out = []
    for name, path in mods.items():
        real = imports(name, path, mods)
        named = {n for n in doc.get(name, ()) if n in mods}
        if named != real:
            out.append(f"{name}: the page says {sorted(named)}, it imports {sorted(real)}")
        stray = {n for n in doc.get(name, ()) if n not in mods and re.fullmatch(r"[a-z_]+\.[a-z_]+", n)}
        if stray:
            out.append(f"{name}: the page names {sorted(stray)}, no such module")
    return out


def test_every_module_is_on_the_page_and_nothing_else():
    assert set(listed(DOC.read_text())) == set(modules())


def test_each_calls_line_is_what_the_module_imports():
    assert wrong_calls(DOC.read_text()) == []


def test_a_calls_line_missing_an_import_is_caught():
    page = DOC.read_text()
    wrong = page.replace("Calls: `model.quant`.", "Calls: nothing in the package.", 1)
    assert wrong != page and wrong_calls(wrong) == ["model.tensors: the page says [], it imports ['model.quant']"]


def test_no_part_imports_a_part_below_it():
    mods = modules()
    for name, path in mods.items():
        if name == "__init__":
            continue
        for other in imports(name, path, mods):
            assert RANK[other.split(".")[0]] <= RANK[name.split(".")[0]], f"{name} imports {other}, a part below it"
