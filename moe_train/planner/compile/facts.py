"""What the trace knows of the target GPU: its ``Platform``, passed in, and the few facts JAX's
own code reads from the machine while tracing.

The model and the MoE layer choose kernels for the platform they are given
(``moe_train.base.platform``: attention, precision, the grouped-GEMM backend, the MoE tile and
block sizes, the Mosaic-GPU kernels' sm_90): ``platform_of`` builds the target GPU's from its
target config (``topology.targets``: name, compute capability, cuDNN version), and the
compile hands it to the train step (``moe_train.train.step``, ``moe_train.selftest.candidates``),
so a trace on a machine without a GPU builds the GPU program. Nothing of JAX's public state
(``jax.default_backend``, ``jax.devices``) nor of the kit is replaced.

``jax_reads(target, devices)`` is the one place that still patches, and only JAX's private
code that reads the machine itself and takes no argument a caller could set:

- ``jax._src.cudnn.fused_attention_stablehlo`` (``jax.nn.dot_product_attention(
  implementation="cudnn")``) checks the cuDNN version and the compute capability of the first
  local GPU (``xla_bridge.local_devices(backend="gpu")``) at trace time;
- ``jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu`` (the mgpu backend's weight
  gradient) sizes its grid by ``jax.devices()[0].core_count``: that module alone sees the
  simulated devices as ``jax.devices()`` (its ``jax`` global), ``jax`` itself is untouched.

With it cuDNN flash attention traces and compiles deviceless: XLA keeps it as a
``__cudnn$fmha*`` custom call (its workspace is sized on a real GPU, so XLA's temp bytes do
not include it).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from moe_train.base.platform import Platform
from topology.targets import Target

MGPU_GRADIENT = "jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu"


def platform_of(target: Target) -> Platform:
    """The platform the model builds for on the target GPU."""
    return Platform.nvidia(target.description, target.compute_capability, target.cudnn_version)


def _at_least(target: Target, capability: str) -> bool:
    return target.compute_capability >= tuple(int(x) for x in capability.split("."))


class _JaxSeeing:
    """``jax`` as one JAX module sees it: ``devices()`` the simulated ones, the rest jax's."""

    def __init__(self, devices: Sequence[Any]):
        self._devices = list(devices)

    def devices(self, *_, **__) -> list[Any]:
        return self._devices

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)


def _replacements(target: Target, devices: Sequence[Any]) -> list[tuple[Any, str, Any]]:
    """(object, attribute, value while tracing) for each machine fact JAX's private code reads."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # private: no public cuDNN check

    cc = ".".join(map(str, target.compute_capability))
    out: list[tuple[Any, str, Any]] = [
        (cudnn, "check_cudnn_version", lambda: target.cudnn_version),
        (cudnn, "check_compute_capability", lambda c: _at_least(target, c)),
        (cudnn, "is_cuda_compute_capability_equal", lambda c: c == cc),
    ]
    try:
        mgpu = importlib.import_module(MGPU_GRADIENT)
    except Exception:  # noqa: BLE001 (no Mosaic-GPU kernels here: the mgpu backend is refused anyway)
        return out
    return [*out, (mgpu, "jax", _JaxSeeing(devices))]


@contextlib.contextmanager
def jax_reads(target: Target, devices: Sequence[Any]) -> Iterator[None]:
    """Trace with JAX's private machine reads answered for ``target`` and ``devices`` (the
    simulated ones); every one is restored after."""
    saved = []
    try:
        for obj, name, value in _replacements(target, devices):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)
