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
``newest``: what ComfyUI 0.38.x has, read from the stored upstream sources (repository
Comfy-Org/ComfyUI; its comfyui_version.py reads 0.38.1 at 20ca544). ``same (<file>)`` means the
name is there and its signature accepts ``params``; anything else says what changed. The file and
the commit each entry was read at are in ``FILE_COMMITS``. The index keeps several undated versions
of most files (66 of comfy/model_patcher.py, which is not stored at 20ca544), so the version
read is the one the index serves by default: not necessarily the 0.38.1 one, and not a release
checked out whole. Two files are not in the index at all:
comfy/patcher_extension.py (its ``CallbacksMP`` / ``WrappersMP`` members are read from the host
code that uses them) and comfy_api/latest/_io_public.py (``comfy_api.latest.io`` is bound to it;
on 0.33.0 it re-exports ``_io``'s ``__all__``, which in the newest ``_io`` lists every name used).
"""
from __future__ import annotations

import dataclasses

NOT_CONSULTED = ("not consulted: listed after the 0.38.x reading in FILE_COMMITS; read the newest "
                 "file defining it and fill this in")

# The upstream files read for ``newest``, each at the commit of the version read.
FILE_COMMITS = {
    "comfyui_version.py": "20ca544ee0436721d8eb5f544665e490609f72c8",  # __version__ = "0.38.1"
    "comfy/model_patcher.py": "08d0e510f4e539a1db39072589817136ac6cfa7d",
    "comfy/model_management.py": "02b2b3886164b1fa412d393a3ed0674b9d1cf010",
    "comfy/cli_args.py": "03294572a5566e41f7db38e15426bd3c04acce45",
    "comfy/utils.py": "09708eae709a992a5684bed3595ce4d07e705b4e",
    "comfy/lora.py": "17358c8f73b581a0d22facc3c385822f09b8bfb1",
    "comfy/float.py": "86d9f43e95ff66e1d64bcfa5942f0f69eebc4105",
    "comfy/model_base.py": "094c74c1b7f9cd5cdd9015741e8eb26acff1142a",
    "comfy/samplers.py": "311c01406130b2acbe8ab291043502de26cf3871",
    "comfy/model_prefetch.py": "03fb330a7f50e51fd7b3de126a288b089871c5e6",
    "comfy/ldm/qwen_image21/model.py": "08f68f0919d24164469557ca198b8e725c4fd237",  # opens a recording
    "comfy_extras/nodes_upscale_model.py": "30a74432c780b220aead6c33ab2ebc265678e5e3",
    "comfy/sd.py": "033046cc4fac82d954c6daedccf1c8128433c4f1",
    "comfy/clip_vision.py": "71c5239fe2e73e9968fd8449c4a200199160fddd",
    "comfy_api/latest/__init__.py": "168efe45bb99ae9dd3d565efd7e7b22e99a8c49f",
    "comfy_api/latest/_io.py": "04e2a914334246661a77665aa14068a0670e3321",
    "server.py": "002c3fb9a504255ccb3edb668c08b8f56e63d14a",
    "main.py": "02018c7eb5887b889ba26d0f5c43fc1041026e71",
}

MM_SAME = "same (comfy/model_management.py)"
MP_SAME = "same (comfy/model_patcher.py)"
SD_SAME = "same (comfy/sd.py)"
IO_SAME = "same (comfy_api/latest/_io.py, in its __all__)"
PE_BY_USE = "same, by use in {}: comfy/patcher_extension.py is not in the index"


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
        note="budget mode 'free VRAM minus reserve'; the 0.3.x sampler's cond batching",
        newest=MM_SAME + ": get_free_memory(dev=None, torch_free_too=False)"),
    Use("comfy.model_management.get_total_memory", params=("dev",), kind="callable",
        note="a Devices node's reserve_gb checked against each 'free' device's total memory before any model loads"),
    Use("comfy.model_management.get_torch_device", kind="callable",
        note="a patcher for old upscale models; the host's main device, which a devices list must name",
        newest=MM_SAME),
    Use("comfy.model_management.unet_offload_device", kind="callable", note="likewise", newest=MM_SAME),
    Use("comfy.model_management.cast_to_device", "fallback", ("tensor", "device", "dtype", "copy"), "callable",
        note=f"LoRA merge when {MP}.patch_weight_to_device has no return_weight",
        newest=MM_SAME + ": cast_to_device(tensor, device, dtype, copy=False)"),
    Use("comfy.model_management.lora_compute_dtype", "guarded", ("device",), "callable",
        hosts="0.33.0", note="the merge's compute dtype; float32 without it", newest=MM_SAME),
    Use("comfy.model_management.MAX_PINNED_MEMORY", "guarded", hosts="0.33.0",
        note="the host's pinning limit; the pack pins within what it leaves", newest=MM_SAME),
    Use("comfy.model_management.TOTAL_PINNED_MEMORY", "guarded", hosts="0.33.0", newest=MM_SAME),
    Use("comfy.model_management.unpin_memory", "guarded", ("tensor",), "callable", hosts="0.33.0",
        note="the host's unpin of its own page-locked weights, deferred to a forward's end",
        newest="same, by use in comfy/model_patcher.py (ModelPatcher.unpin_weight calls unpin_memory(weight))"),
    Use("comfy.model_management.STREAMS", "guarded", note="offload streams ordered after the engine's copies",
        newest=MM_SAME),
    Use("comfy.model_management.get_offload_stream", "guarded", ("device",), "callable", newest=MM_SAME),
    Use("comfy.cli_args.args.disable_pinned_memory", "guarded", hosts="0.33.0",
        newest="same (comfy/cli_args.py: --disable-pinned-memory)"),
    Use("comfy.cli_args.args.fast_disk", "guarded", hosts="0.33.0",
        note="read where the patcher has no fast_disk of its own (nodes/gpu.py host_fast_disk)",
        newest="same (comfy/cli_args.py: --fast-disk, forces disk-backed loading; ModelPatcher.fast_disk "
               "already applies it, comfy/storage.py model_fast_disk)"),
    Use("comfy.cli_args.args.disable_fast_disk", "guarded", hosts="neither",
        newest="added (comfy/cli_args.py: --disable-fast-disk, overrides --fast-disk)"),
    Use("comfy.cli_args.args.disable_comfy_compiler", "guarded", hosts="neither",
        note="set while VRAMCut runs a model, put back after (nodes/compiler.py); absent: no compiler",
        newest="added (comfy/cli_args.py: --disable-comfy-compiler, also turns off the compiler's CUDA graphs); "
               "comfy/model_prefetch.py's malloc_graph_enabled(device) reads it at every malloc_graph_begin, "
               "which Qwen-Image 2.1's forward calls around its blocks (comfy/ldm/qwen_image21/model.py)"),
    # --- weight patches (LoRA) ---------------------------------------------------------------
    Use("comfy.model_patcher.get_key_weight", params=("model", "key"), kind="callable",
        note="returns (weight, set_func, convert_func)", newest=MP_SAME),
    Use("comfy.model_patcher.LowVramPatch", kind="class", note="the host's per-forward LoRA function",
        newest=MP_SAME + ": LowVramPatch(key, patches, convert_func=None, set_func=None)"),
    Use("comfy.model_patcher.wipe_lowvram_weight", params=("m",), kind="callable", newest=MP_SAME),
    Use("comfy.model_patcher.string_to_seed", "fallback", ("data",), "callable",
        hosts="0.3.64, 0.33.0", note="when comfy.utils.string_to_seed is absent",
        newest=MP_SAME + ": logs that it moved to comfy.utils, then calls it"),
    Use("comfy.utils.get_attr", params=("obj", "attr"), kind="callable",
        note="the module holding a patched weight",
        newest="same, by use in comfy/model_patcher.py (get_key_weight calls get_attr(model, key))"),
    Use("comfy.utils.string_to_seed", "guarded", ("data",), "callable", hosts="0.33.0",
        newest="same (comfy/utils.py)"),
    Use("comfy.lora.calculate_weight", "fallback", ("patches", "weight", "key"), "callable",
        note=f"LoRA merge when {MP}.patch_weight_to_device has no return_weight",
        newest="same (comfy/lora.py): calculate_weight(patches, weight, key, intermediate_dtype=torch.float32, "
               "original_weights=None)"),
    Use("comfy.lora.calculate_shape", "guarded", ("patches", "weight", "key"), "callable", hosts="0.33.0",
        note="patches that change a weight's shape are never merged into a device copy",
        newest="same, by use in comfy/model_patcher.py (ModelPatcher.load calls calculate_shape(patches, weight, "
               "key) and merges a low-VRAM weight whose shape it changes on the host)"),
    Use("comfy.float.stochastic_rounding", "fallback", ("value", "dtype", "seed"), "callable", note="likewise",
        newest="same (comfy/float.py): stochastic_rounding(value, dtype, seed=0)"),
    # --- ModelPatcher: subclassed, its methods overridden and called through super() ----------
    Use(MP, kind="class", newest=MP_SAME),
    Use(f"{MP}.partially_load", params=("device_to", "extra_memory", "force_patch_weights"), kind="callable",
        newest=MP_SAME),
    Use(f"{MP}.load", params=("device_to", "lowvram_model_memory", "force_patch_weights", "full_load"),
        kind="callable",
        newest=MP_SAME + "; new: a low-VRAM weight whose patch changes its shape (comfy.lora.calculate_shape) "
                         "is merged on the host, the original kept in .backup (0.33.0 patches it per forward)"),
    Use(f"{MP}.unpatch_model", params=("device_to", "unpatch_weights"), kind="callable", newest=MP_SAME),
    Use(f"{MP}.detach", params=("unpatch_all",), kind="callable", newest=MP_SAME),
    Use(f"{MP}.is_clone", params=("other",), kind="callable",
        note="overridden: load_models_gpu asks the patcher it loads, then detaches every clone it finds; "
             "a clone of the same patch is detached only to be loaded again (its engines keep their copies)",
        newest=MP_SAME + "; comfy/model_management.py (load_models_gpu) detaches each clone with "
                         "detach(unpatch_all=False), as 0.3.64 and 0.33.0 do"),
    Use(f"{MP}.unpin_all_weights", "guarded", kind="callable", hosts="0.33.0",
        note="overridden: inside a forward the host's unpin waits for the forward's end (nodes/patcher.py)",
        newest=MP_SAME + ": unpins each key of self.pinned through unpin_weight"),
    Use(f"{MP}.patch_hooks", kind="callable", note="hook LoRAs write weights in place",
        newest=MP_SAME + ": patch_hooks(hooks)"),
    Use(f"{MP}.clone", kind="callable", note="must keep the subclass and call attachments' on_model_patcher_clone",
        newest=MP_SAME + ": clone(disable_dynamic=False, model_override=None, force_deepcopy=False) builds "
                         "self.__class__ and calls each attachment's on_model_patcher_clone"),
    Use(f"{MP}.model_size", kind="callable", newest=MP_SAME),
    Use(f"{MP}.loaded_size", kind="callable", note="overridden: adds what the engines hold on the load device "
        "(LoadedModel.model_offloaded_memory is model_size - loaded_size)", newest=MP_SAME),
    Use(f"{MP}.patch_weight_to_device", params=("key", "device_to"), kind="callable", newest=MP_SAME),
    Use(f"{MP}.patch_weight_to_device.return_weight", "guarded", kind="source", hosts="0.33.0",
        pattern=r"def patch_weight_to_device\([^)]*return_weight", note="the host's merge returns the merged weight",
        newest=MP_SAME),
    Use(f"{MP}.get_free_memory", "guarded", ("device",), "callable", hosts="0.33.0",
        newest=MP_SAME + ": adds what comfy-aimdo could free when dynamic VRAM is on"),
    Use(f"{MP}.is_dynamic", "guarded", kind="callable", hosts="0.33.0", newest=MP_SAME),
    Use(f"{MP}.add_wrapper_with_key", params=("wrapper_type", "key", "wrapper"), kind="callable", newest=MP_SAME),
    Use(f"{MP}.remove_wrappers_with_key", params=("wrapper_type", "key"), kind="callable", newest=MP_SAME),
    Use(f"{MP}.add_callback_with_key", params=("call_type", "key", "callback"), kind="callable", newest=MP_SAME),
    Use(f"{MP}.remove_callbacks_with_key", params=("call_type", "key"), kind="callable", newest=MP_SAME),
    Use(f"{MP}.__init__", params=("model", "load_device", "offload_device"), kind="callable",
        newest=MP_SAME + "; it also takes fast_disk=False (not in 0.33.0), which clone() passes by keyword to "
                         "the patcher's own class: a subclass overriding __init__ must accept it"),
    Use(f"{MP}().attachments", kind="instance", note="a dict, copied to clones", newest=MP_SAME),
    Use(f"{MP}().patches", kind="instance", newest=MP_SAME),
    Use(f"{MP}().backup", kind="instance", newest=MP_SAME),
    Use(f"{MP}().patches_uuid", "guarded", kind="instance", newest=MP_SAME),
    Use(f"{MP}().model", kind="instance", newest=MP_SAME),
    Use(f"{MP}().load_device", kind="instance", newest=MP_SAME),
    Use(f"{MP}().offload_device", kind="instance", newest=MP_SAME),
    Use(f"{MP}().model.model_loaded_weight_memory", kind="instance", newest=MP_SAME),
    Use(f"{MP}().model.dynamic_patchers", "guarded", kind="source", hosts="0.33.0",
        pattern=r"\.dynamic_patchers\b", note="set on the module by dynamic-VRAM patchers only",
        newest=MP_SAME + ": a set of patcher ids, filled by ModelPatcherDynamic.__init__"),
    Use("comfy.patcher_extension.CallbacksMP.ON_CLEANUP",
        newest=PE_BY_USE.format("comfy/model_patcher.py (ModelPatcher.cleanup)")),
    Use("comfy.patcher_extension.CallbacksMP.ON_DETACH",
        newest=PE_BY_USE.format("comfy/model_patcher.py (ModelPatcher.detach)")),
    Use("comfy.patcher_extension.CallbacksMP.ON_PRE_RUN", "guarded",
        newest=PE_BY_USE.format("comfy/model_patcher.py (ModelPatcher.pre_run)")),
    Use("comfy.patcher_extension.WrappersMP.APPLY_MODEL",
        note="wrapper(executor, *args, **kwargs); executor.class_obj is the BaseModel (.diffusion_model, "
             ".current_patcher)",
        newest=PE_BY_USE.format("comfy/model_base.py (BaseModel.apply_model wraps _apply_model in "
                                "new_class_executor(..., self, ...): class_obj is still the BaseModel)")),
    Use("comfy.patcher_extension.WrappersMP.OUTER_SAMPLE",
        note="wrapper(executor, *args, **kwargs) around the whole sampling run: the compiler kept off",
        newest=PE_BY_USE.format("comfy/samplers.py (CFGGuider.sample wraps outer_sample)")),
    Use("comfy.patcher_extension.copy_nested_dicts", params=("input_dict",), kind="callable",
        note="the plan preview joins the patcher's transformer options as the sampler does",
        newest=PE_BY_USE.format("comfy/samplers.py (prepare_model_patcher)")),
    Use("comfy.patcher_extension.merge_nested_dicts", params=("dict1", "dict2", "copy_dict1"), kind="callable",
        note="likewise", newest=PE_BY_USE.format("comfy/samplers.py (prepare_model_patcher)")),
    Use("comfy.samplers.encode_model_conds", params=("model_function", "conds", "noise", "device", "prompt_type"),
        kind="callable", note="the plan preview forms a family's conditioning with the host's extra_conds",
        newest="same (comfy/samplers.py): encode_model_conds(model_function, conds, noise, device, prompt_type, "
               "**kwargs)"),
    Use("comfy.patcher_extension.WrappersMP.CALC_COND_BATCH", "fallback",
        note=f"when {MP}.get_free_memory is absent; wraps the model's memory_required",
        newest=PE_BY_USE.format("comfy/samplers.py (calc_cond_batch)")),
    Use("comfy.model_base.BaseModel.memory_required", "fallback", kind="callable", note="likewise",
        newest="same (comfy/model_base.py): memory_required(input_shape, cond_shapes={}); the fallback is not "
               "taken there, since _calc_cond_batch asks model.current_patcher.get_free_memory"),
    # --- what the host hangs on modules (read by name, put aside while VRAMCut runs) -----------
    Use("prev_comfy_cast_weights", kind="source", note="low-VRAM mark on a module (comfy/model_patcher.py)",
        newest=MP_SAME),
    Use("weight_function", kind="source", note="per-forward weight functions on a module", newest=MP_SAME),
    Use("bias_function", kind="source", newest=MP_SAME),
    *(Use(a, "guarded", kind="source", hosts="0.33.0 (dynamic VRAM)",
          note="dynamic-VRAM state on a module (nodes/patcher.py DYNAMIC_MODULE_ATTRS)",
          newest=("same (comfy/model_patcher.py, ModelPatcherDynamic.load)" if a in ("_v", "_v_signature", "_v_block")
                  else "same (comfy/model_prefetch.py)"))
      for a in ("_v", "_v_signature", "_v_block", "_v_block_faulted", "_prefetch", "_comfy_graph")),
    Use("comfy.model_prefetch.pause_malloc_graph", "guarded", kind="callable", hosts="neither",
        note="a no-op without it: absent from 0.3.64 and 0.33.0",
        newest="added (comfy/model_prefetch.py): pause_malloc_graph(sync=False) returns a context manager; "
               "the host's own VAE.decode wraps its loads in it"),
    # --- CLIP, VAE, CLIP vision ------------------------------------------------------------------
    Use("comfy.sd.CLIP", kind="class", newest=SD_SAME),
    Use("comfy.sd.CLIP.clone", kind="callable", newest=SD_SAME + ": clone(disable_dynamic=False)"),
    Use("comfy.sd.CLIP.encode_from_tokens", params=("tokens",), kind="callable", newest=SD_SAME),
    Use("comfy.sd.CLIP.encode_from_tokens_scheduled", params=("tokens",), kind="callable", newest=SD_SAME),
    Use("comfy.sd.CLIP.generate", "guarded", kind="callable", hosts="0.33.0",
        newest=SD_SAME + ": generate(tokens, ...), every further parameter with a default; adds mtp=True"),
    Use("comfy.sd.VAE", kind="class", newest=SD_SAME),
    *(Use(f"comfy.sd.VAE.{m}", kind="callable", newest=SD_SAME + {
        "decode": ": decode(samples_in, vae_options={}); tiles at once when the first-stage model says "
                  "comfy_decode_estimate_is_reliable and its estimate exceeds the patcher's free memory",
        "encode": ": encode(pixel_samples, not_video=None)"}.get(m, ""))
      for m in ("decode", "decode_tiled", "encode", "encode_tiled")),
    Use("comfy.sd.VAE.prepare_decode", "guarded", kind="callable", hosts="0.33.0",
        newest=SD_SAME + ": prepare_decode(sample_shape, memory_required=None)"),
    Use("comfy.clip_vision.ClipVisionModel.encode_image", kind="callable",
        note="the patched copy wraps .model.forward during it",
        newest="same (comfy/clip_vision.py): encode_image(image, crop=True) calls self.model(...)"),
    # --- server and V3 node API ------------------------------------------------------------------
    # (read from server.py and main.py: importing ComfyUI's server outside it is fragile)
    Use("server.PromptServer.instance", "guarded", kind="source", pattern=r"PromptServer\.instance = self",
        note="set when the server starts; absent in library use",
        newest="same (server.py): set in __init__(self, loop, asset_manager)"),
    Use("server.PromptServer.send_sync", "guarded", kind="source", pattern=r"def send_sync\(self, event, data",
        newest="same (server.py): send_sync(self, event, data, sid=None)"),
    Use("server.PromptServer.last_prompt_id", "guarded", kind="source",
        pattern=r"server_instance\.last_prompt_id = ", note="set on the instance by main.py's prompt worker",
        newest="same (main.py, prompt_worker)"),
    Use("comfy_api.latest.ComfyExtension", kind="class", newest="same (comfy_api/latest/__init__.py)"),
    Use("comfy_api.latest.ComfyExtension.get_node_list", kind="callable",
        newest="same (comfy_api/latest/__init__.py): async, abstract"),
    Use("comfy_api.latest.io.ComfyNode", kind="class", newest=IO_SAME),
    Use("comfy_api.latest.io.Schema", kind="callable",
        params=("node_id", "display_name", "category", "description", "inputs", "outputs", "hidden",
                "is_output_node"), newest=IO_SAME + ": a dataclass with these fields"),
    Use("comfy_api.latest.io.NodeOutput", kind="callable", params=("ui",), newest=IO_SAME),
    Use("comfy_api.latest.io.Hidden.unique_id", newest=IO_SAME),
    Use("comfy_api.latest.io.Float.Input", kind="callable",
        params=("id", "default", "min", "max", "step", "round", "tooltip"), newest=IO_SAME),
    Use("comfy_api.latest.io.Combo.Input", kind="callable", params=("id", "options", "default", "tooltip"),
        newest=IO_SAME),
    Use("comfy_api.latest.io.Boolean.Input", kind="callable", params=("id", "default", "tooltip"),
        newest=IO_SAME),
    Use("comfy_api.latest.io.Int.Input", kind="callable", params=("id", "default", "min", "max", "step", "tooltip"),
        note="the Preview shape node's widgets", newest=IO_SAME),
    Use("comfy_api.latest.io.Custom", kind="callable", params=("io_type",),
        note="the VRAMCUT_SHAPE and VRAMCUT_DEVICES sockets between the small nodes and the Max VRAM nodes",
        newest=IO_SAME),
    Use("comfy_api.latest.io.String.Input", kind="callable", params=("id", "default", "tooltip"),
        note="the Devices node's text", newest=IO_SAME),
    Use(f"{MP}.get_additional_models_with_key", "guarded", ("key",), "callable",
        note="'multigpu': the copies ComfyUI's MultiGPU CFG Split made (refused beside devices)"),
    *(Use(f"comfy_api.latest.io.{t}.{d}", kind="callable",
          params=("id", "optional", "tooltip") if d == "Input" else ("display_name", "tooltip"),
          newest=IO_SAME)
      for t in ("Model", "Clip", "Vae", "UpscaleModel", "ClipVision") for d in ("Input", "Output")),
)
