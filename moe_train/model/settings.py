"""What the model reads of a run's config: ``ModelSettings``, built by ``model_settings(cfg)``.

The model's modules (``transformer``, ``layers``, ``mla``, ``mtp``) take these settings, never
the whole ``Config``: the transformer shape, the MoE layer, RoPE, the compute precision, the
benchmark-only ``[study]`` keys the MoE layer obeys, and ``train.remat``. Nothing of the
loop, the data, the optimizer or the mesh reaches the model (the expert-parallel plan is a
module argument of its own).

``policy`` is ``[precision]`` resolved for this platform once per settings object (the modules
read it at every call; it was rebuilt at each one).
"""

from __future__ import annotations

import dataclasses
import functools

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

    @functools.cached_property
    def policy(self) -> precision.Policy:
        """``[precision]`` resolved for JAX's default backend, at first use (a ConfigError,
        e.g. fp8 on Transformer Engine where it cannot run, is raised there)."""
        return precision.policy(self.precision)


def model_settings(cfg: Config) -> ModelSettings:
    """The settings of ``cfg`` that the model reads."""
    return ModelSettings(
        model=cfg.model,
        moe=cfg.moe,
        rope=cfg.rope,
        precision=cfg.precision,
        study=cfg.study,
        remat=cfg.train.remat,
    )
