"""Hardware facts about the machines a run lands on.

``topology.peaks`` maps a JAX ``device.device_kind`` string to the device's dense peak FLOP/s,
which the trainer divides into its achieved FLOP/s to report MFU.

``topology.presets`` describes whole clusters (cpu-local, h100-dgx, h200-hgx, b200-hgx,
gb200-nvl72, gb200-nvl36x2) from small TOML files: GPUs per node, NVLink domain size, one-way
NVLink and NIC bandwidth per GPU, NCCL latencies, achieved-bandwidth efficiencies, peak
FLOP/s, environment variables with their sources, Slurm options and container images.
``load(name)`` returns a validated ``Cluster``; ``load(path)`` does the same for a site's own
file.

``topology.discovery`` finds the NVLink domain of every device of a running job (NVML fabric
info, JAX's partition index, the Slurm block, the host) and checks it against a preset;
``topology.placement`` orders the devices so that EP groups stay inside domains and picks the
Slurm allocation shape (``--segment``); ``python -m topology probe`` measures the all-to-all
and writes a calibration file (``topology.calibration``);
``topology.xla_flags`` checks a preset's XLA_FLAGS against the installed XLA.

``topology.device_mesh`` is the trainer's mesh: the cluster preset ``parallel.cluster`` names
(checked there), the discovered domains and the placement applied to a job's devices.

What a job will cost on these machines (the all-to-all cost model, the step time, the EP
plan) is the planner's (``moe_train.planner``), which reads these facts.

May import: ``moe_train.base``, ``moe_train.config``, ``moe_train.model`` (FLOPs) and
``moe_train.parallel`` (the job rules, the mesh): the mesh builds on the model's config.
Never the training loop, the planner, the launcher or the benchmarks; no package ``topology``
imports imports it back (the config does not read cluster presets).
"""
