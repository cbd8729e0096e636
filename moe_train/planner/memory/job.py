"""The job an estimate is for: devices, EP/FSDP sizes, tokens per device, dispatcher, backend.

``setup_for`` applies the trainer's own rules (``moe_train.parallel.jobplan``) before anything is
estimated, so a plan the trainer would refuse is refused here with the same message
(``PlanError``, one line, naming valid choices): EP must divide the devices and the
experts, FSDP must divide the model width, the batch must divide over the devices, and (on
whole nodes) EP groups must be placeable inside NVLink domains
(``topology.placement.allocation``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from moe_train.config import Config, ConfigError, attention_dims, for_devices
from moe_train.parallel import jobplan
from moe_train.planner.memory.estimate import Setup
from moe_train.planner.memory.rows import tile_rows
from topology import targets
from topology.placement import PlacementError, allocation
from topology.presets import Cluster


class PlanError(ConfigError):
    """A job the trainer would refuse: printed as one ``error:`` line, exit code 2."""


@contextlib.contextmanager
def _as_plan_error():
    """A ConfigError of the shared job rules (``moe_train.parallel.jobplan``) as a PlanError."""
    try:
        yield
    except PlanError:
        raise
    except ConfigError as err:
        raise PlanError(str(err)) from None


def check_sizes(cfg: Config, devices: int, ep: int) -> int:
    """The FSDP size ``devices // ep``; PlanError where the trainer's mesh would fail."""
    with _as_plan_error():
        jobplan.check_ep(devices, ep, cfg.moe.num_experts)
        dp = jobplan.check_dp(devices, ep, cfg.parallel.dp)
        jobplan.check_width(cfg.model.hidden, dp)
        jobplan.check_batch(cfg.train.batch_size, devices, cfg.train.micro_batches)
    return dp


def _dispatcher(cfg: Config, devices: int, ep: int, domains: int) -> str:
    """``moe_train.parallel.sharding.ep_plans``' choice for this job (``jobplan.dispatcher``)."""
    with _as_plan_error():
        return jobplan.dispatcher(cfg.moe.dispatcher, devices, ep, domains)


def _backend(cfg: Config, cluster: Cluster) -> str:
    """``tiled`` on CPU presets or when asked for; ``auto`` as ``moe.gemm.resolve_backend``
    picks it on the preset's GPU: ``mgpu`` (sorted rows) on Hopper (sm_90), else ``tiled``
    (Blackwell: ``make compile`` compiles tiled there; Transformer Engine, first where the
    image has it, is not modelled); any other named backend: the grouped GEMMs on sorted rows."""
    if cfg.moe.backend == "tiled" or (cfg.moe.backend == "auto" and cluster.nominal):
        return "tiled"
    if cfg.moe.backend == "auto" and cluster.gpu and not _hopper(cluster.gpu):
        return "tiled"
    return "sorted"


def _hopper(gpu: str) -> bool:
    """Whether the preset's XLA:GPU target is sm_90 (where the ``mgpu`` kernels run)."""
    return targets.load(gpu).compute_capability[0] == 9


def attention_kind(cfg: Config, cluster: Cluster) -> str:
    """The attention implementation the job runs (xla, cudnn, chunked, te): ``auto`` as
    ``moe_train.model.attention.resolve`` picks it on the cluster's platform: on GPU presets
    cuDNN where it takes the dtype and head dims (bf16/fp16, equal q/k and v head dims that
    are multiples of 8 up to 256: every preset's GPU is Hopper or newer), else chunked from
    ``CHUNKED_MIN_SEQ`` tokens on; on CPU presets chunked from that length."""
    m, name = cfg.model, cfg.model.attention
    if name != "auto":
        return name
    d, j, _ = attention_dims(m)  # MLA: cuDNN refuses v head dim != q/k head dim
    if not cluster.nominal and cfg.precision.compute != "fp32" and d == j and d % 8 == 0 and d <= 256:
        return "cudnn"
    from moe_train.model.attention import CHUNKED_MIN_SEQ  # JAX: make plan stays JAX-free

    return "chunked" if cfg.train.seq_len >= CHUNKED_MIN_SEQ else "xla"


