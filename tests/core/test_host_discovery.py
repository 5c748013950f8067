"""The README's test command never errors for want of a usable host: a ComfyUI checkout whose
requirements are not installed makes the ComfyUI tests skip with one reason naming the fix."""
import os
import pathlib
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]


def fake_host(tmp_path, model_management: str) -> pathlib.Path:
    comfy = tmp_path / "ComfyUI" / "comfy"
    comfy.mkdir(parents=True)
    (comfy / "cli_args.py").write_text("class _A:\n    cpu = False\nargs = _A()\n")
    (comfy / "model_management.py").write_text(model_management)
    (comfy / "sd.py").write_text("")
    return comfy.parent


def import_comfy_in_subprocess(host: pathlib.Path) -> subprocess.CompletedProcess:
    code = ("import tiny_models\n"
            "try:\n    tiny_models.import_comfy()\n    print('imported')\n"
            "except tiny_models.ComfyUINotFound as e:\n    print('SKIP:', e)\n")
    env = dict(os.environ, COMFYUI_PATH=str(host))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=TESTS, env=env)


def test_missing_host_requirement_is_a_skip_reason_naming_the_install_command(tmp_path):
    host = fake_host(tmp_path, "import psutil_is_not_installed_here\n")
    r = import_comfy_in_subprocess(host)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert out.startswith("SKIP:") and "psutil_is_not_installed_here" in out, out
    assert f"pip install -r {host}/requirements.txt" in out, out


def test_a_host_whose_requirements_import_is_used(tmp_path):
    host = fake_host(tmp_path, "DEVICE = 'cpu'\n")
    r = import_comfy_in_subprocess(host)
    assert r.returncode == 0 and r.stdout.strip() == "imported", r.stdout + r.stderr



def test_tests_run_from_a_folder_whose_name_is_not_a_python_name(tmp_path):
    """A clone into ComfyUI-VRAMCut (as the README says) with ComfyUI importable: pytest imports
    the checkout's __init__.py as a plain module there, which must not fail on its relative
    import (it registers no nodes then)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pack = tmp_path / "ComfyUI-VRAMCut"
    (pack / "tests").mkdir(parents=True)
    (pack / "__init__.py").write_text(pathlib.Path(root, "__init__.py").read_text())
    (pack / "tests" / "test_one.py").write_text("def test_one():\n    assert True\n")
    (tmp_path / "site" / "comfy").mkdir(parents=True)
    (tmp_path / "site" / "comfy" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                        "tests"], cwd=pack, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
