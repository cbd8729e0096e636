"""The step section of ``python -m moe_train.bench --accel``: a MoE model and its dense twin
trained a few steps with the trainer's own jitted step (``moe_train.train.step``), on one device.

The dense twin has the MoE model's active FLOPs: every block's MLP a dense SwiGLU of width
``top_k * expert_ffn`` (``model.first_dense_layers=<num_layers> model.dense_ffn=...``: no
router, permutation or grouped GEMM), everything else the same. Until 2026-12-07 it was one
expert of that width (``moe.num_experts=1 moe.top_k=1``), which still ran the MoE pipeline. The first of
``MODELS`` (largest first) that the memory planner fits on the device is stepped (``choose``:
its batch halved until it fits; the last, as it is, where none does). Each model
is built and compiled, stepped once (warm-up), then ``steps`` times, each timed to completion,
then ``steps`` times more dispatched back to back and waited for once, as the trainer's loop
dispatches a step before it reads the last one's metrics (tokens/s, TFLOP/s and MFU are of
those: the host's time between steps is hidden there, as in training). Its state is freed
before the next model is built (two 0.5B-parameter AdamW states do not fit one 16 GiB chip
together). TFLOP/s count the trainer's model FLOPs
(``moe_train.model.flops.train_flops_per_token``: active parameters and causal attention,
no recomputation), MFU divides them by the device's dense bf16 peak (``topology.peaks``).
A step that does not fit (XLA's RESOURCE_EXHAUSTED) is reported as a row that says so.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from moe_train import config
from moe_train.bench import profile
from moe_train.bench.common import compile_jit, summarize
from moe_train.config import for_devices
from moe_train.model.flops import param_counts, train_flops_per_token
from moe_train.moe.gemm import resolve_backend
from moe_train.parallel import sharding
from moe_train.planner.memory.trainer import need
from moe_train.train import fits
from moe_train.train.step import StepCounter, init_state, make_train_step


@dataclasses.dataclass(frozen=True)
class StepModel:
    """A MoE model for the step section: a preset and ``--set`` items over it."""

    preset: str  # the preset the overrides apply to
    overrides: tuple[str, ...]  # --set items (KEY=VALUE) that make the MoE model
    steps: int = 5  # timed steps after the warm-up step


# The model for one TPU v5e (about 0.5B parameters, 15.75 GiB of HBM).
FULL = StepModel(
    "tiny",
    (
        "model.vocab_size=32768",
        "model.hidden=1024",
        "model.num_layers=8",
        "model.num_heads=8",
        "model.num_kv_heads=4",
        "model.head_dim=128",
        "model.attention=auto",  # what the trainer runs: splash on a TPU (the issue measured chunked)
        "moe.num_experts=32",
        "moe.top_k=4",
        "moe.expert_ffn=512",
        "train.seq_len=2048",
        "train.batch_size=8",
        "precision.compute=bf16",
        "data.source=synthetic",
        "parallel.devices=1",
    ),
)
# A slice of Mixtral-8x7B for a GPU of 80 GiB or more: two of its layers (width 4096, 8 experts
# top-2 of 14336) whole, its attention and vocabulary, sequences of 4096, the whole batch in one
# micro-batch, no recomputation (MFU counts none); ``choose`` halves the batch to fit the device.
LARGE = StepModel(
    "mixtral-8x7b",
    (
        "model.num_layers=2",
        "train.seq_len=4096",
        "train.batch_size=8",
        "train.micro_batch_size=0",
        "train.remat=none",
        "precision.compute=bf16",
        "data.source=synthetic",
        "parallel.devices=1",
    ),
)
MODELS = (LARGE, FULL)  # the step section's candidates, largest first (``choose``)
TINY = StepModel(
    "tiny",
    ("model.attention=chunked", "precision.compute=bf16", "data.source=synthetic", "parallel.devices=1"),
    steps=3,
)


def configs(model: StepModel) -> dict[str, config.Config]:
    """{"moe": the model, "dense twin": every MLP a dense SwiGLU of width top_k * expert_ffn}."""
    moe = config.build(model.preset, list(model.overrides))
    twin = [
        f"model.first_dense_layers={moe.model.num_layers}",
        f"model.dense_ffn={moe.moe.top_k * moe.moe.expert_ffn}",
    ]
    return {"moe": moe, "dense twin": config.build(model.preset, [*model.overrides, *twin])}


def with_batch(model: StepModel, batch: int) -> StepModel:
    """``model`` with ``train.batch_size=batch`` (its own batch item replaced)."""
    kept = tuple(o for o in model.overrides if not o.startswith("train.batch_size="))
    return dataclasses.replace(model, overrides=(*kept, f"train.batch_size={batch}"))


def planned_bytes(model: StepModel, cluster) -> int | None:
    """The memory planner's bytes per device for ``model``'s MoE model on one device of
    ``cluster`` (None: the planner cannot model it)."""
    est = need(for_devices(configs(model)["moe"], 1), cluster, 1)
    return None if est is None else est.per_device["total"]


def choose(
    models: tuple[StepModel, ...], limit: float | None, cluster, fraction: float
) -> tuple[StepModel, str | None]:
    """The first of ``models`` (largest first) whose MoE model fits ``fraction * limit`` by the
    memory planner, its batch halved until it does, and a note saying how it was chosen; the
    last of them as it is where none fits or no limit is known (None: no note)."""
    if limit is None or len(models) == 1:
        return models[-1], None
    budget, room = fraction * limit, f"{fraction:.0%} of {limit / 2**30:.1f} GiB"
    tried = []
    for model in models[:-1]:
        batch = configs(model)["moe"].train.batch_size
        while batch >= 1:
            sized = with_batch(model, batch)
            planned = planned_bytes(sized, cluster)
            said = f"{model.preset} {describe_overrides(sized)}: the memory planner's "
            if planned is not None and planned <= budget:
                return sized, f"{said}{planned / 2**30:.1f} GiB fits {room}"
            batch //= 2
        tried.append(f"{said}{'?' if planned is None else f'{planned / 2**30:.1f}'} GiB")
    last = models[-1]
    larger = "; ".join(tried)
    return last, f"{last.preset} {describe_overrides(last)}: larger ones do not fit {room} ({larger})"


def describe_overrides(model: StepModel) -> str:
    """The shape items of ``model``'s overrides, e.g. "num_layers=2 seq_len=4096 batch_size=4"."""
    keys = ("model.num_layers=", "train.seq_len=", "train.batch_size=")
    return " ".join(o.split(".", 1)[1] for o in model.overrides if o.startswith(keys))


