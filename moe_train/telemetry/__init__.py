"""Telemetry: a background sampler in every training process, and readers for its files.

The trainer calls ``start(out_dir, cfg.train.telemetry_interval_s, devices)`` once, then
``sampler.set_step(n)`` before each step and ``sampler.stop()`` at the end. Each process
writes ``<out>/telemetry/rank<N>.jsonl`` (N = ``jax.process_index()``; format in
``telemetry.sampler``): its GPU through NVML (``telemetry.nvml``) when it has one, and the
host (``telemetry.host``) always. Without NVML the first line says why
(``"nvml": "unavailable: NVML Shared Library Not Found"``) and the host timeline remains.

Nothing here can fail the run: ``start`` returns a ``NullSampler`` when telemetry is off
(interval <= 0) or cannot start, and an error inside the thread is logged once and ends
sampling. ``moe_train.telemetry.summary`` and ``moe_train.report`` read the files
(``telemetry.files.load_run``).

May import: ``topology`` (discovery, peaks, presets) and nvidia-ml-py where present. Never the
training loop (the loop starts the sampler) or the report (which reads these files).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_train.telemetry.sampler import NullSampler, Sampler, Target

__all__ = ["NullSampler", "Sampler", "Target", "start", "target_for"]

GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # jax.Device.platform values NVML may know


def target_for(
    out_dir: Path,
    interval_s: float,
    devices: Sequence[Any],
    *,
    rank: int,
    process_count: int,
    env: Mapping[str, str] | None = None,
) -> Target:
    """The sampler target of a process whose devices are ``devices`` (jax.Device-like).

    The first device is sampled (one GPU per process is the supported layout; a process with
    more notes that in ``context``). Its NVML index comes from ``local_hardware_id`` through
    CUDA_VISIBLE_DEVICES (``topology.discovery.nvml_indices``).
    """
    env = os.environ if env is None else env
    first = devices[0] if devices else None
    platform = getattr(first, "platform", "none")
    context: dict[str, Any] = {
        "platform": platform,
        "device_kind": getattr(first, "device_kind", None),
        "local_devices": len(devices),
    }
    if len(devices) > 1:
        context["note"] = f"{len(devices)} devices in this process; telemetry samples the first"
    index, reason = None, f"JAX platform is {platform}"
    if platform in GPU_PLATFORMS:
        from topology.discovery import nvml_indices  # numpy: only on a GPU

        hw = getattr(first, "local_hardware_id", None)
        mapped = None if hw is None else nvml_indices([hw], env.get("CUDA_VISIBLE_DEVICES"))
        if mapped:
            index, reason = mapped[0], ""
        else:
            reason = "cannot map the device to an NVML index (CUDA_VISIBLE_DEVICES by UUID?)"
    return Target(
        path=Path(out_dir) / "telemetry" / f"rank{rank}.jsonl",
        interval_s=interval_s,
        rank=rank,
        process_count=process_count,
        gpu_index=index,
        no_gpu_reason=reason,
        context=context,
    )


def start(
    out_dir: Path,
    interval_s: float,
    devices: Sequence[Any] = (),
    *,
    log: Callable[[str], None] = print,
    nvml: Any = None,
    hold: bool = False,
) -> Sampler | NullSampler:
    """Start this process's sampler; a NullSampler when ``interval_s <= 0`` or on any error."""
    if not interval_s or interval_s <= 0:
        return NullSampler()
    try:
        import jax

        devices = list(devices) or jax.local_devices()
        target = target_for(
            out_dir, interval_s, devices, rank=jax.process_index(), process_count=jax.process_count()
        )
        return Sampler(target, log=log, nvml=nvml, hold=hold).start()
    except Exception as err:  # telemetry never fails the run
        log(f"telemetry: not started ({type(err).__name__}: {err}); training goes on")
        return NullSampler()
