"""Measure all-to-all time over message sizes on the devices this job has.

Every device sends an equal block to every other device of a one-axis mesh (the dense
all-to-all the expert-parallel dispatch uses), for message sizes from ``min_bytes`` to
``max_bytes`` per device, doubling. Each size is compiled once, run ``warmup`` times, then
timed ``reps`` times; the median goes into the calibration fit (``topology.calibration``).
On GPUs this times NCCL; on CPU the fake host devices (the code path, not a network).

All processes of a multi-process job must call ``measure`` together (it is one collective).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topology.calibration import Sample

AXIS = "peers"


def _exchange(mesh: Mesh):
    """Jitted all-to-all of a [devices * devices, n] array split along its rows."""

    def body(x):  # this device's [devices, n] block
        return jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True)

    spec = P(AXIS, None)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of two from ``min_bytes`` to ``max_bytes`` (both rounded to powers of two)."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    out, b = [], 1 << (int(min_bytes) - 1).bit_length()
    while b <= max_bytes:
        out.append(b)
        b *= 2
    return out


def _time_one(fn, x, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn(x).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    devices: Sequence[jax.Device], message_bytes: Sequence[int], warmup: int = 2, reps: int = 5
) -> list[Sample]:
    """Median all-to-all time for each size; ``bytes_per_device`` counts what leaves a device.

    Each device holds ``devices`` blocks of ``n`` float32 values and keeps one of them, so it
    sends ``(devices - 1) * n * 4`` bytes; ``n`` is chosen so that this is close to the size.
    """
    count = len(devices)
    if count < 2:
        raise ValueError("an all-to-all probe needs at least 2 devices")
    mesh = Mesh(np.asarray(devices), (AXIS,))
    fn = _exchange(mesh)
    sharding = NamedSharding(mesh, P(AXIS, None))
    out = []
    for size in message_bytes:
        n = max(1, size // (4 * (count - 1)))
        shape = (count * count, n)
        x = jax.make_array_from_callback(
            shape, sharding, lambda idx, shape=shape: np.ones(shape, np.float32)[idx]
        )
        seconds = _time_one(fn, x, warmup, reps)
        out.append(Sample(bytes_per_device=(count - 1) * n * 4, seconds=seconds))
        del x
    return out


def check_exchange(devices: Sequence[jax.Device]) -> bool:
    """The probe's all-to-all moves block j of device i to block i of device j."""
    count = len(devices)
    mesh = Mesh(np.asarray(devices), (AXIS,))
    sharding = NamedSharding(mesh, P(AXIS, None))
    src = np.arange(count * count, dtype=np.float32).reshape(count * count, 1)
    x = jax.make_array_from_callback(src.shape, sharding, lambda idx: src[idx])
    got = np.asarray(multihost_utils.process_allgather(_exchange(mesh)(x), tiled=True))
    want = src.reshape(count, count).T.reshape(-1, 1)
    return bool(np.array_equal(got, want))
