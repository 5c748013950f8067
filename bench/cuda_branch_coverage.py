"""Which lines of the engine's CUDA branch (every file of ``vramcut_core``) the test suite runs.

CI has no GPU; the CUDA branch runs there on the simulated accelerator (``tests/sim_cuda.py``).
This script runs the engine tests that drive it under ``coverage`` and counts, among the lines
that only a CUDA device can reach, how many ran:

- the body of an ``if`` whose condition names CUDA (``if self.cuda``, ``if self.cuda and sync``),
  and the ``else`` of one that negates it (``if not self.cuda: ... else: <CUDA>``);
- every line of a function or class whose name says CUDA (``CUDAMeter``, ``collect_cuda_times``)
  or that exists only for pinned host memory (``_HostMaster``).

The files measured are globbed (``vramcut_core/**/*.py``), so a module split off the executor
cannot silently fall out of the gate.

    python bench/cuda_branch_coverage.py [--fail-under PERCENT] [--json]

Needs ``coverage`` (``pip install coverage``). Prints the figure and each CUDA line not run.
"""
from __future__ import annotations

import argparse
import ast
import json
import glob
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(os.path.relpath(p, ROOT).replace(os.sep, "/")
               for p in glob.glob(os.path.join(ROOT, "vramcut_core", "**", "*.py"), recursive=True))
TESTS = ["tests/core/test_sim_cuda.py", "tests/core/test_executor.py", "tests/core/test_sim_kitchen.py",
         "tests/core/test_sim_switch.py", "tests/core/test_sim_devices.py", "tests/core/test_sim_host_memory.py",
         "tests/core/test_sim_measure_cap.py", "tests/core/test_file_backed.py",
         "tests/core/test_sim_timing.py", "tests/core/test_sim_probes.py", "tests/core/test_tiers.py"]
CUDA_ONLY_NAMES = ("cuda", "hostmaster", "pinned")


def _mentions_cuda(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "cuda" or isinstance(n, ast.Name) and "cuda" in n.id.lower()
               for n in ast.walk(node))


def _lines(stmts: list[ast.stmt]) -> set[int]:
    out: set[int] = set()
    for s in stmts:
        out.update(range(s.lineno, (s.end_lineno or s.lineno) + 1))
    return out


def cuda_only_lines(path: str) -> set[int]:
    """Line numbers that only run on a CUDA device (see the module docstring)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and any(k in node.name.lower() for k in CUDA_ONLY_NAMES):
            lines |= _lines(node.body)
        elif isinstance(node, ast.If):
            test = node.test
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _mentions_cuda(test.operand):
                lines |= _lines(node.orelse)
            elif isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and any(
                    _mentions_cuda(v) and not isinstance(v, ast.UnaryOp) for v in test.values):
                lines |= _lines(node.body)
            elif not isinstance(test, (ast.UnaryOp, ast.BoolOp)) and _mentions_cuda(test):
                lines |= _lines(node.body)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fail-under", type=float, default=None, help="exit 1 below this percent of CUDA lines run")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if subprocess.call([sys.executable, "-m", "coverage", "--version"], stdout=subprocess.DEVNULL) != 0:
        print("needs coverage: pip install coverage", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, ".coverage")
        cmd = [sys.executable, "-m", "coverage", "run", f"--data-file={data}", "--include=" + ",".join(FILES),
               "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
        rc = subprocess.call(cmd, cwd=ROOT)
        if rc != 0:
            print(f"the tests failed (exit {rc})", file=sys.stderr)
            return rc
        report = os.path.join(tmp, "coverage.json")
        subprocess.check_call([sys.executable, "-m", "coverage", "json", f"--data-file={data}", "-o", report, "-q"],
                              cwd=ROOT)
        measured = {os.path.normpath(k): v for k, v in json.load(open(report))["files"].items()}
        result = {"files": {}, "cuda_lines": 0, "cuda_lines_run": 0}
        for rel in FILES:
            path = os.path.join(ROOT, rel)
            f = measured.get(os.path.normpath(rel)) or {"executed_lines": [], "missing_lines": []}
            statements, missing = f["executed_lines"] + f["missing_lines"], f["missing_lines"]
            cuda = cuda_only_lines(path) & set(statements)
            not_run = sorted(cuda & set(missing))
            result["files"][rel] = {"statements": len(statements), "statements_run": len(statements) - len(missing),
                                    "cuda_lines": len(cuda), "cuda_lines_run": len(cuda) - len(not_run),
                                    "cuda_lines_not_run": not_run}
            result["cuda_lines"] += len(cuda)
            result["cuda_lines_run"] += len(cuda) - len(not_run)
    pct = 100.0 * result["cuda_lines_run"] / max(1, result["cuda_lines"])
    result["cuda_percent"] = round(pct, 1)
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for rel, f in result["files"].items():
            print(f"{rel}: statements {f['statements_run']}/{f['statements']} run; "
                  f"CUDA-only {f['cuda_lines_run']}/{f['cuda_lines']} run"
                  + (f"; not run: {', '.join(map(str, f['cuda_lines_not_run']))}" if f["cuda_lines_not_run"] else ""))
        print(f"CUDA-only lines run on the simulated accelerator: {result['cuda_lines_run']}/{result['cuda_lines']} ({pct:.1f} %)")
    if a.fail_under is not None and pct < a.fail_under:
        print(f"below --fail-under {a.fail_under} %", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
