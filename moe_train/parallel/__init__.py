"""How a job is split over devices, before and while it runs.

* ``jobplan``: every rule about a job's expert-parallel plan (capacity buckets, slots, stage
  sizes, the dispatcher choice, divisibility), importing no JAX: the trainer, the memory
  planner, ``topology`` and the launcher all read the same rules;
* ``sharding``: the device mesh and the one table that maps the model's logical axis names
  to mesh axes;
* ``layout``: where each device sits in the mesh (``topology``'s placement applied to a job).

May import: ``moe_train.config``, ``topology`` (discovery, placement, presets). Never the
model, the MoE layer, the training loop, the launcher or the planners.
"""
