"""The figures the planner plans from, found before or while a forward runs: ``trace`` (the dry
run on fake tensors: each unit's activation bytes and FLOPs before any weight moves), ``meters``
(input signatures, the activation meters and what a unit's measurement holds), ``bandwidth``
(host-to-device bandwidth and matrix-product throughput, measured once per device) and
``speed`` (the figures that time one engine's plans)."""
