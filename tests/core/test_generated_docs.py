"""The README and docs/ say what the code and the scripts say: the install id and the clone URL
are pyproject's, the test command is the one CI runs, and every generated figure is what its
script (bench/plan_table.py, bench/bench_switch.py) writes now, stamped (bench/docgen.py)."""
import os
import re
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (the test extra)
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import docgen  # noqa: E402


def read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def test_readme_install_id_and_clone_url_are_pyprojects():
    project = tomllib.loads(read("pyproject.toml"))["project"]
    readme = read("README.md")
    assert re.findall(r"comfy node install (\S+?)`", readme) == [project["name"]]
    urls = re.findall(r"git clone (\S+?)`", readme)
    assert urls == [project["urls"]["Repository"]]


def test_readme_test_command_is_the_one_ci_runs():
    run = read(".ci", "run")
    body = re.search(r"readme_test_command\(\) \{\n(.*?)\n\}", run, re.S).group(1)
    command = [line.strip() for line in body.splitlines() if not line.strip().startswith("#")]
    assert len(command) == 1
    assert f"```\n{command[0]}\n```" in read("README.md")


def test_readme_demo_figures_are_the_demos():
    """The README's and planner.md's demo sentences (model size, budget share) say what
    vramcut_core/cli/demo.py builds."""
    import torch

    from vramcut_core.cli import demo
    with torch.device("meta"):
        model = demo.DemoTransformer()
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) / (1 << 20)
    share = f"{demo.DEMO_BUDGET_SHARE * 100:.0f} % of its size"
    readme, planner = (" ".join(read(*p).split()) for p in (("README.md",), ("docs", "planner.md")))
    assert f"builds a seeded {mib:.0f} MiB model" in readme and f"a budget of {share}" in readme
    assert f"builds a seeded {mib:.0f} MiB transformer" in planner and f"segmented at {share}" in planner


@pytest.mark.parametrize("page", ["coverage.md", "full_size.md", "planner.md", "measurements.md", "predicted.md"])
def test_generated_pages_carry_the_stamp(page):
    stamps = [line for line in read("docs", page).splitlines() if line.startswith(docgen.STAMP)]
    assert stamps, f"docs/{page} has no stamp"
    for s in stamps:
        assert re.search(r"at commit [0-9a-f]{10}", s) and re.search(r"on \d{4}-\d\d-\d\d \(UTC\), on ", s), s


def test_planner_figures_are_what_plan_table_writes_now():
    import plan_table
    page = docgen.section(read("docs", "planner.md"), plan_table.SCRIPT)
    assert docgen.without_stamp(page) == docgen.without_stamp(plan_table.section())


def test_measurements_are_what_bench_switch_writes_now(tmp_path, monkeypatch):
    import bench_switch
    page = docgen.section(read("docs", "measurements.md"), "bench/bench_switch.py")
    doc = tmp_path / "docs" / "measurements.md"
    doc.parent.mkdir()
    doc.write_text(read("docs", "measurements.md"), encoding="utf-8")
    monkeypatch.setattr(bench_switch, "ROOT", str(tmp_path))
    assert bench_switch.main(["--doc"]) == 0
    now = docgen.section(doc.read_text(encoding="utf-8"), "bench/bench_switch.py")
    assert docgen.without_stamp(now) == docgen.without_stamp(page)


def test_section_round_trip(tmp_path):
    p = tmp_path / "page.md"
    p.write_text(f"intro\n{docgen.begin('x.py')}\n{docgen.END}\noutro\n", encoding="utf-8")
    docgen.write_section(str(p), "x.py", "one\n" + docgen.stamp("x"))
    text = p.read_text(encoding="utf-8")
    assert text.startswith("intro\n") and text.endswith("outro\n")
    assert docgen.without_stamp(docgen.section(text, "x.py")) == "one"
