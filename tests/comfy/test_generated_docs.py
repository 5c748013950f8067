"""Generated pages against the host: the Flux.1-dev header the planner's figures use is the
released layout (ComfyUI's own Flux class at that configuration, after the loader's key
conversion), and docs/full_size.md holds what bench/full_size.py writes now (its Flux.1-dev row
regenerated; the four rows together take minutes on a small CPU)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for p in (os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests", "core")):
    if p not in sys.path:
        sys.path.insert(0, p)

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def full_size(comfy):
    import full_size as fs
    fs.import_host()
    return fs


def test_flux_dev_header_is_the_hosts_flux_at_the_released_configuration(full_size):
    import checkpoint_headers as ch
    try:
        cfg, dm = full_size.build(full_size.MODELS[0])
    except TypeError as e:  # bench/full_size.py's configurations are the newest host's (0.33.0)
        pytest.skip(f"this host's Flux does not take full_size.py's configuration: {e}")
    header = cfg.process_unet_state_dict(dict(ch.flux_dev()))
    built = {k: list(t.shape) for k, t in dm.state_dict().items()}
    assert set(header) == set(built)
    assert {k: shape for k, (_, shape) in header.items()} == built


def test_full_size_page_is_what_the_script_writes_now(comfy):
    """In a process of its own: the script picks the attention GPU users run before the host is
    imported, which this process has already done."""
    import subprocess

    import docgen
    import tiny_models as tm
    with open(os.path.join(ROOT, "docs", "full_size.md"), encoding="utf-8") as f:
        page = f.read().splitlines()
    host = os.path.basename(os.path.dirname(tm.comfyui_path()))
    if not any(f"Dry runs on ComfyUI {host}," in line for line in page):
        pytest.skip(f"docs/full_size.md was generated on another host than {host}")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "full_size.py"), "--only", "Flux.1-dev"],
                         cwd=ROOT, env=dict(os.environ, COMFYUI_PATH=tm.comfyui_path()), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    now = docgen.without_stamp(out.stdout).splitlines()
    head = now[:now.index("") if "" in now else 0]
    assert head and page[:len(head)] == head, "the page's header is not the script's"
    rows = [line for line in now if line.startswith(("| Flux", "- **Flux"))]
    assert len(rows) == 2 and all(r in page for r in rows), rows
    assert any(line.startswith(docgen.STAMP) for line in page)


def test_predicted_page_is_what_the_script_writes_now(comfy):
    """docs/predicted.md's Flux.1-dev rows (one dry run; the four models with the published
    shapes' dry runs take about a minute on a small CPU) and its header are what
    bench/predict_table.py writes now."""
    import subprocess

    import docgen
    import tiny_models as tm
    with open(os.path.join(ROOT, "docs", "predicted.md"), encoding="utf-8") as f:
        page = f.read().splitlines()
    host = os.path.basename(os.path.dirname(tm.comfyui_path()))
    if not any(f"[full_size.md](full_size.md)'s (ComfyUI {host}," in line for line in page):
        pytest.skip(f"docs/predicted.md was generated on another host than {host}")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "predict_table.py"), "--only", "Flux.1-dev"],
                         cwd=ROOT, env=dict(os.environ, COMFYUI_PATH=tm.comfyui_path()), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    now = docgen.without_stamp(out.stdout).splitlines()
    # the prose and the tables' headers: every line that is not a model's row or note
    prose = [line for line in now if not line.startswith(("| Flux", "- **"))]
    missing = [line for line in prose if line not in page]
    assert not missing, f"the page's text is not the script's: {missing[:3]}"
    rows = [line for line in now if line.startswith(("| Flux", "- **Flux"))]
    # four budgets of predicted time, the note with its source, and the four two-GPU rows
    assert len(rows) == 9 and all(r in page for r in rows), rows
    assert any(line.startswith(docgen.STAMP) for line in page)
