"""The training loop: resume, step, log, checkpoint, stop cleanly on SIGTERM/SIGUSR2/SIGINT.

Exit codes (``moe_train.base.exits``): 0 finished, or stopped by a signal after saving (rerun
the same command to go on; 130 for SIGINT, the command printed last); 2 bad configuration or
input, or the run directory is in use (nothing in the run directory is changed: every check
runs, and the first step is traced, before ``config.json``, ``layout.json``, ``kernels.json``
or ``metrics.jsonl`` are written); 3 training diverged (``train.on_nonfinite``; nothing past
the last good checkpoint is saved); 5 the run directory cannot be written (the previous
checkpoint is intact).

Order of a start: refuse an incompatible checkpoint (``rundir``) -> validate (devices, layout,
EP plans) -> refuse a run that cannot fit in memory (``fits``) -> lock the run directory
(``runlock``: an unusable ``--out`` ends the start here, before the kernel self-test; a missing
parent is created, with a note) -> data and held-out data, kernels -> choose the checkpoint
to resume from (``resume``: the newest that verifies) -> first step -> write the run's files.
A start that ends before writing anything removes the directories it created. Until the
first step a stop signal ends the process at once (``signals.StopFlag.begin_start_up``).

With ``train.eval_every`` the loop evaluates the held-out loss every N steps and at the last,
into that step's record (``eval_loss``, ``eval_ppl``). It saves at the last step, on a stop
signal and as ``checkpoint.Schedule`` says (steps, wall time). Every wait prints a line
(``progress``).
"""

from __future__ import annotations

import functools
import json
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from moe_train import eval as evaluate
from moe_train import python_command, selftest, telemetry
from moe_train.base.exits import EXIT_CONFIG, EXIT_DIVERGED, EXIT_OK, OutputError, output_error  # noqa: F401
from moe_train.base.platform import Platform
from moe_train.checkpoints import checkpoint
from moe_train.config import Config, ConfigError, for_devices, save_json, study_changes, to_dict
from moe_train.convert import weights
from moe_train.data import make_source
from moe_train.model import flops, precision
from moe_train.parallel import jobplan, sharding
from moe_train.telemetry import summary
from moe_train.train import (
    distributed,
    fits,
    metrics,
    progress,
    resume,
    rundir,
    runlock,
    signals,
    tracking,
)
from moe_train.train.guard import Divergence, NonFiniteGuard, origin
from moe_train.train.runconfig import RunConfig
from moe_train.train.step import StepCounter, init_state, make_train_step
from moe_train.train.stepper import BucketedStep, Confirmed
from topology import device_mesh

Log = Callable[[str], None]


def select_devices(cfg: Config) -> list[jax.Device]:
    """The first ``parallel.devices`` devices of the job (all processes), in JAX's order."""
    available = jax.devices()
    n = cfg.parallel.devices or len(available)
    if n > len(available):
        raise ConfigError(
            f"parallel.devices={n} but only {len(available)} "
            f"{available[0].platform} device(s) are visible; choose 1..{len(available)}"
        )
    jobplan.check_batch(cfg.train.batch_size, n, cfg.train.micro_batches)
    return available[:n]


def global_batch(source, step: int, mesh):
    """This step's batch as one global array (a packed batch: a dict of them); each process
    supplies its own rows."""
    local = source.batch(step, process_index=jax.process_index(), process_count=jax.process_count())
    batch_sh = sharding.batch_sharding(mesh)
    return jax.tree.map(lambda a: jax.make_array_from_process_local_data(batch_sh, a), local)


def _lock(out_dir: Path, log: Log) -> runlock.RunLock | None:
    """Process 0 locks the run directory; every process learns whether it could."""
    lock, err = None, None
    if jax.process_index() == 0:
        try:
            lock = runlock.acquire(out_dir)
        except (ConfigError, OutputError) as e:
            err = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ok = multihost_utils.process_allgather(np.int32(err is None))
        if err is None and not np.all(ok):
            err = ConfigError(f"process 0 could not lock the run directory {out_dir} (see its log)")
    if err is not None:
        raise err
    if lock is not None and lock.warning:
        log(f"WARNING: {lock.warning}")
    return lock


