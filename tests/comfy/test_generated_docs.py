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


def page_and_script(doc: str, marker: str, script: str) -> tuple[list[str], list[str]]:
    """docs/``doc``'s lines and what bench/``script --only Flux.1-dev`` writes now (its stamp left
    out), run in a process of its own on this host; skipped where the page names another host
    (``marker`` with ``{host}``)."""
    import subprocess

    import docgen
    import tiny_models as tm
    with open(os.path.join(ROOT, "docs", doc), encoding="utf-8") as f:
        page = f.read().splitlines()
    host = os.path.basename(os.path.dirname(tm.comfyui_path()))
    if not any(marker.format(host=host) in line for line in page):
        pytest.skip(f"docs/{doc} was generated on another host than {host}")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--only", "Flux.1-dev"],
                         cwd=ROOT, env=dict(os.environ, COMFYUI_PATH=tm.comfyui_path()), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return page, docgen.without_stamp(out.stdout).splitlines()


def test_full_size_page_is_what_the_script_writes_now(comfy):
    """In a process of its own: the script picks the attention GPU users run before the host is
    imported, which this process has already done."""
    import docgen
    page, now = page_and_script("full_size.md", "Dry runs on ComfyUI {host},", "full_size.py")
    head = now[:now.index("") if "" in now else 0]
    assert head and page[:len(head)] == head, "the page's header is not the script's"
    rows = [line for line in now if line.startswith(("| Flux", "- **Flux"))]
    assert len(rows) == 2 and all(r in page for r in rows), rows
    assert any(line.startswith(docgen.STAMP) for line in page)


def test_predicted_page_is_what_the_script_writes_now(comfy):
    """docs/predicted.md's Flux.1-dev rows (one dry run; the four models with the published
    shapes' dry runs take about a minute on a small CPU) and its header are what
    bench/predict_table.py writes now."""
    import docgen
    page, now = page_and_script("predicted.md", "[full_size.md](full_size.md)'s (ComfyUI {host},", "predict_table.py")
    # the prose and the tables' headers: every line that is not a model's row or note
    prose = [line for line in now if not line.startswith(("| Flux", "- **"))]
    missing = [line for line in prose if line not in page]
    assert not missing, f"the page's text is not the script's: {missing[:3]}"
    rows = [line for line in now if line.startswith(("| Flux", "- **Flux"))]
    # four budgets of predicted time, the note with its source, the four two-GPU rows and the four
    # VRAM / RAM pairs
    assert len(rows) == 13 and all(r in page for r in rows), rows
    assert any(line.startswith(docgen.STAMP) for line in page)
