"""Compile the real training job for its GPU on a machine without one (``make compile``).

``python -m moe_train.planner.compile --preset CLUSTER --model MODEL --nodes N [--ep N] [--set k=v ...]
[--layers N] [--json] [--out DIR]`` builds the job as ``make submit`` would (``job``), makes
the cluster preset's GPUs as simulated devices from its XLA:GPU target config
(``topology.targets``, through the CUDA PJRT plugin: ``plugin``), chooses the kernels the
trainer would run there (``kernels``, built for that GPU's platform: ``facts``), and compiles the
trainer's own train step with XLA:GPU once per distinct capacity bucket the stepper can
choose (``lower``: a bucket capped at the worst case is the worst case's step, compiled once),
saying as each compile starts and every 10 s while it runs (``run``). It reports per bucket
XLA's per-GPU memory beside the memory planner's, the verdict against the usable memory, the
compile time, the kernels in the optimized HLO and every collective (``hlo``, ``report``), XLA's
own rematerialization and sort warnings as one note each (``xla_log``), and writes
``runs/compile/<UTC>/``. ``--plan-only`` prints the planner's column alone, compiling nothing.

Bad input (flags, presets, keys, EP sizes, a preset without a target config, a missing
plugin) is one ``error:`` line on stderr, exit 2.

May import: ``moe_train.config``, the rest of the planner (memory, the request's config and
choices, the preflight's cache), ``moe_train.model``, ``moe_train.moe``, ``moe_train.parallel``,
``moe_train.selftest`` (kernel candidates), ``moe_train.train`` (the step, the stepper's EP
plans), ``moe_train.data`` (the batch form) and ``topology`` (presets, targets, placement).
Imported by its entry point, the submit preflight, gpu-check's compile section and the
benchmarks (the HLO reader's ``shape_bytes``).
"""
