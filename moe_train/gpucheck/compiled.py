"""gpu-check's deviceless-compile section: ``make compile``'s XLA:GPU compile against this GPU.

``make compile`` compiles a job's train step for a GPU that is not there (the CUDA plugin's
simulated devices, ``topology/targets/<gpu>.txtpb``); everything it says about memory rests on
that compile matching the one the trainer gets on the real GPU. Here both run on one job that
fits one GPU (``JOB``: Mixtral-8x7B's real layer shapes at reduced depth and batch):

- the trainer itself, in a child process, for a few steps: XLA's memory analysis of the step
  it compiled on this GPU (``compiled_peak_bytes`` ...) and what the allocator really held
  (``device_peak_bytes``);
- in this process, the same config's step compiled for the simulated GPU of this device's
  target config (``moe_train.planner.compile.lower``, as ``make compile`` does it).

Each of argument, temp, output and peak bytes is compared (deviceless / on-device): PASS
within ``MEM_RTOL``. The real peak against the compiled one is reported beside it. SKIP
without a GPU (the deviceless path's own tests run on CPU) or for a GPU with no shipped target.
"""

from __future__ import annotations

import time
from typing import Any

from moe_train import config
from moe_train.gpucheck import FAIL, PASS, Context, runs, skip, verdict
from moe_train.parallel import sharding
from moe_train.planner.compile import kernels, lower
from topology import device_mesh, targets

JOB = (
    "mixtral-8x7b",
    [
        "model.num_layers=1",
        "train.batch_size=2",
        "train.micro_batch_size=1",
        "parallel.devices=1",
        "train.skip_selftest=true",
        "train.log_every=1000",
        "train.checkpoint_every=0",
        "train.checkpoint_minutes=0",
    ],
)
STEPS = 3
MEM_RTOL = 0.10  # deviceless vs on-device compile, each memory field
CHILD_MEM_FRACTION = "0.7"  # of the GPU, for the trainer run (its state is ~27 GB)
# device_kind substrings -> shipped target config (topology/targets)
TARGETS = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200-sxm"), ("H100", "h100-sxm"))
FIELDS = ("argument", "temp", "output", "peak")


def target_for(device_kind: str) -> str | None:
    """The shipped target config of a device kind ("NVIDIA H200" -> "h200-sxm"), or None."""
    return next((name for key, name in TARGETS if key in device_kind), None)


def _deviceless(name: str) -> dict[str, int]:
    """The JOB's step compiled for one simulated GPU of target ``name``: memory by field."""
    from jax.experimental import topologies

    target = targets.load(name)
    devices = list(
        topologies.get_topology_desc(target.name, "cuda", target_config=target.text, topology="1x1x1").devices
    )
    cfg = config.for_devices(config.build(JOB[0], JOB[1]), 1)
    cfg, _ = kernels.choose(cfg, target, devices)
    mesh = device_mesh.build(cfg, devices).mesh
    plan = next(iter(sharding.ep_plans(cfg, mesh)))
    mem = lower.compile_one(cfg, mesh, plan, target, devices).memory
    return {"argument": mem.argument, "temp": mem.temp, "output": mem.output - mem.alias, "peak": mem.peak}


def _on_device(ctx: Context) -> tuple[dict[str, int] | None, int | None, str]:
    """(compiled memory by field, the allocator's peak, why None) of the trainer's own run."""
    import os

    saved = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = CHILD_MEM_FRACTION
    try:
        run = runs.trainer(ctx, "compile-check", JOB[0], STEPS, JOB[1])
    finally:
        if saved is None:
            os.environ.pop("XLA_PYTHON_CLIENT_MEM_FRACTION")
        else:
            os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = saved
    recs = run["records"]
    if run["rc"] != 0 or not recs or "compiled_peak_bytes" not in recs[0]:
        return None, None, f"trainer exit {run['rc']}: {' | '.join(run['tail'])}"
    first = recs[0]
    mem = {
        "argument": first["compiled_argument_bytes"],
        "temp": first["compiled_temp_bytes"],
        "output": first["compiled_output_bytes"] - first["compiled_alias_bytes"],
        "peak": first["compiled_peak_bytes"],
    }
    peaks = [r["device_peak_bytes"] for r in recs if r.get("device_peak_bytes")]
    return mem, (max(peaks) if peaks else None), ""


def section(ctx: Context) -> dict[str, Any]:
    """The JOB compiled deviceless and on this GPU: equal memory within MEM_RTOL."""
    if not ctx.on_gpu:
        return skip("no GPU: tests/test_compile.py checks the deviceless compile on CPU")
    name = target_for(ctx.device_kind)
    if name is None:
        return skip(f"no shipped XLA:GPU target config for {ctx.device_kind!r}")
    real, device_peak, why = _on_device(ctx)
    if real is None:
        return {"status": FAIL, "reason": why}
    t0 = time.perf_counter()
    sim = _deviceless(name)
    return verdict(
        [_compare(f, sim[f], real[f]) for f in FIELDS],
        job=f"{JOB[0]} {' '.join(JOB[1])}",
        target=name,
        deviceless_compile_s=round(time.perf_counter() - t0, 1),
        device_peak_gib=None if device_peak is None else device_peak / 2**30,
        device_peak_over_compiled=(None if device_peak is None else device_peak / real["peak"]),
    )


def _compare(field: str, deviceless: int, on_device: int) -> dict[str, Any]:
    """One memory field's row: PASS where deviceless / on-device is within 1 +- MEM_RTOL."""
    ratio = deviceless / on_device if on_device else None
    ok = ratio is not None and abs(ratio - 1) <= MEM_RTOL or deviceless == on_device
    return {
        "field": field,
        "deviceless_gib": deviceless / 2**30,
        "on_device_gib": on_device / 2**30,
        "ratio": ratio,
        "status": PASS if ok else FAIL,
        "reason": "" if ok else f"deviceless/on-device {ratio} outside 1 +- {MEM_RTOL}",
    }
