"""The training loop: resume, step, log, checkpoint, stop cleanly on SIGTERM/SIGUSR2.

Exit codes: 0 finished or stopped by a signal after saving (rerun the same command to go on),
2 bad configuration or input (nothing in the run directory is changed), 3 the loss became
NaN/inf (the last good checkpoint is kept; nothing is saved past it).
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from moe_train import (checkpoint, distributed, flops, layout, metrics, precision, selftest,
                       sharding, summary, telemetry)
from moe_train.config import Config, ConfigError, for_devices, save_json, to_dict
from moe_train.data import make_source
from moe_train.stepper import BucketedStep
from moe_train.train import StepCounter, init_state

EXIT_OK, EXIT_CONFIG, EXIT_DIVERGED = 0, 2, 3
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class StopFlag:
    """Set by SIGTERM/SIGUSR2; the loop finishes the current step, saves and exits 0."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed(self) -> int | None:
        """The stop signal if any process got one. Processes must stop after the same step
        (a checkpoint is a collective), so a multi-process run agrees every step."""
        if jax.process_count() == 1:
            return self.signum
        from jax.experimental import multihost_utils

        signums = multihost_utils.process_allgather(np.int32(self.signum or 0))
        return int(np.max(signums)) or None


def select_devices(cfg: Config) -> list[jax.Device]:
    """The first ``parallel.devices`` devices of the job (all processes), in JAX's order."""
    available = jax.devices()
    n = cfg.parallel.devices or len(available)
    if n > len(available):
        raise ConfigError(f"parallel.devices={n} but only {len(available)} "
                          f"{available[0].platform} device(s) are visible; choose 1..{len(available)}")
    batch, micro = cfg.train.batch_size, cfg.train.micro_batches
    if batch % n:
        sizes = [d for d in range(1, n + 1) if batch % d == 0]
        raise ConfigError(f"train.batch_size={batch} is not divisible by {n} devices; "
                          f"use a multiple of {n} or parallel.devices in {sizes}")
    if (batch // n) % micro:
        ok = [k for k in range(1, batch // n + 1) if (batch // n) % k == 0]
        raise ConfigError(f"train.micro_batches={micro} does not divide the {batch // n} "
                          f"sequences per device (train.batch_size={batch} over {n} devices); "
                          f"choose one of {ok}")
    return available[:n]


def _prepare_out(cfg: Config, out_dir: Path, ckpt: checkpoint.Checkpointer) -> int | None:
    """Check a previous run in ``out_dir`` is compatible, then write config.json."""
    latest = ckpt.latest_step()
    if latest is not None:
        checkpoint.check_compatible(ckpt.read_meta(latest)["config"], cfg, ckpt.directory)
    if jax.process_index() == 0:
        save_json(cfg, out_dir / "config.json")
    return latest


def mfu_peak(cfg: Config, device_kind: str) -> float | None:
    """Peak FLOP/s per device for MFU (``summary.peak_for``: preset, else device kind)."""
    return summary.peak_for(to_dict(cfg), device_kind)


def global_batch(source, step: int, mesh):
    """This step's batch as one global array; each process supplies its own rows."""
    local = source.batch(step, process_index=jax.process_index(), process_count=jax.process_count())
    return jax.make_array_from_process_local_data(sharding.batch_sharding(mesh), local)


def _report_layout(plan: layout.Layout, out_dir: Path, log: Callable[[str], None]) -> None:
    """Log where the EP groups went (warnings loudly) and keep it in ``layout.json``."""
    for line in plan.lines:
        log(f"layout: {line}")
    for line in plan.warnings:
        log(f"WARNING: {line}")
    if jax.process_index() == 0:
        p = plan.placement
        (out_dir / "layout.json").write_text(json.dumps({
            "mesh": dict(plan.mesh.shape), "ep_groups": p.ep_groups, "domains": p.domains,
            "straddling": p.straddling, "notes": list(plan.lines), "warnings": list(plan.warnings),
        }, indent=1) + "\n")


def _compiled_memory(step_fn: BucketedStep, state, batch, log: Callable[[str], None]) -> dict:
    """Log the compiled step's per-device memory and return it as metrics ({} if unknown)."""
    t0 = time.perf_counter()
    with sharding.activate(step_fn.mesh, sharding.logical_rules(step_fn.cfg.model.hidden,
                                                                step_fn.mesh.size)):
        mem = step_fn.compiled_memory(state, batch)
    if mem is None:
        return {}
    log(f"{mem.line()} [{time.perf_counter() - t0:.2f} s to read]")
    return mem.metrics()


def _write_summary(out_dir: Path, peak: float | None, log: Callable[[str], None]) -> None:
    """Once every process has stopped its sampler, process 0 writes ``summary.json``."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("moe_train: telemetry flushed")
    if jax.process_index() == 0:
        path = summary.write(out_dir, peak_flops=peak, process_count=jax.process_count(), log=log)
        if path is not None:
            log(f"Summary: {path}; report: python -m moe_train.report {out_dir}")


def run(cfg: Config, out_dir: Path, log: Callable[[str], None] = print) -> int:
    """Train ``cfg`` into ``out_dir``; returns the process exit code."""
    out_dir = Path(out_dir)
    devices = select_devices(cfg)
    job_cfg = for_devices(cfg, len(devices))  # train.micro_batch_size -> micro_batches here
    plan = layout.build(job_cfg, devices)
    mesh = plan.mesh
    # Before anything is written: a configured kernel that fails its check exits 2.
    exec_cfg, kernel_line, kernels = selftest.run(job_cfg, out_dir)
    log(kernel_line)
    t = cfg.train
    source = make_source(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len,
                         batch_size=t.batch_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint.Checkpointer(out_dir, keep=t.keep_checkpoints, use_async=t.async_checkpoint)
    try:
        latest = _prepare_out(cfg, out_dir, ckpt)
        selftest.write(out_dir, kernels)
        _report_layout(plan, out_dir, log)
        log(precision.describe(exec_cfg, mesh.devices.flat[0].platform))
        state = init_state(exec_cfg, mesh)
        if latest is not None:
            state = ckpt.restore(latest, state)
            log(f"resumed from {ckpt.directory / str(latest)} (step {latest})")
        meta = {"config": to_dict(cfg)}  # as configured: "auto" stays auto
        return _loop(exec_cfg, out_dir, mesh, state, source, ckpt, log, meta,
                     first_metrics={"selftest_s": kernels["selftest_s"]})
    finally:
        ckpt.close()


def _loop(cfg, out_dir, mesh, state, source, ckpt, log, meta, first_metrics) -> int:
    t, devices = cfg.train, mesh.devices.size
    start = int(state.step)
    if start >= t.steps:
        log(f"nothing to do: {out_dir} is already at step {start} of {t.steps}")
        return EXIT_OK
    counter = StepCounter()
    step_fn = BucketedStep(cfg, mesh, counter, jax.tree.map(lambda x: x.sharding, state))
    fpt = flops.train_flops_per_token(cfg)
    peak = mfu_peak(cfg, mesh.devices.flat[0].device_kind)
    log(f"training {source.description} on {devices} {mesh.devices.flat[0].platform} device(s) "
        f"(mesh {dict(mesh.shape)}, {jax.process_count()} process(es)), "
        f"steps {start + 1}-{t.steps}, batch {t.batch_size}x{t.seq_len}")
    rules = sharding.logical_rules(cfg.model.hidden, mesh.size)
    writer = metrics.MetricsWriter(out_dir / "metrics.jsonl", start, enabled=jax.process_index() == 0)
    stop, records = StopFlag(), []
    stop.install()
    sampler = telemetry.start(out_dir, t.telemetry_interval_s, log=log, devices=[
        d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    status = "finished"
    try:
        for step in range(start, t.steps):
            sampler.set_step(step + 1)
            batch = global_batch(source, step, mesh)
            traces, t0 = counter.traces, time.perf_counter()
            with sharding.activate(mesh, rules):
                state, raw = step_fn(state, batch)
            rec = metrics.step_record(step + 1, raw, step_time_s=time.perf_counter() - t0,
                                      tokens=t.batch_size * t.seq_len, flops_per_token=fpt,
                                      devices=devices, peak_flops=peak, compilations=counter.traces)
            rec["compiled"] = counter.traces > traces
            if step == start:  # once: what XLA planned for the step's device memory
                rec.update(_compiled_memory(step_fn, state, batch, log), **first_metrics)
            distributed.beat(step + 1)  # the multi-process watchdog: this process progresses
            if not math.isfinite(rec["total_loss"]):
                log(f"error: loss became {rec['total_loss']} at step {step + 1}; stopping without "
                    f"saving; the last good checkpoint ({ckpt.latest_step()}) is kept")
                return EXIT_DIVERGED
            writer.write(rec)
            records.append(rec)
            if (step + 1) % t.log_every == 0 or step + 1 == t.steps:
                log(metrics.progress_line(rec, t.steps))
            done, signum = step + 1 == t.steps, stop.agreed()
            if done or signum is not None or (t.checkpoint_every and (step + 1) % t.checkpoint_every == 0):
                ckpt.save(step + 1, state, meta)
            if signum is not None and not done:
                ckpt.wait()
                status = (f"stopped by signal {signal.Signals(signum).name} after step {step + 1}; "
                          f"checkpoint saved, rerun the same command to continue")
                break
        ckpt.wait()
    finally:
        stop.restore()
        writer.close()
        sampler.set_step(None)
        sampler.stop()
    log(metrics.summary(records, first_step=start, description=source.description,
                        out_dir=out_dir, status=status))
    _write_summary(out_dir, peak, log)
    return EXIT_OK