def attention_memory(cfg: Config, cluster: Cluster) -> str:
    """What the job's attention keeps per token (``estimate.Setup.attention``): "scores" for
    xla ([nh, S] scores); "mask" for cuDNN on packed documents (data.source=prepared with
    data.packing: ``moe_train.model.attention.fused`` turns the segment ids into a [B, 1, S, S]
    mask, which jax makes an additive bias in the compute dtype and keeps for the backward
    pass); "chunked" for the kit's chunked attention (O(S), and its backward's dq, dk and dv
    are XLA buffers: ``estimate.attention_backward_bytes``); else "flash" (cuDNN, TE: O(S), no
    [S, S] array, the backward's buffers inside the fused kernel)."""
    kind = attention_kind(cfg, cluster)
    if kind == "xla":
        return "scores"
    if kind == "chunked":
        return "chunked"
    packed = cfg.data.source == "prepared" and cfg.data.packing
    return "mask" if kind == "cudnn" and packed else "flash"


def loss_chunk(cfg: Config, tokens: int) -> int:
    """Tokens per device of one cross-entropy chunk (``moe_train.model.loss.sharded_chunk``)."""
    if cfg.train.loss_chunk:
        return min(cfg.train.loss_chunk, tokens)
    from moe_train.model.loss import default_chunk  # JAX: make plan stays JAX-free

    return default_chunk(tokens, cfg.model.vocab_size)


def loss_tile(cfg: Config) -> int:
    """Vocab columns of one cross-entropy tile (``moe_train.model.loss.vocab_tile``)."""
    from moe_train.model.loss import vocab_tile  # JAX: make plan stays JAX-free

    return vocab_tile(cfg.model.vocab_size)


def check_placement(cfg: Config, cluster: Cluster, nodes: int, ep: int) -> None:
    """PlanError when EP groups of ``ep`` cannot be placed on ``nodes`` whole nodes."""
    try:
        allocation(
            cluster, nodes, ep, num_experts=cfg.moe.num_experts, allow_straddle=cfg.parallel.allow_straddle
        )
    except PlacementError as err:
        raise PlanError(str(err)) from None


def setup_for(
    cfg: Config, cluster: Cluster, nodes: int, *, ep: int | None = None, devices: int | None = None
) -> Setup:
    """The Setup of ``cfg`` on ``nodes`` nodes of ``cluster`` (or ``devices`` GPUs of one)."""
    if nodes < 1:
        raise PlanError(f"nodes must be >= 1, got {nodes}")
    whole = devices is None
    devices = nodes * cluster.gpus_per_node if whole else devices
    if devices < 1:
        raise PlanError(f"devices must be >= 1, got {devices}")
    ep = cfg.parallel.ep if ep is None else ep
    dp = check_sizes(cfg, devices, ep)
    with _as_plan_error():
        cfg = for_devices(cfg, devices)
    if whole and devices > 1:
        check_placement(cfg, cluster, nodes, ep)
    domain = min(cluster.domain_size, devices)
    groups = max(1, -(-ep // domain))
    tokens = cfg.train.batch_size * cfg.train.seq_len // devices // cfg.train.micro_batches
    backend = _backend(cfg, cluster)
    local_experts = cfg.moe.num_experts // ep
    m = tile_rows(cfg, tokens * cfg.moe.top_k, local_experts, cluster.nominal)
    return Setup(
        devices=devices,
        ep=ep,
        dp=dp,
        tokens=tokens,
        remat=cfg.train.remat,
        compute=cfg.precision.compute,
        backend=backend,
        tile_rows=m if backend == "tiled" else 0,
        dispatcher=_dispatcher(cfg, devices, ep, groups),
        domains=groups,
        domain_size=ep // groups,
        attention=attention_memory(cfg, cluster),
        loss_chunk=loss_chunk(cfg, tokens),
        loss_tile=loss_tile(cfg),
        platform="cpu" if cluster.nominal else "gpu",
    )


def replaced(cfg: Config, section: str, **values: Any) -> Config:
    """``cfg`` with the fields ``values`` of its section ``section`` (e.g. "train") replaced."""
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})


# what a change of a key also resets in its section: parallel.dp left to follow EP, and
# train.micro_batch_size off (train.micro_batches counts the micro-batches)
FOLLOW: dict[str, dict[str, Any]] = {"parallel.ep": {"dp": 0}, "train.micro_batches": {"micro_batch_size": 0}}


def with_setting(cfg: Config, key: str, value: Any) -> Config:
    """``cfg`` with ``key`` ("section.name", e.g. "train.remat") set to ``value`` (and what
    follows it reset, ``FOLLOW``)."""
    section, name = key.split(".")
    return replaced(cfg, section, **{name: value, **FOLLOW.get(key, {})})
