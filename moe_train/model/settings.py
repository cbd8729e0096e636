"""What the model reads of a run's config: ``ModelSettings``, built by ``model_settings(cfg)``.

The model's modules (``transformer``, ``layers``, ``mla``, ``mtp``) take these settings, never
the whole ``Config``: the transformer shape, the MoE layer, RoPE, the compute precision, the
benchmark-only ``[study]`` keys the MoE layer obeys, and ``train.remat``. Nothing of the
loop, the data, the optimizer or the mesh reaches the model (the expert-parallel plan is a
module argument of its own).

``platform`` is the target the modules choose their kernels for (the grouped-GEMM backend and
its tiles, the attention kernel, Transformer Engine's fp8): this process's JAX backend unless
the caller names another (``make compile`` names the target GPU, ``moe_train.planner.compile.facts``).
``policy`` is ``[precision]`` resolved for it once per settings object (the modules read it at
every call; it was rebuilt at each one).
"""

from __future__ import annotations

import dataclasses
import functools

from moe_train.base.calls import from_names
from moe_train.base.platform import Platform
from moe_train.config import Config, ModelConfig, MoEConfig, PrecisionConfig, RopeConfig, StudyConfig
from moe_train.model import precision


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The config sections the model reads (frozen, hashable: a flax module attribute)."""

    model: ModelConfig  # [model]: the transformer's shape
    moe: MoEConfig  # [moe]: router, experts, grouped GEMM backend
    rope: RopeConfig  # [rope]: rotary position embeddings
    precision: PrecisionConfig  # [precision]: compute dtype and fp8 scaling
    study: StudyConfig  # [study]: forced-balance routing, the token-dropping baseline (benchmarks only)
    remat: str  # train.remat: activation checkpointing per block (moe_train.model.remat)
    platform: Platform | None = None  # the target; None: this process's, read at first use

    @functools.cached_property
    def target(self) -> Platform:
        """The platform the modules build for: ``platform``, else ``Platform.here()`` (read
        at first use, so settings made before JAX's backend starts do not start it)."""
        return Platform.here() if self.platform is None else self.platform

    @functools.cached_property
    def policy(self) -> precision.Policy:
        """``[precision]`` resolved for the target, at first use (a ConfigError, e.g. fp8 on
        Transformer Engine where it cannot run, is raised there)."""
        return precision.policy(self.precision, self.target)


def model_settings(cfg: Config, platform: Platform | None = None) -> ModelSettings:
    """The settings of ``cfg`` that the model reads, built for ``platform`` (None: this process's)."""
    return from_names(ModelSettings, cfg, remat=cfg.train.remat, platform=platform)  # its sections
