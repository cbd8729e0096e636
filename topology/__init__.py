"""Hardware facts about the machines a run lands on.

``topology.peaks`` maps a JAX ``device.device_kind`` string to the device's dense peak FLOP/s,
which the trainer divides into its achieved FLOP/s to report MFU. This package is where the
cluster descriptions will live as well: NVLink domain sizes, per-GPU NVLink and scale-out
bandwidths, and the all-to-all cost model that the expert-parallel layout is planned with.
"""
