"""How a job is split over devices, before and while it runs.

* ``jobplan``: every rule about a job's expert-parallel plan (capacity buckets, slots, stage
  sizes, the dispatcher choice, divisibility), importing no JAX: the trainer, the memory
  planner, ``topology`` and the launcher all read the same rules;
* ``sharding``: the device mesh and the one table that maps the model's logical axis names
  to mesh axes; the EP plans a mesh runs (``ep_plans``) and a batch as micro-batches
  (``micro_batches``), for the train step and the evaluation alike;
* ``together``: in a multi-process job, each jitted program compiled by every process before
  any process runs it (a barrier of JAX's coordination service), and the time that takes,
  which the step watchdog does not count.

Where each device sits in the mesh (``topology``'s placement applied to a job) is
``topology.device_mesh``: ``topology`` builds on this package.

May import: ``moe_train.config`` (and ``moe_train.base``). Never ``topology``, the model, the
MoE layer, the training loop, the launcher or the planners.
"""
