"""What the trace sees: the target GPU's facts in place of this machine's, while tracing.

Model code picks kernels from the machine it traces on: ``jax.default_backend()`` (attention,
precision, the MoE tile and block sizes, the grouped-GEMM backend), ``jax.devices()[0]``'s
compute capability (the Mosaic-GPU kernels need sm_90), the GPU facts of
``moe_train.model.attention.fused`` (cuDNN attention), and jax's own trace-time cuDNN checks
(``jax._src.cudnn.fused_attention_stablehlo``: the cuDNN version and the compute capability
of the first local GPU). On a machine without a GPU every one of them says "cpu", so a trace
there would build the CPU program. ``as_target`` answers them from the target config
(``topology.targets``: its compute capability and cuDNN version) and the simulated devices,
for the duration of the trace only, then restores every one.

With it cuDNN flash attention traces and compiles deviceless: XLA keeps it as a
``__cudnn$fmha*`` custom call (its workspace is sized on a real GPU, so XLA's temp bytes do
not include it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from topology.targets import Target


def gpu_facts(target: Target) -> dict:
    """``moe_train.model.attention.fused.gpu_facts`` as it reads on the target GPU."""
    major, minor = target.compute_capability
    return {
        "cuda": True,
        "version": f"cuda (deviceless: {target.description})",
        "cc": float(f"{major}.{minor}"),
        "cudnn": target.cudnn_version,
    }


def _at_least(target: Target, capability: str) -> bool:
    return target.compute_capability >= tuple(int(x) for x in capability.split("."))


def _replacements(target: Target, devices: Sequence[Any]) -> list[tuple[Any, str, Any]]:
    """(object, attribute, value while tracing) for every fact the trace reads."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from moe_train.model.attention import fused

    facts = gpu_facts(target)
    cc = ".".join(map(str, target.compute_capability))
    return [
        (jax, "default_backend", lambda: "gpu"),
        (jax, "devices", lambda *_, **__: list(devices)),
        (fused, "gpu_facts", lambda: facts),
        (cudnn, "check_cudnn_version", lambda: target.cudnn_version),
        (cudnn, "check_compute_capability", lambda c: _at_least(target, c)),
        (cudnn, "is_cuda_compute_capability_equal", lambda c: c == cc),
    ]


@contextlib.contextmanager
def as_target(target: Target, devices: Sequence[Any]) -> Iterator[None]:
    """Trace as on ``target`` with ``devices`` (the simulated ones) as ``jax.devices()``."""
    saved = []
    try:
        for obj, name, value in _replacements(target, devices):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)
