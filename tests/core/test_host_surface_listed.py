"""Every ComfyUI name the adapter's source uses is in its host surface list
(``nodes/host_surface.py``), which ``tests/comfy/test_host_surface.py`` checks on each host.
Reads source only: no ComfyUI needed."""
import host_surface_lib as hs


def test_every_host_name_the_adapter_uses_is_listed():
    listed = hs.listed_names(hs.load_surface())
    unlisted = {f"{f.name}: {n}" for f in hs.adapter_files() for n in hs.used_host_names(f)
                if not hs.covered(n, listed)}
    assert not unlisted, f"add these to nodes/host_surface.py: {sorted(unlisted)}"


def test_the_scan_sees_chains_getattr_and_super_calls(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import comfy.model_management as mm\n"
                   "from comfy.sd import VAE\n"
                   "a = mm.some_new_name(1)\n"
                   "b = getattr(mm, 'OTHER', None)\n"
                   "class P(VAE):\n"
                   "    def decode(self):\n"
                   "        return super().decode_more()\n")
    assert hs.used_host_names(src) == {"comfy.model_management.some_new_name", "comfy.model_management.OTHER",
                                       "comfy.sd.VAE.decode_more"}
