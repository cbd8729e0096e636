"""Does the run fit in the memory it has? Checked before anything is initialised or compiled.

``check(cfg, devices, memory=...)`` compares the memory planner's per-device estimate
(``moe_train.planner.memory.trainer``, what ``make plan`` prints) with the memory this process's
devices have, and raises ``ConfigError`` (exit 2, one line) when the run cannot fit: the
model's need, what the run has, and what would fit (a change of ``train.*`` keys the planner
found, a smaller preset, or ``make plan`` for a cluster job).

What the run has:

* CPU: the host's memory, shared by this process's devices: ``MemAvailable`` of
  ``/proc/meminfo`` (else ``os.sysconf``), capped by the cgroup's ``memory.max``. The need is
  the per-device estimate times the local devices. Without this check a run that cannot fit
  waited for ever: XLA:CPU fails the state's allocation, and with jax 0.10.2 reading a
  scalar of the failed computation (the step counter) blocks at 0% CPU instead of raising
  (``moe_train.train.step.init_state`` now waits for the whole state, which raises).
* GPU/TPU: each local device's ``memory_stats()["bytes_limit"]`` (what XLA may allocate).

``MOE_TRAIN_HOST_MEMORY_BYTES`` (CPU) and ``MOE_TRAIN_DEVICE_MEMORY_BYTES`` (per accelerator)
replace those figures: tests shrink them to see the refusal at toy scale; a value above the
estimate starts a run the estimate refuses (the estimate errs high by up to ~1.3x on CPU).
Where no figure is known, or the planner cannot model the job, nothing is checked.

The planner is an input (``MemoryModel``): the trainer core never imports it. ``python -m
moe_train`` and the launcher's task pass it in; a library call that passes none (tests, the
benchmarks) is not checked here, and an out-of-memory compile is still refused in one line
(``step_out_of_memory``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from moe_train.config import Config, ConfigError, list_presets
from moe_train.config import build as build_config
from topology.presets import load

HOST_ENV = "MOE_TRAIN_HOST_MEMORY_BYTES"  # bytes the run may use on a CPU host (all its devices)
DEVICE_ENV = "MOE_TRAIN_DEVICE_MEMORY_BYTES"  # bytes the run may use on each accelerator
GIB, MIB = 2**30, 2**20


@dataclasses.dataclass(frozen=True)
class Memory:
    """What this process's devices have."""

    bytes: int  # the memory the run may use: the host's (CPU) or each device's (accelerators)
    what: str  # where it comes from, e.g. "this host has ... available (MemAvailable)"
    shared: bool  # True: one pool for all local devices (CPU); False: per device


class MemoryModel(Protocol):
    """What the trainer asks the memory planner (``moe_train.planner.memory.trainer`` is one)."""

    def need(self, cfg: Config, cluster, n: int) -> Any:
        """The per-device ``Estimate`` of ``cfg`` on ``n`` devices of ``cluster`` (None where
        the planner cannot model the job)."""
        ...

    def local_change(self, cfg: Config, est, cluster, usable: int) -> str | None:
        """The cheapest ``key=value`` change of ``train.*``/``parallel.*`` keys that fits in
        ``usable`` bytes per device on these devices (None: none does)."""
        ...


def check(cfg: Config, devices: Sequence, model: str = "", memory: MemoryModel | None = None) -> None:
    """ConfigError when ``cfg`` on ``devices`` (the job's, all processes) cannot fit in this
    process's memory (see the module doc); ``model``: the preset as typed, for the message;
    ``memory``: the planner's model (None: nothing is checked)."""
    local = [d for d in devices if d.process_index == _process_index()]
    why = _refusal(cfg, devices, local, model, memory) if local and memory is not None else None
    why = _agree(why)
    if why is not None:
        raise ConfigError(why)