def cluster_of(device):
    """The cluster preset that models ``device`` for the planner (``fits.cluster_for``)."""
    return fits.cluster_for(device.platform, getattr(device, "device_kind", ""), 1)


def _batch(cfg: config.Config, mesh) -> jax.Array:
    t = cfg.train
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1))
    return jax.device_put(tokens.astype(np.int32), sharding.batch_sharding(mesh))


def _timed_steps(cfg: config.Config, steps: int) -> tuple[list[float], float, float, dict[str, Any]]:
    """(seconds of each step waited for, seconds per step of ``steps`` dispatched back to back,
    compile seconds, where two more steps' time goes: ``profile.breakdown``) of the trainer's
    step on one device."""
    mesh = sharding.make_mesh(jax.devices()[:1])
    batch = _batch(cfg, mesh)
    with sharding.activate(mesh):
        state = init_state(cfg, mesh)
        fn = make_train_step(cfg, mesh, StepCounter(), jax.tree.map(lambda a: a.sharding, state))
        compiled, _, compile_s = compile_jit(fn, state, batch)
        state, _ = compiled(state, batch)  # warm-up
        jax.block_until_ready(state)
        times = []

        def step_once():
            nonlocal state
            state, _ = compiled(state, batch)
            jax.block_until_ready(state)

        for _ in range(steps):
            t0 = time.perf_counter()
            step_once()
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, _ = compiled(state, batch)
        jax.block_until_ready(state)
        back_to_back = (time.perf_counter() - t0) / steps
        where = profile.breakdown(step_once, compiled.as_text())
    del state
    return times, back_to_back, compile_s, where


def failure(err: BaseException) -> str:
    """One line for a row that failed: the exception's type and its first line."""
    first = (str(err).strip() or "?").splitlines()[0]
    return f"failed: {type(err).__name__}: {first[:300]}"


def describe(cfg: config.Config) -> dict[str, Any]:
    """The model's shape and size, as a row names it."""
    m, e, t = cfg.model, cfg.moe, cfg.train
    counts = param_counts(cfg)
    dense = m.first_dense_layers >= m.num_layers
    return {
        "hidden": m.hidden,
        "layers": m.num_layers,
        "experts": 0 if dense else e.num_experts,  # 0: every MLP dense
        "top_k": 0 if dense else e.top_k,
        "expert_ffn": m.dense_ffn if dense else e.expert_ffn,  # the dense MLP's width where dense
        "seq_len": t.seq_len,
        "batch_size": t.batch_size,
        "params": counts["total"],
        "active_params": counts["active"],
        "train_flops_per_token": train_flops_per_token(cfg),
    }


def measure(cfg: config.Config, steps: int, peak: float | None) -> dict[str, Any]:
    """One model's row: tokens/s, TFLOP/s per device and MFU; or why it did not run."""
    dtype = config.compute_dtype(cfg.precision)
    dense = cfg.model.first_dense_layers >= cfg.model.num_layers
    backend = (
        "none"
        if dense
        else resolve_backend(cfg.moe.backend, dtype, hidden=cfg.model.hidden, ffn=cfg.moe.expert_ffn)
    )
    row = describe(cfg) | {"backend": backend, "skipped": None}
    try:
        times, back_to_back_s, compile_s, where = _timed_steps(cfg, steps)
    except Exception as err:  # RESOURCE_EXHAUSTED, a kernel refusing a shape: a row, not a lost run
        return row | {"skipped": failure(err)}
    timing = summarize(times)
    tokens_per_s = cfg.train.batch_size * cfg.train.seq_len / back_to_back_s
    tflops = row["train_flops_per_token"] * tokens_per_s / 1e12
    return row | {
        "time": timing,  # each step waited for
        "back_to_back_s": back_to_back_s,  # per step, dispatched back to back: tokens/s are of this
        "compile_s": compile_s,
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
        "time_by_scope": where,
    }


def run(model: StepModel, deadline: float, peak: float | None, say=print) -> dict[str, Any]:
    """Both models' rows (skipped after ``deadline``) and the MoE / dense TFLOP/s ratio."""
    rows = {}
    for name, cfg in configs(model).items():
        if time.perf_counter() > deadline:
            r = describe(cfg) | {"skipped": "over the run's time budget"}
        else:
            r = measure(cfg, model.steps, peak)
        rows[name] = r = {"model": name, **r}
        say(
            f"step {name}: "
            + (r["skipped"] or f"{r['tokens_per_s']:,.0f} tokens/s, {r['tflops_per_device']:.3g} TFLOP/s")
        )
    moe, dense = rows["moe"], rows["dense twin"]
    both = not moe["skipped"] and not dense["skipped"]
    return {
        "model": dataclasses.asdict(model),
        "rows": rows,
        "moe_over_dense_tflops": moe["tflops_per_device"] / dense["tflops_per_device"] if both else None,
        "peak_flops": peak,
    }