def _write_run_files(run_cfg: RunConfig, out_dir: Path, log: Log) -> None:
    """config.json (as configured), kernels.json, layout.json (process 0): after the first
    step traced."""
    cfg, plan = run_cfg.configured, run_cfg.layout
    for line in plan.lines:
        log(f"layout: {line}")
    for line in plan.warnings:
        log(f"WARNING: {line}")
    study = study_changes(cfg)
    if study:  # one line for all of them
        log(
            f"WARNING: {', '.join(study)}: [study] keys are for benchmarks and studies only; a real "
            "training run leaves them at their defaults (study.router=balanced chooses experts by token "
            "position, not learned; study.capacity_factor drops tokens)"
        )
    if jax.process_index() != 0:
        return
    save_json(cfg, out_dir / "config.json")
    selftest.write(out_dir, run_cfg.kernels)
    p = plan.placement
    (out_dir / "layout.json").write_text(
        json.dumps(
            {
                "mesh": dict(plan.mesh.shape),
                "ep_groups": p.ep_groups,
                "domains": p.domains,
                "straddling": p.straddling,
                "notes": list(plan.lines),
                "warnings": list(plan.warnings),
            },
            indent=1,
        )
        + "\n"
    )


def run(
    cfg: Config,
    out_dir: Path,
    log: Log = print,
    resume_step: int | None = None,
    model: str = "",
    memory: fits.MemoryModel | None = None,
) -> int:
    """Train ``cfg`` into ``out_dir``; returns the process exit code. ``model``: the preset as
    the user typed it, for messages; ``memory``: the planner's memory model that checks the run
    fits before anything starts (``fits.check``; None: not checked)."""
    installed = signals.STOP.install()  # the CLI installed it already: then it restores it
    signals.STOP.begin_start_up()
    try:
        return _run(cfg, Path(out_dir), log, resume_step, model, memory)
    finally:
        signals.STOP.end_start_up()
        if installed:
            signals.STOP.restore()


def _run(
    cfg: Config, out_dir: Path, log: Log, resume_step: int | None, model: str, memory: fits.MemoryModel | None
) -> int:
    rundir.refuse_incompatible(cfg, out_dir, resume_step)  # before the self-test and compiles
    devices = select_devices(cfg)
    job_cfg = for_devices(cfg, len(devices))  # train.micro_batch_size -> micro_batches here
    plan = device_mesh.build(job_cfg, devices)
    sharding.ep_plans(job_cfg, plan.mesh)  # dispatcher and capacity buckets, before any write
    fits.check(job_cfg, devices, model, memory)  # the memory it needs, before anything is initialised
    created, lock = rundir.first_missing(out_dir), None  # what locking creates: removed if left empty
    signals.STOP.at_start_up_exit.append(lambda: rundir.remove_if_new(created))
    try:
        lock = _lock(out_dir, log)  # an unusable --out ends the start here, before the self-test
        if created is not None and created != out_dir.absolute():
            log(f"note: created {created} for --out {out_dir} (it did not exist)")
        return _started(cfg, job_cfg, plan, out_dir, log, resume_step)
    finally:
        rundir.remove_if_new(created)  # a start that wrote nothing leaves no directory behind
        if lock is not None:
            lock.release()


def _started(
    cfg: Config, job_cfg: Config, plan: device_mesh.Layout, out_dir: Path, log: Log, resume_step: int | None
) -> int:
    """The start once ``out_dir`` is locked: data, kernel self-test, resume, train. ``cfg``: as
    configured; ``job_cfg``: on this job's devices. Builds the run's one ``RunConfig``."""
    t = cfg.train
    # The data (and held-out data) before the kernel self-test: a DataError ends it sooner.
    source = make_source(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, batch_size=t.batch_size
    )
    try:
        evals = evaluate.InRun.of(cfg)
        with progress.waiting(log, "running the kernel self-test", after_s=2, done=False):
            resolved, kernel_line, kernels = selftest.run(job_cfg, out_dir)
        log(kernel_line)
        stopped = _stopped_in_start_up(log, "after the kernel self-test")
        if stopped is not None:
            return stopped
        run_cfg = RunConfig(
            configured=cfg, resolved=resolved, layout=plan, kernels=kernels, platform=Platform.here()
        )
        ckpt = checkpoint.open_for(out_dir, t)
        try:
            return Start(run_cfg, out_dir, source, ckpt, log, evals).resume_and_train(resume_step)
        finally:
            checkpoint.close(ckpt)
    finally:
        source.close()


