"""The planner: will a job fit, how fast will it run, and which settings make it fastest, all
answered before anything is submitted. One package, asked by the launcher and the command-line
tools only; the trainer never imports it (the entry point hands the trainer its memory check,
``memory.trainer``).

- ``request``: the job request the launcher and the planner share (``Request``, ``LaunchError``).
- ``layout``: the trainer's config of a request, its EP size, placement and arguments.
- ``memory``: the per-GPU memory estimate, budget and verdict (``python -m moe_train.planner.memory``).
- ``cost``, ``steptime``, ``compute`` (+ ``compute.toml``, ``anchors.toml``): the all-to-all cost,
  the step-time model and its measured efficiencies; ``ep_plan``: the EP plan against a
  topology-blind one (``python -m moe_train.planner.ep_plan``).
- ``search``, ``choices``: the fastest job that fits, and which keys the planner decides.
- ``decide``: a request made into the job both ``make plan`` and ``make submit`` run.
- ``preflight``: the submit preflight's XLA:GPU compile and its cache, whose peak decides the
  verdict where one exists.
- ``compile``: ``make compile``, the job compiled by XLA:GPU without a GPU.
- ``show`` (``python -m moe_train.planner``): ``make plan``.

May import: ``moe_train.base``, ``moe_train.config``, ``moe_train.model``, ``moe_train.moe``,
``moe_train.parallel``, ``moe_train.selftest``, ``moe_train.data``, ``moe_train.train`` (only
``compile``, which lowers the real step) and ``topology`` (the machine facts). Never ``slurm``
(the launcher imports the planner, not the other way) and never the benchmarks.
"""
