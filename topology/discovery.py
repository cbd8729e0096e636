"""Which NVLink domain each device of the job is in, found in software.

Every process asks about its own devices (``discover_local``), the answers are gathered to all
processes (``gather``), grouped (``domains_of``) and checked against a cluster preset
(``check_against``). For each device the first source that answers wins:

1. ``fake``: an explicit ``fake_domains=N`` override (tests, CPU runs): the job's devices, in
   device-id order, cut into N equal runs.
2. ``nvml``: NVML fabric info (``nvmlDeviceGetGpuFabricInfoV``). GPUs whose registration is
   COMPLETED with the same non-zero clusterUuid and cliqueId share one multi-node NVLink domain
   (the rule NCCL uses); an NVL72 rack is one clique. Skipped on CPU devices.
3. ``jax``: ``device.partition_index`` (older JAX: ``slice_index``); newer XLA derives it from
   the same fabric info, else from the host.
4. ``slurm``: ``SLURM_TOPOLOGY_ADDR`` minus its node component, read with
   ``SLURM_TOPOLOGY_ADDR_PATTERN`` (topology/block puts one NVL72 rack in one block).
5. ``host``: the host name; a single HGX node is one NVLink domain.

Each source is a pure function of recorded values (``fabric_domain``, ``jax_domain``,
``slurm_domain``, ``fake_domain_keys``), so all of this is tested without a GPU; only
``read_nvml_fabric`` touches the driver, and it never raises.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import socket
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np

from topology.presets import Cluster

NVML_FABRIC_STATE_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED: fabric registration done
SOURCES = ("fake", "nvml", "jax", "slurm", "host")  # in priority order
GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # jax.Device.platform values that NVML may know


@dataclass(frozen=True)
class FabricRecord:
    """What NVML reported about one GPU's NVLink fabric registration."""

    cluster_uuid: bytes  # 16 bytes naming the NVLink fabric; all zero: no multi-node fabric
    clique_id: int  # the clique (NVLink partition) inside that fabric
    state: int  # NVML_GPU_FABRIC_STATE_*: 0 not supported, 1 not started, 2 running, 3 completed
    status: int  # NVML return code of the registration (0 = success); meaningful when completed


@dataclass(frozen=True)
class DeviceDomain:
    """One device of the job and the NVLink domain it is in."""

    device_id: int  # jax.Device.id, unique across the job
    process_index: int  # the JAX process that owns the device
    host: str  # host name of that process
    domain: str  # domain key, "<source>:<id>"; devices with equal keys share NVLink
    source: str  # which source answered: one of SOURCES
    note: str = ""  # why higher-priority sources gave no answer ("" when none was tried)


# ---------------------------------------------------------------- sources (pure functions)


def fabric_domain(cluster_uuid: bytes, clique_id: int, state: int, status: int = 0) -> str | None:
    """ "nvml:<uuid hex>/<clique>" for a completed, successful registration on a real fabric."""
    if state != NVML_FABRIC_STATE_COMPLETED or status != 0 or not any(cluster_uuid):
        return None
    return f"nvml:{bytes(cluster_uuid).hex()}/{int(clique_id)}"


def jax_domain(partition_index: Any = None, slice_index: Any = None) -> str | None:
    """ "jax:<index>" from ``partition_index``, else the older ``slice_index``; None if neither."""
    for value in (partition_index, slice_index):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return f"jax:{value}"
    return None


def slurm_domain(addr: str | None, pattern: str | None) -> str | None:
    """ "slurm:<block>" from SLURM_TOPOLOGY_ADDR and _PATTERN under topology/block; else None.

    ``("block3.node17", "block.node")`` -> ``"slurm:block3"`` (the node name may contain
    dots). Only the block plugin's blocks stand for NVLink domains (sites put one NVL72 rack
    in one block); a switch tree (``"switch.switch.node"``) groups nodes by network leaf
    switch, which says nothing about NVLink, so it gives no answer.
    """
    if not addr or pattern != "block.node":
        return None
    parts = addr.split(".", 1)
    if len(parts) != 2 or not all(parts):
        return None
    return f"slurm:{parts[0]}"


