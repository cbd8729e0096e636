"""The platform a program is built for: what the model and the MoE layer read to pick the
grouped-GEMM backend, the tile sizes and the attention kernel.

``Platform.here()`` reads it from this process's JAX backend (the one place the kit asks JAX
which machine it runs on to choose a kernel); ``Platform.nvidia(...)`` describes a named NVIDIA
GPU that is not here (``make compile``: ``moe_train.planner.compile.facts.platform_of``). The trainer,
the self-test and the benchmarks take ``here()``; a deviceless compile passes the target GPU's,
so the trace builds the GPU program on a machine without one. The TPU path reads the same
fields (``name`` "tpu", ``device_kind`` for megablox's tile table).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class Platform:
    """One target: the platform and, on an NVIDIA GPU, its generation and cuDNN."""

    name: str  # JAX's platform name: "cpu", "gpu" or "tpu" (jax.default_backend())
    device_kind: str = ""  # the device's kind ("NVIDIA H100 80GB HBM3", "TPU v5 lite"): megablox's tile key
    cuda: bool = False  # an NVIDIA (CUDA) GPU; a ROCm GPU is "gpu" too and runs no NVIDIA kernel
    compute_capability: tuple[int, int] | None = None  # CUDA (major, minor); None: not known
    cudnn_version: int | None = None  # cuDNN's integer version (9.10 -> 91000); None: no cuDNN

    @property
    def cc(self) -> float | None:
        """The compute capability as one number (9.0), None where it is not known."""
        if self.compute_capability is None:
            return None
        return float("{}.{}".format(*self.compute_capability))

    @staticmethod
    def here() -> Platform:
        """This process's platform, read from JAX's default backend and its first device."""
        name = jax.default_backend()
        device = jax.devices()[0]
        version = str(getattr(getattr(device, "client", None), "platform_version", ""))
        cuda = name == "gpu" and "cuda" in version.lower()
        cc = getattr(device, "compute_capability", None)  # "9.0" on a CUDA device
        return Platform(
            name=name,
            device_kind=str(getattr(device, "device_kind", "")),
            cuda=cuda,
            compute_capability=_major_minor(cc) if cc is not None else None,
            cudnn_version=_cudnn_version() if cuda else None,
        )

    @staticmethod
    def nvidia(device_kind: str, compute_capability: tuple[int, int], cudnn_version: int | None) -> Platform:
        """A named NVIDIA GPU that need not be here (a deviceless compile's target)."""
        major, minor = compute_capability
        return Platform("gpu", device_kind, True, (major, minor), cudnn_version)


def _major_minor(cc) -> tuple[int, int]:
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


@functools.cache
def _cudnn_version() -> int | None:
    """cuDNN's version as JAX's own cuDNN checks read it (None: no CUDA plugin or no cuDNN)."""
    try:
        from jax._src.lib import cuda_versions  # private: JAX has no public cuDNN version

        return cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    except Exception:  # noqa: BLE001 (missing or broken CUDA plugin)
        return None


def or_here(platform: Platform | None) -> Platform:
    """``platform``, or this process's where none is given (what ``auto`` resolved to before
    the platform was an input)."""
    return Platform.here() if platform is None else platform


def as_platform(platform: Platform | str | None) -> Platform:
    """``platform``; a JAX platform name stands for this process's platform where it is its
    name (the trainer names its devices' platform), else for that platform without device
    facts; None: this process's."""
    if isinstance(platform, Platform):
        return platform
    here = Platform.here()
    return here if platform is None or platform == here.name else Platform(platform)