def _refusal(cfg: Config, devices: Sequence, local: Sequence, model: str, memory: MemoryModel) -> str | None:
    """Why ``cfg`` cannot start here (None: it fits, or nothing is known)."""
    platform = local[0].platform
    have = available(platform, local)
    if have is None:
        return None
    cluster = cluster_for(platform, getattr(local[0], "device_kind", ""), len(devices))
    est = memory.need(cfg, cluster, len(devices))
    if est is None:
        return None
    usable = have.bytes // len(local) if have.shared else have.bytes
    if est.per_device["total"] <= usable:
        return None
    fix = _what_fits(cfg, est, cluster, usable, model, memory)
    return message(cfg, est, have, len(local), model) + " " + fix


def available(platform: str, local: Sequence) -> Memory | None:
    """What the run may use: the host's memory on CPU, each device's limit elsewhere."""
    if platform == "cpu":
        given = env_bytes(HOST_ENV)
        if given is not None:
            return Memory(given, f"{HOST_ENV}={given} allows {_size(given)}", True)
        host = host_available()
        if host is None:
            return None
        return Memory(host[0], f"this host has {_size(host[0])} available ({host[1]})", True)
    given = env_bytes(DEVICE_ENV)
    if given is not None:
        return Memory(given, f"{DEVICE_ENV}={given} allows {_size(given)} per device", False)
    limits = [bytes_limit(d) for d in local]
    if not limits or None in limits:
        return None
    low = min(x for x in limits if x is not None)
    return Memory(low, f"each {platform} device has {_size(low)} (XLA's bytes_limit)", False)


def env_bytes(name: str) -> int | None:
    """The integer byte count in environment variable ``name`` (None: unset or empty)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = -1
    if value <= 0:
        raise ConfigError(f"{name}={text!r}: expected a positive number of bytes, e.g. {name}=8589934592")
    return value


def host_available() -> tuple[int, str] | None:
    """(bytes of host memory available now, where the figure comes from), or None."""
    found = _meminfo_available()
    if found is None:
        try:
            found = (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages")
        except (ValueError, OSError, AttributeError):
            return None
    room = _cgroup_room()
    return (room, "its cgroup's memory.max") if room is not None and room < found[0] else found


def _meminfo_available() -> tuple[int, str] | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or None if unlimited."""
    try:
        rel = next(
            line.split(":", 2)[2]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )
        group = root / rel.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def bytes_limit(device) -> int | None:
    """What XLA may allocate on ``device`` (``memory_stats()["bytes_limit"]``); None where the
    platform does not say (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # not every backend implements it
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def cluster_for(platform: str, kind: str, n: int):
    """The cluster preset that models these devices: ``cpu-local`` (one host holding all ``n``
    devices) on CPU and other non-GPU platforms; on GPU the preset of the device kind's
    name (H100, H200, B200, GB200), else ``h100-dgx``."""
    if platform != "gpu":
        cpu = load("cpu-local")
        return dataclasses.replace(cpu, domain_size=max(cpu.domain_size, n))
    name = kind.lower().replace("nvidia ", "")
    for gpu, preset in (("gb200", "gb200-nvl72"), ("b200", "b200-hgx"), ("h200", "h200-hgx")):
        if gpu in name:
            return load(preset)
    return load("h100-dgx")


def message(cfg: Config, est, have: Memory, local: int, model: str = "") -> str:
    """What the run needs and has, in words (the first part of the refusal)."""
    per = est.per_device
    largest = max((k for k in per if k != "total"), key=lambda k: per[k])
    n = est.params_total
    count = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    together = f", {_size(per['total'] * local)} for its {local} devices" if have.shared and local > 1 else ""
    name = f"{model} " if model else "this model "
    return (
        f"the run does not fit in memory: {name}({count} parameters, batch {cfg.train.batch_size}x"
        f"{cfg.train.seq_len}, train.remat={cfg.train.remat}) needs about {_size(per['total'])} per "
        f"device by the memory planner (largest: {largest} {_size(per[largest])}){together}, and "
        f"{have.what}; nothing was started."
    )


def _what_fits(cfg: Config, est, cluster, usable: int, model: str, memory: MemoryModel) -> str:
    """The cheapest local change the planner finds, a shipped preset that fits, make plan."""
    fixes = []
    change = memory.local_change(cfg, est, cluster, usable)
    if change:
        fixes.append(f"--set {change}")
    preset = _smaller_preset(cluster, est.setup.devices, usable, memory)
    if preset:
        fixes.append(f"a smaller model: --preset {preset}")
    plan = f"make plan MODEL={shlex.quote(model) if model else '<preset>'} PRESET=<cluster> NODES=<n>"
    what = " or ".join(fixes)
    return f"Fits here: {what}; on a cluster: {plan}" if what else f"On a cluster: {plan}"


def _smaller_preset(cluster, n: int, usable: int, memory: MemoryModel) -> str | None:
    """The shipped model preset with the largest estimate that still fits on these devices."""
    best: tuple[int, str] | None = None
    for name in list_presets():
        try:
            est = memory.need(build_config(name, []), cluster, n)
        except ConfigError:
            continue
        total = None if est is None else est.per_device["total"]
        if total is not None and total <= usable and (best is None or total > best[0]):
            best = (total, name)
    return None if best is None else best[1]


def _size(b: int) -> str:
    return f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / MIB:.1f} MiB"


def _process_index() -> int:
    import jax

    return jax.process_index()


def _agree(why: str | None) -> str | None:
    """Every process refuses when one does (a peer that went on would wait in a collective)."""
    import jax

    if jax.process_count() == 1:
        return why
    import numpy as np
    from jax.experimental import multihost_utils

    ok = np.asarray(multihost_utils.process_allgather(np.int32(why is None))).reshape(-1)
    if why is None and not ok.all():
        bad = ", ".join(str(i) for i in np.flatnonzero(ok == 0))
        return f"the run does not fit in memory on process(es) {bad} (see their log); nothing was started"
    return why


_OOM_MARKS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def _memory_error_text(err: BaseException) -> str | None:
    """The error's text on one line when it says memory ran out, else None."""
    text = " ".join(str(err).split())
    return text if any(mark in text for mark in _OOM_MARKS) else None