def host_domain(hostname: str) -> str:
    """ "host:<hostname>": the fallback, one domain per host."""
    return f"host:{hostname}"


def fake_domain_keys(num_devices: int, num_domains: int) -> list[str]:
    """Keys "fake:<d>" for ``num_devices`` devices cut into ``num_domains`` equal runs."""
    if num_domains < 1 or num_devices < 1 or num_devices % num_domains:
        valid = [str(n) for n in range(1, num_devices + 1) if num_devices % n == 0]
        raise ValueError(
            f"fake_domains={num_domains} does not divide the {num_devices} devices "
            f"into equal domains; valid: {', '.join(valid) or 'none'}"
        )
    per = num_devices // num_domains
    return [f"fake:{i // per}" for i in range(num_devices)]


# ---------------------------------------------------------------- NVML (the only driver call)


def read_nvml_fabric(local_gpu_indices: Sequence[int]) -> tuple[list[FabricRecord | None], list[str]]:
    """Fabric info per NVML GPU index: (records, None where unknown) and one reason per None.

    Never raises: a missing pynvml, driver library or function, or any NVML error, gives None
    for the GPUs concerned and a line saying why.
    """
    n = len(local_gpu_indices)
    try:
        import pynvml
    except ImportError as e:
        return [None] * n, [f"nvml: pynvml not importable ({e})"] * n
    get_info = getattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", None)
    struct = getattr(pynvml, "c_nvmlGpuFabricInfoV_t", None)
    if get_info is None or struct is None:
        return [None] * n, ["nvml: this nvidia-ml-py has no nvmlDeviceGetGpuFabricInfoV"] * n
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [None] * n, [f"nvml: init failed: {e}"] * n
    records: list[FabricRecord | None] = []
    reasons: list[str] = []
    try:
        for index in local_gpu_indices:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                info = struct()  # its constructor sets .version (nvmlGpuFabricInfo_v2)
                get_info(handle, ctypes.byref(info))
                records.append(
                    FabricRecord(
                        bytes(info.clusterUuid), int(info.cliqueId), int(info.state), int(info.status)
                    )
                )
            except Exception as e:  # NotSupported on GPUs without fabric, FunctionNotFound, ...
                records.append(None)
                reasons.append(f"nvml: GPU {index}: {type(e).__name__}: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return records, reasons


def nvml_indices(local_hardware_ids: Sequence[int], cuda_visible_devices: str | None) -> list[int] | None:
    """NVML indices of CUDA ordinals: NVML ignores CUDA_VISIBLE_DEVICES, CUDA does not.

    None when the variable names GPUs by UUID or MIG id (then the mapping is unknown here).
    """
    if not cuda_visible_devices:
        return list(local_hardware_ids)
    visible = [v.strip() for v in cuda_visible_devices.split(",")]
    if not all(v.isdigit() for v in visible):
        return None
    try:
        return [int(visible[i]) for i in local_hardware_ids]
    except IndexError:
        return None


# ---------------------------------------------------------------- this process's devices


def _nvml_keys(
    devices: Sequence[Any], env: Mapping[str, str], nvml_reader: Callable
) -> tuple[list[str | None], list[str]]:
    """NVML domain keys for GPU devices (None elsewhere) and one note per device."""
    gpus = [i for i, d in enumerate(devices) if getattr(d, "platform", "cpu") in GPU_PLATFORMS]
    keys: list[str | None] = [None] * len(devices)
    notes = [""] * len(devices)
    if not gpus:
        return keys, notes
    indices = nvml_indices([devices[i].local_hardware_id for i in gpus], env.get("CUDA_VISIBLE_DEVICES"))
    if indices is None:
        for i in gpus:
            notes[i] = "nvml: CUDA_VISIBLE_DEVICES is not a list of indices"
        return keys, notes
    records, reasons = nvml_reader(indices)
    reasons = iter(reasons)
    for i, rec in zip(gpus, records):
        if rec is None:
            notes[i] = next(reasons, "nvml: no answer")
            continue
        keys[i] = fabric_domain(rec.cluster_uuid, rec.clique_id, rec.state, rec.status)
        if keys[i] is None:
            notes[i] = f"nvml: fabric state {rec.state}, status {rec.status}, no cluster"
    return keys, notes


def discover_local(
    devices: Sequence[Any],
    *,
    hostname: str | None = None,
    env: Mapping[str, str] | None = None,
    nvml_reader: Callable | None = None,
    fake_domains: int = 0,
    all_devices: Sequence[Any] | None = None,
) -> list[DeviceDomain]:
    """One DeviceDomain per device of this process's ``devices``: the first source that answers.

    ``devices`` are jax.Device objects or anything with ``id``, ``process_index`` and, where
    they exist, ``platform``, ``local_hardware_id`` (GPU), ``partition_index``/``slice_index``.
    ``fake_domains=N`` cuts ``all_devices`` (default ``devices``; pass ``jax.devices()`` with
    several processes) into N domains by device-id order and skips every other source.
    ``env`` defaults to os.environ, ``nvml_reader`` to ``read_nvml_fabric``.
    """
    hostname = hostname if hostname is not None else socket.gethostname()
    env = os.environ if env is None else env
    if fake_domains:
        ids = sorted(d.id for d in (all_devices if all_devices is not None else devices))
        fake = dict(zip(ids, fake_domain_keys(len(ids), fake_domains)))
        return [DeviceDomain(d.id, d.process_index, hostname, fake[d.id], "fake") for d in devices]
    nvml, notes = _nvml_keys(devices, env, nvml_reader or read_nvml_fabric)
    slurm = slurm_domain(env.get("SLURM_TOPOLOGY_ADDR"), env.get("SLURM_TOPOLOGY_ADDR_PATTERN"))
    out = []
    for dev, nvml_key, note in zip(devices, nvml, notes):
        jax_key = jax_domain(getattr(dev, "partition_index", None), getattr(dev, "slice_index", None))
        found = ((nvml_key, "nvml"), (jax_key, "jax"), (slurm, "slurm"), (host_domain(hostname), "host"))
        key, source = next(((k, s) for k, s in found if k is not None), found[-1])
        out.append(
            DeviceDomain(dev.id, dev.process_index, hostname, key, source, note if source != "nvml" else "")
        )
    return out


# ---------------------------------------------------------------- all processes


def encode_records(records: Iterable[DeviceDomain]) -> bytes:
    """A compact JSON encoding of records (no NUL bytes, so NUL padding can be stripped)."""
    return json.dumps([list(astuple(r)) for r in records], separators=(",", ":")).encode()


def decode_records(data: bytes) -> list[DeviceDomain]:
    """The records ``encode_records`` wrote, ignoring trailing NUL padding."""
    text = bytes(data).rstrip(b"\0")
    return [DeviceDomain(*row) for row in json.loads(text)] if text else []


def gather(
    local: list[DeviceDomain], *, allgather: Callable | None = None, process_count: int | None = None
) -> list[DeviceDomain]:
    """Every process's records on every process, sorted by device id.

    Each process encodes its records, the processes agree on the longest encoding, and one
    ``process_allgather`` of NUL-padded uint8 rows carries them. ``allgather`` and
    ``process_count`` default to JAX's; tests may replace them.
    """
    if process_count is None or allgather is None:
        import jax
        from jax.experimental import multihost_utils

        process_count = jax.process_count() if process_count is None else process_count
        allgather = allgather or multihost_utils.process_allgather
    if process_count == 1:
        return sorted(local, key=lambda r: r.device_id)
    data = np.frombuffer(encode_records(local), dtype=np.uint8)
    width = int(np.max(np.asarray(allgather(np.array([data.size], dtype=np.int32)))))
    row = np.zeros(width, dtype=np.uint8)
    row[: data.size] = data
    rows = np.asarray(allgather(row)).reshape(-1, width)
    records = sorted((r for line in rows for r in decode_records(line.tobytes())), key=lambda r: r.device_id)
    ids = [r.device_id for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"device ids reported by more than one process: "
            f"{sorted(i for i, c in Counter(ids).items() if c > 1)}"
        )
    return records


def discover(
    *, fake_domains: int = 0, hostname: str | None = None, env: Mapping[str, str] | None = None
) -> list[DeviceDomain]:
    """All of the job's devices with their domains (call on every process at the same time)."""
    import jax

    local = discover_local(
        jax.local_devices(), hostname=hostname, env=env, fake_domains=fake_domains, all_devices=jax.devices()
    )
    return gather(local)


# ---------------------------------------------------------------- reading the result


def domains_of(records: Iterable[DeviceDomain]) -> list[list[int]]:
    """Device ids grouped by domain; ids sorted, domains ordered by their smallest id."""
    groups: dict[str, list[int]] = {}
    for r in records:
        groups.setdefault(r.domain, []).append(r.device_id)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def _sizes(groups: Sequence[Sequence[int]]) -> str:
    """Domain sizes for a message: "40+24", or "16x4" / "15x4+1x2" when there are many."""
    sizes = [len(g) for g in groups]
    if len(sizes) <= 8:
        return "+".join(map(str, sizes))
    return "+".join(f"{c}x{s}" for s, c in sorted(Counter(sizes).items(), reverse=True))


def _sources(records: Sequence[DeviceDomain]) -> str:
    """Sources in priority order, joined by '+': "host", "nvml+host"."""
    present = {r.source for r in records}
    return "+".join(s for s in SOURCES if s in present)


def summary(records: Sequence[DeviceDomain]) -> str:
    """One line: "16 devices in 2 NVLink domains (8+8) by host"."""
    groups = domains_of(records)
    return (
        f"{len(records)} device{'s' * (len(records) != 1)} in {len(groups)} NVLink "
        f"domain{'s' * (len(groups) != 1)} ({_sizes(groups)}) by {_sources(records)}"
    )


def check_against(cluster: Cluster, records: Sequence[DeviceDomain]) -> list[str]:
    """Warnings, one readable line each, where the discovered layout disagrees with ``cluster``."""
    warnings = []
    groups = domains_of(records)
    domain_of = {r.device_id: r.domain for r in records}
    for g in groups:
        if len(g) > cluster.domain_size:
            warnings.append(
                f"NVLink domain {domain_of[g[0]]} has {len(g)} devices, more than "
                f"{cluster.name}'s domain_size {cluster.domain_size}; the cluster "
                f"preset or the discovery source is wrong"
            )
    per_host = Counter(r.host for r in records)
    odd = {h: c for h, c in sorted(per_host.items()) if c != cluster.gpus_per_node}
    if odd and not cluster.nominal:
        listed = ", ".join(f"{h} {c}" for h, c in list(odd.items())[:4])
        more = f" and {len(odd) - 4} more" if len(odd) > 4 else ""
        warnings.append(
            f"{len(odd)} of {len(per_host)} hosts do not have {cluster.name}'s "
            f"{cluster.gpus_per_node} devices per node: {listed}{more}"
        )
    nodes = len(per_host)
    fits = math.ceil(nodes / cluster.nodes_per_domain)
    if len(groups) > fits and not any(r.source == "fake" for r in records):
        could = "" if fits == 1 else f" where {fits} would hold it"
        warnings.append(
            f"{cluster.name} job of {nodes} node{'s' * (nodes != 1)} spans "
            f"{len(groups)} NVLink domains ({_sizes(groups)}){could}; EP groups "
            f"that cross them run over the network"
        )
    by_source = Counter(r.source for r in records)
    if len(by_source) > 1:
        counts = ", ".join(f"{by_source[s]} {s}" for s in SOURCES if s in by_source)
        note = next((f"; e.g. process {r.process_index}: {r.note}" for r in records if r.note), "")
        warnings.append(
            f"NVLink domains come from mixed sources ({counts}); keys from "
            f"different sources never match, so domains may be split{note}"
        )
    return warnings
