"""Host memory and LoRA cost of a patched model against the plain one, through a real ComfyUI.

Each scenario runs in a fresh process (so RSS figures do not bleed into each other) on an SD3
MMDiT built through ComfyUI's own loader (``--depth 8``: hidden 512, about 300 MB of float32
weights), CPU, one sampling step of a 16x16 latent:

* ``plain`` / ``plain_lora``: the model without VRAMCut (a full load: a LoRA is merged into new
  host tensors, the originals kept as the host's backup);
* ``vramcut`` / ``vramcut_lora``: through the Max VRAM node at half the weights;
* ``dynamic_plain`` / ``dynamic_vramcut``: the same from a model the host manages with dynamic
  VRAM (the stand-in of ``tests/dynamic_host.py``; its loader can rebuild the model, as the
  host's ``cached_patcher_init`` reloads it from disk).

Per scenario: RSS after loading, after the run (malloc trimmed first), the bytes of distinct
host tensors the model and its patcher's backups hold (a census, exact), and for the LoRA
scenarios the time from a changed LoRA strength to the end of the first step.

Fast-disk loading (the host keeps the model mapped from its checkpoint file and streams it from
a fast disk): the model is saved to a safetensors file and its weights assigned from the mapped
file, as the host holds a file-backed model; one forward of the diffusion model, then RSS split
into anonymous memory (``RssAnon``: what the process holds) and mapped file pages (``RssFile``:
the page cache's, dropped under pressure and read again):

* ``disk_plain``: the host's own path (the forward reads the mapping);
* ``disk_masters`` / ``disk_window``: VRAMCut's CUDA branch (on the simulated accelerator of
  ``tests/sim_cuda.py``, whose device memory is host memory: measured after the engine has
  released its device buffers, its host memory kept) at half the weights, without and with
  ``keep_file_backed`` (flat page-locked host masters vs the mapped weights as masters and the
  page-locked staging window).

    COMFYUI_PATH=... python bench/bench_host_memory.py [--pack DIR] [--depth 8] [--json FILE]

``--pack`` points at another checkout of the pack (to measure an older version the same way).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCENARIOS = ("plain", "plain_lora", "vramcut", "vramcut_lora", "dynamic_plain", "dynamic_vramcut")
DISK_SCENARIOS = ("disk_plain", "disk_masters", "disk_window")


def rss_bytes() -> int:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_split() -> dict:
    """``RssAnon`` and ``RssFile`` of this process (malloc trimmed first), bytes."""
    rss_bytes()
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def census(patcher) -> int:
    """Bytes of the distinct host storages the model's tensors and the patcher's backups use."""
    seen, total = set(), 0
    tensors = list(patcher.model.state_dict(keep_vars=True).values())
    tensors += [b.weight for b in patcher.backup.values()]
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def load_pack(path: str):
    spec = importlib.util.spec_from_file_location("ComfyUI_VRAMCut", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["ComfyUI_VRAMCut"] = pack
    spec.loader.exec_module(pack)
    return pack


def one(scenario: str, pack_dir: str, depth: int) -> dict:
    sys.path[:0] = [os.path.join(REPO, "tests"), REPO]
    import torch
    import tiny_models as tm
    tm.import_comfy()
    import comfy.sd
    import dynamic_host as dh
    from pack_nodes import run_node

    torch.set_num_threads(1)
    pack = load_pack(pack_dir)
    sd = tm.tiny_sd3_state_dict(depth=depth, seed=0)
    model = tm.load_tiny_sd3(depth=depth, state_dict=sd)
    del sd
    if scenario.startswith("dynamic"):
        model = dh.make_dynamic(model, lambda *a, **k: tm.load_tiny_sd3(depth=depth))
    pos, neg = tm.tiny_sd3_conditioning()
    latent = (1, 16, 16, 16)
    weights = sum(p.numel() * p.element_size() for p in model.model.diffusion_model.parameters())
    out = {"scenario": scenario, "weight_bytes": weights, "rss_loaded": rss_bytes()}

    def patched(m):
        gb = weights * 0.5 / (1 << 30)
        out, _ = run_node(pack, "VRAMCutMaxVRAM", "1", max_vram_gb=gb, budget_mode="fixed", reserve_gb=1.0,
                          prefetch=True, residency=True, model=m)
        return out[0]

    lora = tm.tiny_lora_for(model, seed=1) if scenario.endswith("lora") else None
    with torch.inference_mode():
        run = model
        if lora is not None:
            run = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)[0]
        if "vramcut" in scenario:
            run = patched(run)
        tm.sample(run, pos, neg, latent, steps=1)
        out["rss_after_run"] = rss_bytes()
        out["census_bytes"] = census(run)
        if lora is not None:
            # the user changes the LoRA strength upstream of the node: a new patched model
            t0 = time.perf_counter()
            again = comfy.sd.load_lora_for_models(model, None, lora, 0.5, 0.0)[0]
            if "vramcut" in scenario:
                again = patched(again)
            tm.sample(again, pos, neg, latent, steps=1)
            out["lora_change_to_first_step_s"] = round(time.perf_counter() - t0, 3)
            out["rss_after_change"] = rss_bytes()
        out["reloads_from_loader"] = len(dh.RELOADS)
    return out


def one_disk(scenario: str, pack_dir: str, depth: int, where: str) -> dict:
    """A fast-disk scenario (see the module docstring)."""
    sys.path[:0] = [os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "core"), REPO]
    import tempfile

    import pytest
    import torch
    import tiny_models as tm
    from sim_cuda import simulated_cuda
    from toys import map_from_file

    torch.set_num_threads(1)
    tm.import_comfy()
    pack = load_pack(pack_dir)
    core = pack.vramcut_core
    model = tm.load_tiny_sd3(depth=depth)
    dm = model.model.diffusion_model
    weights = sum(p.numel() * p.element_size() for p in dm.parameters())
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        map_from_file(dm, tmp)
        gc.collect()
        g = torch.Generator().manual_seed(0)
        x, t = torch.randn(1, 16, 16, 16, generator=g), torch.rand(1, generator=g)
        kw = dict(context=torch.randn(1, 8, 32, generator=g), y=torch.randn(1, 32, generator=g))
        out = {"scenario": scenario, "weight_bytes": weights,
               "file_backed": all(core.runtime.host_memory.file_backed(list(dm.state_dict().values()))),
               **{f"loaded_{k}": v for k, v in rss_split().items()}}
        with torch.inference_mode():
            if scenario == "disk_plain":
                dm(x, t, **kw)
            else:
                mp = pytest.MonkeyPatch()
                try:
                    with simulated_cuda(mp, runtimes=(core.runtime,)):
                        cfg = core.EngineConfig(budget_bytes=weights // 2 + (64 << 20), device="cuda",
                                                keep_file_backed=scenario == "disk_window")
                        eng = core.Engine(dm, cfg)
                        eng.run(dm, x, t, **kw)
                        eng.release()
                        out["streamed_units"] = len(eng.last_plan.streamed_order)
                        out["pinned_bytes"] = core.runtime.executor.PAGE_LOCKED.bytes
                        out["masters"] = len(eng.executor.masters.masters)
                        gc.collect()
                        out.update({f"run_{k}": v for k, v in rss_split().items()})
                finally:
                    mp.undo()
        if scenario == "disk_plain":
            out.update({f"run_{k}": v for k, v in rss_split().items()})
        out["file_backed_after"] = all(core.runtime.host_memory.file_backed(list(dm.state_dict().values())))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", default=REPO, help="checkout of the pack to measure (default: this one)")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--scenario", choices=SCENARIOS + DISK_SCENARIOS, help=argparse.SUPPRESS)
    ap.add_argument("--only", nargs="*", choices=SCENARIOS + DISK_SCENARIOS, help="run these scenarios only")
    ap.add_argument("--disk-dir", default=None, help="where the fast-disk scenarios write their checkpoint "
                    "(a disk, not tmpfs; default: the system's temporary directory)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    if a.scenario in DISK_SCENARIOS:
        print(json.dumps(one_disk(a.scenario, os.path.abspath(a.pack), a.depth, a.disk_dir)))
        return 0
    if a.scenario:
        print(json.dumps(one(a.scenario, os.path.abspath(a.pack), a.depth)))
        return 0
    rows = []
    for s in a.only or SCENARIOS + DISK_SCENARIOS:
        extra = ["--disk-dir", a.disk_dir] if a.disk_dir else []
        r = subprocess.run([sys.executable, __file__, "--scenario", s, "--pack", a.pack, "--depth", str(a.depth),
                            *extra], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{s}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    mib = lambda n: f"{n / (1 << 20):8.1f}"  # noqa: E731
    disk = [r for r in rows if r["scenario"] in DISK_SCENARIOS]
    rows = [r for r in rows if r["scenario"] not in DISK_SCENARIOS]
    if rows:
        print(f"{'scenario':16} {'weights MiB':>11} {'RSS loaded':>10} {'RSS run':>9} {'+run':>8} {'census':>8} "
              f"{'LoRA change->step s':>19} reloads")
    for r in rows:
        print(f"{r['scenario']:16} {mib(r['weight_bytes']):>11} {mib(r['rss_loaded']):>10} {mib(r['rss_after_run']):>9} "
              f"{mib(r['rss_after_run'] - r['rss_loaded']):>8} {mib(r['census_bytes']):>8} "
              f"{r.get('lora_change_to_first_step_s', ''):>19} {r['reloads_from_loader']}")
    if disk:
        print(f"\n{'fast disk':16} {'weights MiB':>11} {'anon loaded':>11} {'anon run':>9} {'+anon':>8} "
              f"{'file run':>9} {'pinned':>8} masters file-backed after")
    for r in disk:
        print(f"{r['scenario']:16} {mib(r['weight_bytes']):>11} {mib(r['loaded_RssAnon']):>11} "
              f"{mib(r['run_RssAnon']):>9} {mib(r['run_RssAnon'] - r['loaded_RssAnon']):>8} "
              f"{mib(r['run_RssFile']):>9} {mib(r.get('pinned_bytes', 0)):>8} {r.get('masters', 0):>7} "
              f"{r['file_backed_after']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows + disk, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
