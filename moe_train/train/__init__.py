"""Training: the state and its step, the loop around it, and everything a long job needs.

* ``step``: train state, optimizer and the jitted train step; ``stepper``: the compiled step
  per expert-parallel plan (capacity buckets, pipelined);
* ``loop``: resume, step, evaluate, log, checkpoint, stop cleanly (``run``); ``runconfig``:
  the one config a start hands its loop (configured plus resolved); ``cli``: the command line
  of ``python -m moe_train``;
* ``resume``: which verified checkpoint (``moe_train.checkpoints``) to resume from;
  ``runlock``: one trainer per run directory; ``guard``: non-finite steps;
* ``signals``: the stop flag (SIGTERM/SIGUSR2/SIGINT; the exit codes are
  ``moe_train.base.exits``); ``distributed``, ``supervise``: multi-process start-up and
  peer-failure supervision;
* ``metrics``, ``tracking``: the per-step record, TensorBoard and W&B.

May import anything of ``moe_train`` but ``bench``, ``study``, ``compile`` and ``gpucheck``
(they import it), and ``topology`` (the device mesh); nothing of ``slurm`` (the launcher
starts the loop, never the other way round). No package the loop imports imports it back.
"""