def _stopped_in_start_up(log: Log, where: str) -> int | None:
    """The exit code when any process got a stop signal during start-up (else None)."""
    signum = signals.STOP.agreed()
    if signum is None:
        return None
    if not signals.STOP.say_start_up_stop():  # the signal thread is ending the process
        threading.Event().wait()
    log(signals.start_up_line(signum, f", {where}"))
    return signals.exit_code(signum)


class Start:
    """One start of a run: what it resumes from, its loop and how it ends."""

    def __init__(self, run_cfg: RunConfig, out_dir: Path, source, ckpt, log: Log, evals=None):
        self.run_cfg, self.out_dir = run_cfg, out_dir  # the one config of the run (RunConfig)
        self.source, self.ckpt, self.log = source, ckpt, log
        self.evals = evals  # evaluate.InRun with train.eval_every, else None
        self.meta = {"config": to_dict(run_cfg.configured)}  # as configured: "auto" stays auto
        self.origin = ""  # where this start's weights came from (guard.origin)

    def resume_and_train(self, resume_step: int | None) -> int:
        log, cfg, mesh = self.log, self.run_cfg.resolved, self.run_cfg.mesh
        log(precision.describe(cfg, self.run_cfg.platform))
        state = fits.initialised(init_state(cfg, mesh))
        resumed = resume.choose(self.ckpt, state, self.run_cfg.configured, resume_step, log)
        if resumed is not None:
            state = resumed.state
            log(f"resumed from {resumed.directory} (step {int(state.step)})")
        elif cfg.train.init_from:  # a new run: the given weights, the optimizer fresh
            state = weights.start_from(cfg.train.init_from, state, cfg, mesh, log)
        self.origin = origin(resumed, cfg.train.init_from)
        stopped = _stopped_in_start_up(log, f"before step {int(state.step) + 1}")
        if stopped is not None:
            return stopped
        signals.STOP.end_start_up()  # from the first step on, a stop signal saves first
        return Loop(self, state).run()

    def save(self, step: int, state) -> None:
        with progress.waiting(self.log, f"saving checkpoint {step}"):
            self._saving(self.ckpt.save, step, state, self.meta)

    def wait(self) -> None:
        with progress.waiting(self.log, "writing the checkpoint to disk"):
            self._saving(self.ckpt.wait)

    def check_saves(self) -> None:
        """A background save that failed ends the run now, not at the next save."""
        self._saving(self.ckpt.check_for_errors)

    def _saving(self, call: Callable[..., None], *args) -> None:
        """``call(*args)`` on the checkpointer: a state with NaN/inf raises Divergence, a
        failed save the OutputError of ``_save_failed``."""
        try:
            call(*args)
        except checkpoint.NonFiniteState as err:
            raise Divergence(str(err)) from None
        except Exception as err:
            raise self._save_failed(err) from None

    def _save_failed(self, err: Exception) -> Exception:
        """A failed save as an OutputError naming the checkpoint that is still intact."""
        out = output_error(err, self.ckpt.directory)
        if out is None:
            return err
        self.ckpt.reload()
        kept = self.ckpt.latest_step()
        return OutputError(
            f"{out}; {'no checkpoint is complete' if kept is None else f'checkpoint {kept} is intact'}"
        )

    def last_good(self) -> str:
        """Where the weights came from and where a rerun resumes (the divergence message)."""
        step = self.ckpt.latest_step()
        rerun = (
            "no checkpoint was saved yet: a rerun starts from step 0"
            if step is None
            else f"the last good checkpoint is step {step}: a rerun resumes there"
        )
        return "; ".join(x for x in (self.origin, rerun) if x)


