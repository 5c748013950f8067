"""The executor's rooms, one owner per resource (see docs/architecture.md).

``layout`` (where a unit's tensors sit in a flat buffer), ``host_memory`` (host masters and
page-locking), ``device_memory`` (every device byte), ``transfers`` (copy stream, events, reader
ordering), ``binding`` (pointer swaps and held weights) and ``unit_hooks`` (which modules tell
the executor that a unit runs). ``executor`` orchestrates them per forward.
"""
