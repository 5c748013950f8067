"""Every ComfyUI name the adapter (``nodes/``) touches, with the parameters it passes, in one place.

The one rule: a use of the host that is not listed here is a test failure
(``tests/comfy/test_host_surface.py`` reads the adapter's source for ``comfy`` names), and each
entry is checked against every host the tests run on, so a host change fails one named test
(``test_host_surface[<name>]``) rather than a user's prompt. This module is data only: it imports
nothing of the host and the pack never imports it at run time.

``need``:
  ``always``    used unguarded: every supported host must have it;
  ``guarded``   the adapter checks for it (``hasattr``/``getattr``/``try``) and works without it;
  ``fallback``  used only on hosts that lack the newer name named in ``note``.
``params``: parameter names the adapter passes (by name, or by position with these names); each
must be accepted by the host's signature (``**kwargs`` accepts any).
``hosts``: what the tested releases have, read from their sources (0.3.64, 0.33.0).
``newest``: what ComfyUI 0.38.x has. Not consulted for any entry: the newest release's sources
were not readable from here (the stored snapshot of the upstream repository is 0.3.64, and the
code index holds single file versions that cannot be matched to a release). Check each entry
against 0.38 before relying on it there.
"""
from __future__ import annotations

import dataclasses

NOT_CONSULTED = "not consulted (0.38.x sources not readable here)"


@dataclasses.dataclass(frozen=True)
class Use:
    name: str                       # dotted, from a top-level host module or a host class
    need: str = "always"            # always | guarded | fallback
    params: tuple[str, ...] = ()
    kind: str = "attr"              # attr | callable | class | instance (set on instances) | source
    pattern: str = ""               # for kind "source": a regex the host's sources must match
    note: str = ""
    hosts: str = "0.3.64, 0.33.0"
    newest: str = NOT_CONSULTED


MP = "comfy.model_patcher.ModelPatcher"

