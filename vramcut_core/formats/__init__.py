"""Checkpoint files read from their header alone, no tensor loaded: ``safetensors_plan``
(safetensors headers, all-in-one checkpoints cut into components, the units a header plans to)
and ``gguf_header`` (a ``.gguf`` file's header in the same shape)."""
