"""Fixtures for the browser test: a real ComfyUI server with this pack, and headless Chromium.

The server runs ComfyUI's own ``main.py`` as a subprocess on a free loopback port, with
``--base-directory`` pointing at a temporary folder that holds:

* ``custom_nodes/ComfyUI-VRAMCut`` -> a symlink to this repository (the real pack), or to
  ``$VRAMCUT_PACK_DIR`` when set (a copy installed another way, as ComfyUI Manager installs it);
* ``user/default/comfy.settings.json`` with ``Comfy.TutorialCompleted`` set, so a fresh browser
  profile is not greeted by the "Get Started with a Template" dialog;
* ``models/diffusion_models/vramcut_tiny_sd3.safetensors``: a tiny SD3 MMDiT (4 joint blocks,
  35 MiB), whose size ComfyUI infers from the weights.

Chromium is Debian's (``/usr/bin/chromium`` + ``/usr/bin/chromedriver``) driven by Selenium,
so nothing is downloaded at test time. Override with ``$CHROMIUM`` / ``$CHROMEDRIVER``.
Everything is skipped, with the reason, when ComfyUI, Chromium, chromedriver or Selenium is
missing; the server and the browser are always stopped.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PACK_FOLDER = "ComfyUI-VRAMCut"          # the folder name ComfyUI sees (and serves templates under)
NODE_TYPE = "VRAMCutMaxVRAM"
TINY_MODEL = "vramcut_tiny_sd3.safetensors"
TINY_DEPTH = 4                           # 4 joint blocks: ~9 MiB each in fp32
TINY_BUDGET_GB = 0.03                    # -> 2 resident and 5 streamed segments for that model

SERVER_START_TIMEOUT_S = 180
SERVER_STOP_TIMEOUT_S = 15


def _first_executable(*candidates: str | None) -> str | None:
    for c in candidates:
        if not c:
            continue
        p = c if os.path.isabs(c) else shutil.which(c)
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, data: dict | None = None, timeout: float = 10.0):
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def _tail(path: str, n: int = 60) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def _write_tiny_model(path: str) -> None:
    """The tiny SD3 from tests/tiny_models.py (keys and shapes as ComfyUI's loader expects)."""
    try:
        import tiny_models  # tests/ is on sys.path (tests/conftest.py)
    except ImportError as e:
        pytest.skip(f"tests/tiny_models.py not importable: {e}")
    from safetensors.torch import save_file

    sd = tiny_models.tiny_sd3_state_dict(depth=TINY_DEPTH, seed=0)
    save_file({k: v.contiguous() for k, v in sd.items()}, path)


SD_VAE = "vramcut_random_sd_vae.safetensors"


def _write_sd_vae(path: str) -> None:
    """An SD1.x-shaped VAE with seeded random weights (ComfyUI's VAELoader infers nothing from a
    VAE's weights but its family, so the file has the real layout: about 84M parameters, fp16)."""
    import tiny_models
    from safetensors.torch import save_file

    cfg = tiny_models.tiny_vae_config(ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2)
    sd = tiny_models.tiny_vae_state_dict(seed=0, config=cfg)
    save_file({k: v.to(torch.float16).contiguous() for k, v in sd.items()}, path)


class ComfyServer:
    """A running ComfyUI with this pack; ``tiny_model`` at ``tiny_budget_gb`` plans to both
    resident and streamed segments."""

    node_type = NODE_TYPE
    pack_folder = PACK_FOLDER
    tiny_model = TINY_MODEL
    tiny_budget_gb = TINY_BUDGET_GB
    sd_vae = SD_VAE

    def __init__(self, url: str, base: str, log_path: str, proc: subprocess.Popen):
        self.url, self.base, self.log_path, self.proc = url, base, log_path, proc

    def get(self, path: str):
        return http_json(self.url + path)

    def post(self, path: str, data: dict):
        return http_json(self.url + path, data)

    def log_tail(self, n: int = 60) -> str:
        return _tail(self.log_path, n)

    def wait_history(self, prompt_id: str, timeout_s: float) -> dict:
        """The prompt's ``/history`` entry once it has completed (or failed); fails the test after
        ``timeout_s`` with the server's log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                return entry
            time.sleep(0.25)
        pytest.fail(f"prompt {prompt_id} did not finish in {timeout_s}s:\n{self.log_tail()}")


@pytest.fixture(scope="session")
def comfyui_path() -> str:
    import tiny_models
    try:  # its requirements must be installed here, as the server needs them; one skip reason for all
        return tiny_models.import_comfy()
    except tiny_models.ComfyUINotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def comfy_server(comfy_server_session):
    """The session's server, its prompt cache and loaded models dropped first (ComfyUI's ``/free``):
    each module's prompts run as on a fresh server, without a start of ComfyUI per module (about
    30 s each on a small CPU)."""
    s = comfy_server_session
    if s.proc is not None:
        before = s.get("/queue")
        req = urllib.request.Request(s.url + "/free", data=json.dumps({"unload_models": True, "free_memory": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()  # an empty answer
        # the flags are taken by the prompt worker when it wakes: one empty turn of its loop
        time.sleep(1.5)
        assert not before.get("queue_running"), before
    return s


@pytest.fixture(scope="session")
def comfy_server_session(comfyui_path, tmp_path_factory):
    running = os.environ.get("VRAMCUT_COMFY_URL")
    if running:
        # while working on the web side: a server already running with the same set-up (its base
        # directory in $VRAMCUT_COMFY_BASE); web/ changes are served without a restart
        base = os.environ.get("VRAMCUT_COMFY_BASE", "")
        yield ComfyServer(running.rstrip("/"), base, os.path.join(base, "comfyui.log"), None)
        return
    base = str(tmp_path_factory.mktemp("comfy_base"))
    os.makedirs(os.path.join(base, "custom_nodes"))
    # $VRAMCUT_PACK_DIR: a copy of the pack installed some other way (CI: by ComfyUI Manager)
    pack_dir = os.environ.get("VRAMCUT_PACK_DIR") or REPO
    os.symlink(pack_dir, os.path.join(base, "custom_nodes", PACK_FOLDER), target_is_directory=True)
    os.makedirs(os.path.join(base, "user", "default"))
    with open(os.path.join(base, "user", "default", "comfy.settings.json"), "w") as f:
        json.dump({"Comfy.TutorialCompleted": True}, f)
    models = os.path.join(base, "models", "diffusion_models")
    os.makedirs(models)
    _write_tiny_model(os.path.join(models, TINY_MODEL))
    os.makedirs(os.path.join(base, "models", "vae"))
    _write_sd_vae(os.path.join(base, "models", "vae", SD_VAE))

    port = _free_port()
    cmd = [os.environ.get("COMFYUI_PYTHON", sys.executable), "main.py", "--cpu", "--listen", "127.0.0.1",
           "--port", str(port), "--disable-api-nodes", "--base-directory", base]
    with open(os.path.join(comfyui_path, "comfy", "cli_args.py"), encoding="utf-8") as f:
        if "--database-url" in f.read():
            cmd += ["--database-url", "sqlite:///:memory:"]  # write nothing into the checkout
    log_path = os.path.join(base, "comfyui.log")
    # the measured host-to-device bandwidth is cached here, not in the user's home
    env = dict(os.environ, PYTHONUNBUFFERED="1", VRAMCUT_CACHE_DIR=os.path.join(base, "cache"))
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=comfyui_path, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    print(f"\nComfyUI pid {proc.pid} at {url}, base directory {base}, log {log_path}")
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ComfyUI exited with {proc.returncode} while starting:\n{_tail(log_path)}")
            try:
                info = http_json(f"{url}/object_info/{NODE_TYPE}", timeout=2)
                if NODE_TYPE in info:
                    break
                pytest.fail(f"ComfyUI is up but {NODE_TYPE} is not registered (pack import failed?):\n"
                            f"{_tail(log_path)}")
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"ComfyUI did not answer within {SERVER_START_TIMEOUT_S}s:\n{_tail(log_path)}")
            time.sleep(0.5)
        yield ComfyServer(url, base, log_path, proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=SERVER_STOP_TIMEOUT_S)
        log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium through Selenium, a fresh profile, loopback only; always quit."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    chromium = _first_executable(os.environ.get("CHROMIUM"), "/usr/bin/chromium", "chromium",
                                 "chromium-browser", "google-chrome")
    driver_path = _first_executable(os.environ.get("CHROMEDRIVER"), "/usr/bin/chromedriver", "chromedriver")
    if chromium is None:
        pytest.skip("Chromium not found (apt-get install -y chromium chromium-driver, or set $CHROMIUM)")
    if driver_path is None:
        pytest.skip("chromedriver not found (apt-get install -y chromium-driver, or set $CHROMEDRIVER)")

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    profile = tmp_path_factory.mktemp("chromium_profile")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--force-device-scale-factor=1", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager (which would go online) is not used.
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    try:
        driver.set_page_load_timeout(60)
        driver.set_script_timeout(60)
        yield driver
    finally:
        driver.quit()