SURFACE: tuple[Use, ...] = (
    # --- model management ------------------------------------------------------------------
    Use("comfy.model_management.get_free_memory", params=("dev",), kind="callable",
        note="budget mode 'free VRAM minus reserve'; the 0.3.x sampler's cond batching"),
    Use("comfy.model_management.get_torch_device", kind="callable", note="a patcher for old upscale models"),
    Use("comfy.model_management.unet_offload_device", kind="callable", note="likewise"),
    Use("comfy.model_management.cast_to_device", "fallback", ("tensor", "device", "dtype", "copy"), "callable",
        note=f"LoRA merge when {MP}.patch_weight_to_device has no return_weight"),
    Use("comfy.model_management.lora_compute_dtype", "guarded", ("device",), "callable",
        hosts="0.33.0", note="the merge's compute dtype; float32 without it"),
    Use("comfy.model_management.MAX_PINNED_MEMORY", "guarded", hosts="0.33.0",
        note="the host's pinning limit; the pack pins within what it leaves"),
    Use("comfy.model_management.TOTAL_PINNED_MEMORY", "guarded", hosts="0.33.0"),
    Use("comfy.model_management.STREAMS", "guarded", note="offload streams ordered after the engine's copies"),
    Use("comfy.model_management.get_offload_stream", "guarded", ("device",), "callable"),
    Use("comfy.cli_args.args.disable_pinned_memory", "guarded", hosts="0.33.0"),
    # --- weight patches (LoRA) ---------------------------------------------------------------
    Use("comfy.model_patcher.get_key_weight", params=("model", "key"), kind="callable",
        note="returns (weight, set_func, convert_func)"),
    Use("comfy.model_patcher.LowVramPatch", kind="class", note="the host's per-forward LoRA function"),
    Use("comfy.model_patcher.wipe_lowvram_weight", params=("m",), kind="callable"),
    Use("comfy.model_patcher.string_to_seed", "fallback", ("data",), "callable",
        hosts="0.3.64, 0.33.0", note="when comfy.utils.string_to_seed is absent"),
    Use("comfy.utils.string_to_seed", "guarded", ("data",), "callable", hosts="0.33.0"),
    Use("comfy.lora.calculate_weight", "fallback", ("patches", "weight", "key"), "callable",
        note=f"LoRA merge when {MP}.patch_weight_to_device has no return_weight"),
    Use("comfy.float.stochastic_rounding", "fallback", ("value", "dtype", "seed"), "callable", note="likewise"),
    # --- ModelPatcher: subclassed, its methods overridden and called through super() ----------
    Use(MP, kind="class"),
    Use(f"{MP}.partially_load", params=("device_to", "extra_memory", "force_patch_weights"), kind="callable"),
    Use(f"{MP}.load", params=("device_to", "lowvram_model_memory", "force_patch_weights", "full_load"),
        kind="callable"),
    Use(f"{MP}.unpatch_model", params=("device_to", "unpatch_weights"), kind="callable"),
    Use(f"{MP}.detach", params=("unpatch_all",), kind="callable"),
    Use(f"{MP}.patch_hooks", kind="callable", note="hook LoRAs write weights in place"),
    Use(f"{MP}.clone", kind="callable", note="must keep the subclass and call attachments' on_model_patcher_clone"),
    Use(f"{MP}.model_size", kind="callable"),
    Use(f"{MP}.patch_weight_to_device", params=("key", "device_to"), kind="callable"),
    Use(f"{MP}.patch_weight_to_device.return_weight", "guarded", kind="source", hosts="0.33.0",
        pattern=r"def patch_weight_to_device\([^)]*return_weight", note="the host's merge returns the merged weight"),
    Use(f"{MP}.get_free_memory", "guarded", ("device",), "callable", hosts="0.33.0"),
    Use(f"{MP}.is_dynamic", "guarded", kind="callable", hosts="0.33.0"),
    Use(f"{MP}.add_wrapper_with_key", params=("wrapper_type", "key", "wrapper"), kind="callable"),
    Use(f"{MP}.remove_wrappers_with_key", params=("wrapper_type", "key"), kind="callable"),
    Use(f"{MP}.add_callback_with_key", params=("call_type", "key", "callback"), kind="callable"),
    Use(f"{MP}.remove_callbacks_with_key", params=("call_type", "key"), kind="callable"),
    Use(f"{MP}.__init__", params=("model", "load_device", "offload_device"), kind="callable"),
    Use(f"{MP}().attachments", kind="instance", note="a dict, copied to clones"),
    Use(f"{MP}().patches", kind="instance"),
    Use(f"{MP}().backup", kind="instance"),
    Use(f"{MP}().patches_uuid", "guarded", kind="instance"),
    Use(f"{MP}().model", kind="instance"),
    Use(f"{MP}().load_device", kind="instance"),
    Use(f"{MP}().offload_device", kind="instance"),
    Use(f"{MP}().model.model_loaded_weight_memory", kind="instance"),
    Use(f"{MP}().model.dynamic_patchers", "guarded", kind="source", hosts="0.33.0",
        pattern=r"\.dynamic_patchers\b", note="set on the module by dynamic-VRAM patchers only"),
    Use("comfy.patcher_extension.CallbacksMP.ON_CLEANUP"),
    Use("comfy.patcher_extension.CallbacksMP.ON_DETACH"),
    Use("comfy.patcher_extension.CallbacksMP.ON_PRE_RUN", "guarded"),
    Use("comfy.patcher_extension.WrappersMP.APPLY_MODEL",
        note="wrapper(executor, *args, **kwargs); executor.class_obj is the BaseModel (.diffusion_model, "
             ".current_patcher)"),
    Use("comfy.patcher_extension.WrappersMP.CALC_COND_BATCH", "fallback",
        note=f"when {MP}.get_free_memory is absent; wraps the model's memory_required"),
    Use("comfy.model_base.BaseModel.memory_required", "fallback", kind="callable", note="likewise"),
    # --- what the host hangs on modules (read by name, put aside while VRAMCut runs) -----------
    Use("prev_comfy_cast_weights", kind="source", note="low-VRAM mark on a module (comfy/model_patcher.py)"),
    Use("weight_function", kind="source", note="per-forward weight functions on a module"),
    Use("bias_function", kind="source"),
    *(Use(a, "guarded", kind="source", hosts="0.33.0 (dynamic VRAM)",
          note="dynamic-VRAM state on a module (nodes/host.py DYNAMIC_MODULE_ATTRS)")
      for a in ("_v", "_v_signature", "_v_block", "_v_block_faulted", "_prefetch", "_comfy_graph")),
    Use("comfy.model_prefetch.pause_malloc_graph", "guarded", kind="callable", hosts="neither",
        note="a no-op without it: absent from 0.3.64 and 0.33.0"),
    # --- CLIP, VAE, CLIP vision ------------------------------------------------------------------
    Use("comfy.sd.CLIP", kind="class"),
    Use("comfy.sd.CLIP.clone", kind="callable"),
    Use("comfy.sd.CLIP.encode_from_tokens", params=("tokens",), kind="callable"),
    Use("comfy.sd.CLIP.encode_from_tokens_scheduled", params=("tokens",), kind="callable"),
    Use("comfy.sd.CLIP.generate", "guarded", kind="callable", hosts="0.33.0"),
    Use("comfy.sd.VAE", kind="class"),
    *(Use(f"comfy.sd.VAE.{m}", kind="callable") for m in ("decode", "decode_tiled", "encode", "encode_tiled")),
    Use("comfy.sd.VAE.prepare_decode", "guarded", kind="callable", hosts="0.33.0"),
    Use("comfy.clip_vision.ClipVisionModel.encode_image", kind="callable",
        note="the patched copy wraps .model.forward during it"),
    # --- server and V3 node API ------------------------------------------------------------------
    # (read from server.py and main.py: importing ComfyUI's server outside it is fragile)
    Use("server.PromptServer.instance", "guarded", kind="source", pattern=r"PromptServer\.instance = self",
        note="set when the server starts; absent in library use"),
    Use("server.PromptServer.send_sync", "guarded", kind="source", pattern=r"def send_sync\(self, event, data"),
    Use("server.PromptServer.last_prompt_id", "guarded", kind="source",
        pattern=r"server_instance\.last_prompt_id = ", note="set on the instance by main.py's prompt worker"),
    Use("comfy_api.latest.ComfyExtension", kind="class"),
    Use("comfy_api.latest.ComfyExtension.get_node_list", kind="callable"),
    Use("comfy_api.latest.io.ComfyNode", kind="class"),
    Use("comfy_api.latest.io.Schema", kind="callable",
        params=("node_id", "display_name", "category", "description", "inputs", "outputs", "hidden",
                "is_output_node")),
    Use("comfy_api.latest.io.NodeOutput", kind="callable", params=("ui",)),
    Use("comfy_api.latest.io.Hidden.unique_id"),
    Use("comfy_api.latest.io.Float.Input", kind="callable",
        params=("id", "default", "min", "max", "step", "round", "tooltip")),
    Use("comfy_api.latest.io.Combo.Input", kind="callable", params=("id", "options", "default", "tooltip")),
    Use("comfy_api.latest.io.Boolean.Input", kind="callable", params=("id", "default", "tooltip")),
    *(Use(f"comfy_api.latest.io.{t}.{d}", kind="callable",
          params=("id", "optional", "tooltip") if d == "Input" else ("display_name", "tooltip"))
      for t in ("Model", "Clip", "Vae", "UpscaleModel", "ClipVision") for d in ("Input", "Output")),
)