def initialised(state):
    """``state`` once every array of it exists. With jax 0.10.2 on XLA:CPU, when an output of
    the initialisation cannot be allocated, reading another output (the step counter) waits
    for ever at 0% CPU; waiting for all of them raises the allocation's error, which becomes
    one line (exit 2) here, for a run the planner's estimate let through."""
    import jax

    try:
        return jax.block_until_ready(state)
    except Exception as err:
        text = _memory_error_text(err)
        if text is None:
            raise
        raise ConfigError(
            f"the run does not fit in memory: initialising its state failed ({text[:200]}); "
            f"nothing was started. Check it with make plan, or try a smaller model (--preset small)"
        ) from None


def step_changes(cfg: Config) -> list[str]:
    """The settings that shrink a step's memory, cheapest first, that the run has not taken."""
    t = cfg.train
    out = [] if t.remat == "full" else ["--set train.remat=full (recompute each block in the backward)"]
    per = t.micro_batch_size or t.batch_size
    if per > 1:
        out.append(f"--set train.micro_batch_size={per // 2} (half the sequences per micro-batch)")
    return out or [f"--set train.seq_len={t.seq_len // 2} or a smaller model"]


def step_out_of_memory(err: BaseException, cfg: Config) -> ConfigError | None:
    """The one-line refusal for a train step XLA could not fit in device memory (at compile
    time, e.g. XLA:TPU's "HLO temporaries ... exceeds available HBM", or when it ran), naming
    the changes that shrink it; None for any other error. The step ran on nothing: the state
    and the checkpoints are as they were."""
    text = _memory_error_text(err)
    if text is None:
        return None
    return ConfigError(
        f"the train step does not fit in device memory ({text[:240]}); that step did not run "
        f"and the checkpoints are as they were. Try " + ", or ".join(step_changes(cfg))
    )
