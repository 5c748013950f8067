"""Stand-ins for what the newest host (ComfyUI 0.38) does differently, shared by the tests that
put them on the hosts they run on (``tests/comfy/test_newest_host.py``, ``test_fast_disk.py``)."""
from __future__ import annotations


def newest_patcher_class():
    import comfy.model_patcher

    class NewestPatcher(comfy.model_patcher.ModelPatcher):
        """A patcher taking ``fast_disk`` and cloning as 0.38 does: through its own class, with
        ``fast_disk`` by keyword (``NEWEST["fast_disk"]`` in tests/comfy/test_newest_host.py)."""

        def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False,
                     fast_disk=False):
            super().__init__(model, load_device, offload_device, size, weight_inplace_update=weight_inplace_update)
            self.fast_disk = fast_disk

        def clone(self, *args, **kwargs):
            made = super().clone(*args, **kwargs)
            n = type(made)(made.model, made.load_device, made.offload_device, made.model_size(),
                           weight_inplace_update=made.weight_inplace_update, fast_disk=self.fast_disk)
            n.__dict__.update({k: v for k, v in made.__dict__.items() if k != "fast_disk"})
            return n

    return NewestPatcher