class Loop:
    """The steps of one start, from the resumed step to ``train.steps``."""

    def __init__(self, start: Start, state):
        self.s, self.state, self.run_cfg = start, state, start.run_cfg
        cfg, mesh = self.run_cfg.resolved, self.run_cfg.mesh
        self.first = int(state.step)
        self.counter = StepCounter()
        shardings = jax.tree.map(lambda x: x.sharding, state)
        step_for = functools.partial(make_train_step, cfg, mesh, self.counter, shardings)
        # the jitted step, its buckets and a line for every compile
        self.step_fn = BucketedStep(cfg, mesh, self.counter, step_for, log=start.log, first=self.first)
        self.guard = NonFiniteGuard(cfg.train, start.log, first=self.first)
        self.writer, self.sampler = None, telemetry.NullSampler()
        self.tracker: tracking.Tracker | None = None  # TensorBoard / W&B, process 0
        self.records: list[dict] = []
        # peak FLOP/s per device for MFU (``summary.peak_for``: preset, else device kind)
        self.peak = summary.peak_for(to_dict(cfg), mesh.devices.flat[0].device_kind)
        self.fpt = flops.train_flops_per_token(cfg)
        self.saves = checkpoint.Schedule(cfg.train)  # its timer starts now
        self.stopped_by: int | None = None  # the agreed stop signal, when one ended the loop

    def run(self) -> int:
        s, t = self.s, self.run_cfg.resolved.train
        if self.first >= t.steps:
            s.log(f"nothing to do: {s.out_dir} is already at step {self.first} of {t.steps}")
            return EXIT_OK
        m = self.run_cfg.mesh
        s.log(
            f"training {s.source.description} on {m.devices.size} {m.devices.flat[0].platform} "
            f"device(s) (mesh {dict(m.shape)}, {jax.process_count()} process(es)), "
            f"steps {self.first + 1}-{t.steps}, batch {t.batch_size}x{t.seq_len}"
        )
        if s.evals is not None:
            s.log(s.evals.line())
        # Sampling from the first step (compile included), written once that step ran.
        self.sampler = telemetry.start(
            s.out_dir,
            t.telemetry_interval_s,
            log=s.log,
            hold=True,
            devices=[d for d in m.devices.flat if d.process_index == jax.process_index()],
        )
        try:
            status = self._steps()
        except Divergence as err:
            s.log(f"error: {err}; {s.last_good()}")
            return EXIT_DIVERGED
        finally:
            self._close()
        s.log(
            metrics.summary(
                self.records,
                first_step=self.first,
                description=s.source.description,
                out_dir=s.out_dir,
                status=status,
                checkpoint=self.saves.last_saved(),
            )
        )
        _write_summary(s.out_dir, self.peak, s.log)
        if self.stopped_by is not None:
            s.log(signals.resume_hint())
        return signals.exit_code(self.stopped_by)

    def _steps(self) -> str:
        """Dispatches each step before the one before it is confirmed (``BucketedStep``).
        The loop waits for the step in flight (drains) only where it needs its state: the
        first step (its compiled memory), a checkpoint, the last step and a stop signal, so
        every save holds a confirmed state; every process agrees on the stop flag and the
        save timer (one gather a step). Records are written as steps are confirmed. An
        evaluation step (``train.eval_every``, and the last) drains too and evaluates the
        confirmed state before its record is written."""
        t, s, mesh = self.run_cfg.resolved.train, self.s, self.run_cfg.mesh
        for step in range(self.first, t.steps):
            n = step + 1
            self.sampler.set_step(n)
            batch = global_batch(s.source, step, mesh)
            self.state, done = self.step_fn.submit(self.state, batch)
            if done is not None:
                self._record(n - 1, done, batch=None)
            last, (signum, timed) = n == t.steps, signals.STOP.agree(self.saves.timer_due())
            save = last or signum is not None or timed or self.saves.step_due(n)
            evaluate_now = s.evals is not None and s.evals.due(n)
            if save or step == self.first or evaluate_now:
                self.state, done = self.step_fn.drain(self.state)
                assert done is not None, "step n was submitted above and is in flight"
                with progress.waiting(s.log, f"evaluating the held-out loss at step {n}"):
                    held_out = (
                        s.evals(self.run_cfg.resolved, mesh, self.state)
                        if evaluate_now and s.evals is not None
                        else None
                    )
                self._record(n, done, batch, held_out)
            if save:
                s.save(n, self.state)
                self.saves.saved(n)
            if signum is not None and not last:
                s.wait()
                self.stopped_by, name = signum, signals.name(signum)
                return f"stopped by signal {name} after step {n}; checkpoint {n} saved"
        s.wait()
        return "finished"

    def _record(self, n: int, done: Confirmed, batch, evaluation: dict | None = None) -> None:
        """Step ``n`` is confirmed: its record (the first step's with the compiled memory of
        ``batch``; an evaluation step's with ``evaluation``), the non-finite guard (raises
        Divergence), metrics.jsonl and the log."""
        cfg, s = self.run_cfg.resolved, self.s
        t = cfg.train
        rec = metrics.step_record(
            n,
            done.raw,
            step_time_s=done.seconds,
            tokens=t.batch_size * t.seq_len,
            flops_per_token=self.fpt,
            devices=self.run_cfg.mesh.devices.size,
            peak_flops=self.peak,
            compilations=done.traces,
            mtp=cfg.model.mtp_depth > 0,
        )
        rec["compiled"] = done.compiled
        peak_bytes = metrics.device_peak_bytes(jax.local_devices())
        if peak_bytes is not None:  # a GPU's allocator: the real peak, beside compiled_peak_bytes
            rec["device_peak_bytes"] = peak_bytes
        rec.update(evaluation or {})
        if n == self.first + 1:
            self._first_step_done(batch, rec)
        distributed.beat(n)  # the multi-process watchdog: this process progresses
        rec.update(self.guard.check(n, done.raw))  # raises Divergence
        s.check_saves()
        self._write(rec)
        if n % t.log_every == 0 or n == t.steps or evaluation:
            s.log(metrics.progress_line(rec, t.steps, self.records))

    def _first_step_done(self, batch, rec: dict) -> None:
        """The step traced and ran once: its compile-time checks passed, so now write the
        run's files, truncate metrics.jsonl to the resumed step and release telemetry."""
        s = self.s
        rec.update(
            _compiled_memory(self.step_fn, self.state, batch, s.log),
            selftest_s=self.run_cfg.kernels["selftest_s"],
        )
        try:
            _write_run_files(self.run_cfg, s.out_dir, s.log)
            self.writer = metrics.MetricsWriter(
                s.out_dir / "metrics.jsonl", self.first, enabled=jax.process_index() == 0, log=s.log
            )
        except OSError as err:
            if (out := output_error(err, s.out_dir)) is None:
                raise
            raise out from err
        if jax.process_index() == 0:  # never raises: a failure is one warning, tracking off
            self.tracker = tracking.Tracker(
                s.out_dir, self.first, self.run_cfg.resolved.train, config=s.meta["config"], log=s.log
            )
        self.sampler.release()

    def _write(self, rec: dict) -> None:
        assert self.writer is not None, "opened after the first step"
        try:
            self.writer.write(rec)
        except OSError as err:
            if (out := output_error(err, self.writer.path)) is None:
                raise
            raise out from err
        if self.tracker is not None:
            self.tracker.write(rec)
        self.records.append(rec)

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.tracker is not None:
            self.tracker.close()
        self.sampler.set_step(None)
        self.sampler.stop()


def _compiled_memory(step_fn: BucketedStep, state, batch, log: Log) -> dict:
    """Log the compiled step's per-device memory and return it as metrics ({} if unknown)."""
    t0 = time.perf_counter()
    mem = step_fn.compiled_memory(state, batch)
    if mem is None:
        return {}
    log(f"{mem.line()} [{time.perf_counter() - t0:.2f} s to read]")
    return mem.metrics()


def _write_summary(out_dir: Path, peak: float | None, log: Log) -> None:
    """Once every process has stopped its sampler, process 0 writes ``summary.json``."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("moe_train: telemetry flushed")
    if jax.process_index() == 0:
        path = summary.write(out_dir, peak_flops=peak, process_count=jax.process_count(), log=log)
        if path is not None:
            log(
                f"Summary: {path}; report: {python_command()} -m moe_train.report {shlex.quote(str(out_dir))}"
            )
