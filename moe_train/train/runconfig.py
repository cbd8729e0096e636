"""The one config a start of a run hands its loop: what was configured plus what was resolved.

A start resolves the user's config on the job in stages (``loop._run``, ``loop._started``):
``train.micro_batch_size`` as the micro-batches it means on the job's devices
(``config.for_devices``), the device mesh and expert-parallel placement
(``device_mesh.build``), then the kernels the self-test chose (``selftest.run``). Once the
self-test has run, ``loop._started`` builds one ``RunConfig`` of them; ``loop.Start`` and
``loop.Loop`` read only it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from moe_train.base.platform import Platform
from moe_train.config import Config
from topology import device_mesh


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A start's configuration, read by everything below the loop (module docstring)."""

    # As the user gave it ("auto" stays auto): config.json, the checkpoints' metadata and the
    # resume check compare this one.
    configured: Config
    # What runs: ``configured`` on this job (``train.micro_batch_size`` as ``micro_batches``
    # for its devices) with the kernels the self-test chose in place of "auto".
    resolved: Config
    # The job's device mesh and expert-parallel placement, with their log lines (layout.json).
    layout: device_mesh.Layout
    # The self-test's record (kernels.json): device, platform, each kernel chosen and why,
    # selftest_s.
    kernels: dict[str, Any]
    # The platform the kernels were chosen for and the step is built for (this process's).
    platform: Platform

    @property
    def mesh(self) -> Mesh:
        """The job's device mesh (``layout.mesh``)."""
        return self.layout.mesh
