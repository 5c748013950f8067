"""The executor and its rooms, one owner per resource (see docs/architecture.md).

``executor`` (``SegmentedExecutor``: one forward of a module under a plan) orchestrates the rooms:
``layout`` (where a unit's tensors sit in a flat buffer), ``host_memory`` (host masters and
page-locking), ``device_memory`` (every device byte), ``transfers`` (copy stream, events, reader
ordering), ``schedule_walk`` (which group is copied into which slot, and when), ``binding``
(pointer swaps and held weights), ``unit_hooks`` (which modules tell the executor that a unit
runs) and ``measuring`` (one forward's measurement). ``hops`` moves the tensors that cross
devices when one forward runs on several.
"""
