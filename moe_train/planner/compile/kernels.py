"""The kernels the trainer would run on the target GPU, and the ones this compile traces.

The trainer's self-test (``moe_train.selftest``) lists each kernel key's candidates on the
machine it starts on, fastest first, and ``auto`` takes the first that passes (for the grouped
GEMM on a GPU, a later one only when it times more than 10% faster). Here the same lists
(``moe_train.selftest.candidates.plans``) are made for the target GPU's platform
(``facts.platform_of``; JAX's private machine reads answered by ``facts.jax_reads``):
the trainer's pick is the first candidate. A GPU kernel (Mosaic GPU, Transformer Engine,
cuDNN attention) must also trace without a GPU: each is traced once, forward and backward,
on the self-test's small problem; one that does not is replaced by the next candidate, and
the choice says so. An explicit choice that does not trace is an error (exit 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moe_train.base.platform import Platform
from moe_train.config import Config, ConfigError
from moe_train.model import attention
from moe_train.model.attention.fused import te_import_error
from moe_train.moe import gemm
from moe_train.moe.tiled import expert_operands
from moe_train.planner.compile import facts
from moe_train.selftest import KernelKey, candidates
from topology.targets import Target

GPU_ONLY = {"moe.backend": ("mgpu", "te"), "model.attention": ("cudnn", "te")}


@dataclasses.dataclass(frozen=True)
class Kernel(KernelKey):
    """One kernel key: what was asked, what the trainer picks on the target, what compiled."""

    trainer: str  # the trainer's first choice on the target GPU
    compiled: str  # the kernel this compile traced
    note: str  # why, and what was replaced

    def line(self) -> str:
        swapped = "" if self.compiled == self.trainer else f" in place of {self.trainer}"
        return f"{self.key}={self.compiled}{swapped} ({self.note})"


def _first_line(err: BaseException, limit: int = 240) -> str:
    text = str(err).strip().splitlines()
    line = f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _on_devices(loss, shapes: list[tuple[int, ...]], dtype, devices: Sequence[Any]) -> None:
    """Trace ``loss``'s gradient as the trainer's layers call a kernel: inside ``shard_map``
    over ``devices``, on operands that vary over the mesh axis (each device its own)."""
    mesh = Mesh(np.asarray(devices), ("probe",))
    spec = P("probe")

    def local(*args):
        return jax.lax.psum(loss(*[a[0] for a in args]), "probe")

    grad = jax.grad(
        jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(shapes), out_specs=P()),
        argnums=tuple(range(len(shapes))),
    )
    jax.eval_shape(grad, *[jax.ShapeDtypeStruct((len(devices), *s), dtype) for s in shapes])


def _trace_gemm(name: str, p, devices: Sequence[Any]) -> None:
    rows = p.tokens * p.top_k
    sizes = [rows // p.experts] * p.experts
    sizes[0] += rows - sum(sizes)

    def loss(x, w0, w1, wo):
        ops = expert_operands(x, w0, w1, wo, jnp.asarray(sizes, jnp.int32), with_scale=False)
        y = gemm.sorted_swiglu(ops, backend=name)
        return y.astype(jnp.float32).sum()

    shapes = [
        (rows, p.hidden),
        (p.experts, p.hidden, p.ffn),
        (p.experts, p.hidden, p.ffn),
        (p.experts, p.ffn, p.hidden),
    ]
    _on_devices(loss, shapes, jnp.dtype(p.dtype), devices)


def _trace_attention(name: str, p, devices: Sequence[Any]) -> None:
    def loss(q, k, v):
        return attention.attend(q, k, v, implementation=name).astype(jnp.float32).sum()

    shapes = [
        (p.batch, p.seq_len, p.heads, p.head_dim),
        (p.batch, p.seq_len, p.kv_heads, p.head_dim),
        (p.batch, p.seq_len, p.kv_heads, p.v_head_dim),
    ]
    _on_devices(loss, shapes, jnp.dtype(p.dtype), devices)


def traces(key: str, name: str, cfg: Config, platform: Platform, devices: Sequence[Any]) -> str | None:
    """None when kernel ``name`` of ``key`` traces for the target ``platform`` (inside
    ``facts.jax_reads``), else why not (one line). Pure-XLA kernels always trace."""
    if name not in GPU_ONLY.get(key, ()):
        return None
    try:
        if key == "moe.backend":
            _trace_gemm(name, candidates.gemm_problem(cfg, platform), devices)
        else:
            _trace_attention(name, candidates.attention_problem(cfg, platform), devices)
    except Exception as err:  # noqa: BLE001 (any trace failure: the kernel is replaced)
        return _first_line(err)
    return None


def _pick(
    key: str,
    requested: str,
    cands: list[str],
    cfg: Config,
    lead: str,
    platform: Platform,
    devices: Sequence[Any],
) -> Kernel:
    order = cands if requested == "auto" else [requested]
    failed = {}
    for name in order:
        why = traces(key, name, cfg, platform, devices)
        if why is None:
            break
        failed[name] = f"{name} did not trace as the layers call it ({why})"
    else:
        rest = [c for c in cands if c not in failed]
        raise ConfigError(
            f"{key}={requested}: {'; '.join(failed.values())}; choose one of: {', '.join(['auto', *rest])}"
        )
    how = (
        "set explicitly"
        if requested != "auto"
        else (f"auto: first of {', '.join(cands)}" + (f"; {lead.removeprefix('auto: ')}" if lead else ""))
    )
    absent = [] if requested != "auto" or "te" in cands or key not in GPU_ONLY else _te_absent()
    return Kernel(key, requested, order[0], name, "; ".join([how, *failed.values(), *absent]))


def _te_absent() -> list[str]:
    """Why Transformer Engine is no candidate here (a GPU image that has it would try it)."""
    err = te_import_error()
    return ["te not tried: Transformer Engine does not import here"] if err else []


def choose(cfg: Config, target: Target, devices: Sequence[Any]) -> tuple[Config, list[Kernel]]:
    """``cfg`` with every kernel key concrete for ``target``, and each choice."""
    platform = facts.platform_of(target)
    with facts.jax_reads(target, devices):
        picked = [
            _pick(key, value, list(cands), cfg, lead, platform, devices)
            for key, value, cands, _, _, lead in candidates.plans(cfg, platform)
        ]
    return candidates.apply(cfg, {k.key: k.compiled for k in picked}), picked
