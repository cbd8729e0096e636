"""Hardware facts about the machines a run lands on.

``topology.peaks`` maps a JAX ``device.device_kind`` string to the device's dense peak FLOP/s,
which the trainer divides into its achieved FLOP/s to report MFU.

``topology.presets`` describes whole clusters (cpu-local, h100-dgx, h200-hgx, b200-hgx,
gb200-nvl72, gb200-nvl36x2) from small TOML files: GPUs per node, NVLink domain size, one-way
NVLink and NIC bandwidth per GPU, NCCL latencies, achieved-bandwidth efficiencies, peak
FLOP/s, environment variables with their sources, Slurm options and container images.
``load(name)`` returns a validated ``Cluster``; ``load(path)`` does the same for a site's own
file.

``topology.cost`` is the uniform-routing all-to-all cost model the expert-parallel layout is
planned with: per-dispatch NVLink and network bytes and time, flat or hierarchical, and the
per-layer split between all-to-all and expert GEMM time.

``topology.discovery`` finds the NVLink domain of every device of a running job (NVML fabric
info, JAX's partition index, the Slurm block, the host) and checks it against a preset;
``topology.placement`` orders the devices so that EP groups stay inside domains and picks the
Slurm allocation shape (``--segment``); ``topology.plan`` and ``python -m topology plan``
explain a placement with the cost model against a topology-blind one; ``python -m topology
probe`` measures the all-to-all and writes a calibration file (``topology.calibration``);
``topology.xla_flags`` checks a preset's XLA_FLAGS against the installed XLA.

``topology.device_mesh`` is the trainer's mesh: the cluster preset ``parallel.cluster`` names
(checked there), the discovered domains and the placement applied to a job's devices.

``topology.steptime`` predicts a job's step time, tokens/s, model TFLOP/s and MFU per GPU
(compute by kind, the all-to-alls with their chunked overlap, FSDP traffic, the optimizer)
from the model config, the preset, the planned all-to-all and the efficiencies of
``topology.compute`` (``compute.toml``: shipped defaults with sources; ``anchors.toml``: the
published figures ``plan`` prints beside the prediction).

May import: ``moe_train.base``, ``moe_train.config``, ``moe_train.model`` (FLOPs) and
``moe_train.parallel`` (the job rules, the mesh): the planners and the mesh build on the
model's config. Never the training loop, the launcher or the benchmarks; no package
``topology`` imports imports it back (the config does not read cluster presets).
"""
