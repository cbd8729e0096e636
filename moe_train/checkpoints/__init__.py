"""Checkpoints on disk: the orbax layout of a run's steps, their manifests, and the one verified
reader every consumer of a checkpoint's arrays goes through.

* ``checkpoint``: save and restore the train state (``Checkpointer``, periodic, asynchronous,
  keep-last-N, atomic), ``read_manifest`` and the damage rules (``refuse_damage``,
  ``try_step``), the layer-layout conversion on restore, ``quiet_reads``;
* ``manifest``: each saved array's shape, dtype, checksums and finiteness, and ``verify``.

The trainer saves and resumes through them (``moe_train.train.resume`` picks the step);
``moe_train.convert`` (``to-hf``, ``score``, ``train.init_from``'s weights) and
``moe_train.eval`` read through them, without importing the training loop.

May import: ``moe_train.base``, ``moe_train.config`` and ``moe_train.model`` (the layer layouts
a restore converts between). Never the training loop, the data, the launcher or the planners.
"""
