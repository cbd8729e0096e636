"""Cluster presets: what one kind of machine offers the MoE all-to-all.

Each preset is a small TOML file in ``topology/presets/`` (``list_presets()`` names them).
``load(name)`` reads one, checks every key and value, and returns a frozen ``Cluster``.

A site describes its own cluster by copying the closest shipped file, editing it, and passing
the file's path instead of a name: ``load("/etc/moe/my-cluster.toml")`` (any argument that ends
in ``.toml`` or contains a path separator is read as a path). Site files are validated exactly
like the shipped ones, so a misspelt key fails at load time, not in the middle of a job.

Every ``[env]`` variable must have an entry of the same name in ``[env_source]`` saying where
its value comes from; XLA flags change between versions, so the provenance travels with them.
Numbers come from the hardware-and-topology reference notes (not shipped), which name the public
sources; a ``topology probe`` measurement on the real cluster should override them.
"""

from __future__ import annotations

import math
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_train.base.tomlfile import read_toml
from topology.peaks import dtype_family

PRESET_DIR = Path(__file__).resolve().parent / "presets"
CPU_ARCHS = ("x86_64", "aarch64")


class TopologyError(ValueError):
    """A preset name, file, key or value that cannot describe a cluster."""


@dataclass(frozen=True)
class SlurmOptions:
    """How jobs on this cluster should be submitted."""

    exclusive: bool  # ask for whole nodes (--exclusive); MoE steps cannot share NVLink or NICs
    gpus_per_node: int  # --gpus-per-node; always equal to the cluster's gpus_per_node
    ntasks_per_node: int  # one JAX process per GPU, the robust layout under Slurm
    segment: bool  # --segment=<nodes per NVLink domain>: keep each domain inside one block
    signal: str  # --signal value for preemption; USR2 because NCCL grabs USR1

    def sbatch_args(self, domain_nodes: int) -> list[str]:
        """The sbatch flags these options stand for; ``domain_nodes`` sizes --segment."""
        args = [
            f"--gpus-per-node={self.gpus_per_node}",
            f"--ntasks-per-node={self.ntasks_per_node}",
            f"--signal={self.signal}",
        ]
        if self.exclusive:
            args.append("--exclusive")
        if self.segment:
            args.append(f"--segment={domain_nodes}")
        return args


@dataclass(frozen=True)
class Cluster:
    """One kind of cluster, as far as expert-parallel planning needs to know it."""

    name: str  # preset name, or the file stem for a site file
    description: str  # one line for humans
    source: str  # where the numbers come from
    nominal: bool  # True: numbers only exercise the code path (CPU), not real hardware
    gpus_per_node: int  # accelerators per host
    cpu_arch: str  # host CPU architecture, "x86_64" or "aarch64" (picks the container image)
    domain_size: int  # GPUs in one NVLink domain (8 on HGX, 72 on an NVL72 rack)
    nvlink_gbps_per_gpu: float  # one-way NVLink bandwidth per GPU, GB/s (1e9 bytes/s)
    nic_gbps_per_gpu: float  # one-way scale-out network bandwidth per GPU, GB/s
    latency_nvlink_us: float  # per-collective latency inside a domain, microseconds
    latency_network_us: float  # per-collective latency across domains, microseconds
    eta_nvlink: float  # fraction of nvlink_gbps_per_gpu an all-to-all reaches, 0..1
    eta_network: float  # fraction of nic_gbps_per_gpu an all-to-all reaches, 0..1
    peak_bf16_flops: float  # dense bf16 tensor-core peak per GPU, FLOP/s
    peak_fp8_flops: float  # dense fp8 tensor-core peak per GPU, FLOP/s
    gpu_memory_gib: float  # memory per GPU, GiB (the datasheet's GB as GiB; nominal on CPU)
    hbm_bytes_per_s: float  # memory bandwidth per GPU, bytes/s (the datasheet's TB/s)
    env: Mapping[str, str]  # environment variables for jobs on this hardware (read-only)
    env_source: Mapping[str, str]  # variable name -> where its value comes from (read-only)
    slurm: SlurmOptions  # submission options
    container_image: Mapping[str, str]  # cpu arch -> image tag (read-only)
    gpu: str = ""  # its XLA:GPU target config (topology/targets/<gpu>.txtpb); "" for none

    @property
    def nodes_per_domain(self) -> int:
        """Hosts in one NVLink domain (18 on an NVL72 rack)."""
        return self.domain_size // self.gpus_per_node

    @property
    def image(self) -> str:
        """The container image for this cluster's CPU architecture."""
        return self.container_image[self.cpu_arch]

    def peak_flops(self, dtype: str) -> float | None:
        """Dense peak FLOP/s per GPU for matmuls in ``dtype``; None for nominal presets and
        for dtypes without one clear peak (float32 may run as TF32 or as true FP32)."""
        family = dtype_family(dtype)
        if self.nominal or family is None:
            return None
        return self.peak_bf16_flops if family == "bf16" else self.peak_fp8_flops

    def sbatch_args(self) -> list[str]:
        """The sbatch flags for this cluster (--segment sized to one NVLink domain)."""
        return self.slurm.sbatch_args(self.nodes_per_domain)


# TOML key -> expected type. Top-level scalars; the tables are checked separately.
_SCALARS: dict[str, type] = {
    "description": str,
    "source": str,
    "nominal": bool,
    "gpus_per_node": int,
    "cpu_arch": str,
    "domain_size": int,
    "nvlink_gbps_per_gpu": float,
    "nic_gbps_per_gpu": float,
    "latency_nvlink_us": float,
    "latency_network_us": float,
    "eta_nvlink": float,
    "eta_network": float,
    "peak_bf16_tflops": float,
    "peak_fp8_tflops": float,
    "gpu_memory_gib": float,
    "hbm_tbps": float,
}
_TABLES = ("env", "env_source", "slurm", "container")
_OPTIONAL: dict[str, type] = {"gpu": str}  # keys a preset may leave out
_SLURM: dict[str, type] = {
    "exclusive": bool,
    "gpus_per_node": int,
    "ntasks_per_node": int,
    "segment": bool,
    "signal": str,
}


def list_presets() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load(name_or_path: str | os.PathLike[str]) -> Cluster:
    """The validated ``Cluster`` for a preset name or a path to a site's .toml file."""
    text = os.fspath(name_or_path)
    if text.endswith(".toml") or os.sep in text or "/" in text:
        path = Path(text)
        if not path.is_file():
            raise TopologyError(f"cluster file {text!r} does not exist")
    else:
        path = PRESET_DIR / f"{text}.toml"
        if not path.is_file():
            raise TopologyError(
                f"unknown cluster preset {text!r}; valid presets: {', '.join(list_presets())}"
            )
    return _build(path.stem, read_toml(path, TopologyError), where=str(path))


def _check_keys(
    data: Mapping[str, Any],
    valid: Mapping[str, type] | tuple,
    where: str,
    optional: Mapping[str, type] | tuple = (),
) -> None:
    """Unknown and missing keys, each reported with the valid ones."""
    names = sorted([*valid, *optional])
    for key in data:
        if key not in valid and key not in optional:
            raise TopologyError(f"{where}: unknown key {key!r}; valid keys: {', '.join(names)}")
    for key in valid:
        if key not in data:
            raise TopologyError(f"{where}: missing key {key!r}; required keys: {', '.join(names)}")


def _check_type(key: str, value: Any, want: type, where: str) -> Any:
    """The value, as ``want`` (an int is accepted for a float); else a TopologyError."""
    ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise TopologyError(f"{where}: key {key!r} must be {want.__name__}, got {value!r}")
    return value


def check_number(
    value: Any, name: str, where: str, lo: float = 0.0, hi: float = math.inf, lo_open: bool = True
) -> Any:
    """``value`` when it is a finite number (not a bool) above ``lo`` (or equal to it unless
    ``lo_open``) and at most ``hi``; else a TopologyError "<where>: <name> must be ...". Every
    number a topology file holds passes here: a NaN or inf compares false either way and would
    slip past a plain bound."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TopologyError(f"{where}: {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise TopologyError(f"{where}: {name} must be finite, got {value!r}")
    if (value <= lo if lo_open else value < lo) or value > hi:
        if hi < math.inf:
            wanted = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        elif lo == 0 and lo_open:
            wanted = "a positive number"
        else:
            wanted = f"a number {'>' if lo_open else '>='} {lo:g}"
        raise TopologyError(f"{where}: {name} must be {wanted}, got {value!r}")
    return value


def _str_table(data: Any, key: str, where: str) -> dict[str, str]:
    """A TOML table whose values are all strings."""
    if not isinstance(data, dict):
        raise TopologyError(f"{where}: [{key}] must be a table")
    for k, v in data.items():
        if not isinstance(v, str):
            raise TopologyError(f"{where}: {key}.{k} must be a string, got {v!r}")
    return dict(data)


def _build(name: str, data: Mapping[str, Any], where: str) -> Cluster:
    """Check a parsed file and turn it into a Cluster."""
    _check_keys(data, {**_SCALARS, **dict.fromkeys(_TABLES, dict)}, where, _OPTIONAL)
    vals = {k: _check_type(k, data[k], t, where) for k, t in _SCALARS.items()}
    gpu = _check_gpu(_check_type("gpu", data.get("gpu", ""), str, where), where)
    env = _str_table(data["env"], "env", where)
    env_source = _str_table(data["env_source"], "env_source", where)
    container = _str_table(data["container"], "container", where)
    if not isinstance(data["slurm"], dict):
        raise TopologyError(f"{where}: [slurm] must be a table")
    _check_keys(data["slurm"], _SLURM, f"{where} [slurm]")
    slurm = SlurmOptions(
        **{k: _check_type(f"slurm.{k}", data["slurm"][k], t, where) for k, t in _SLURM.items()}
    )
    _check_values(vals, env, env_source, container, slurm, where)
    return Cluster(
        name=name,
        description=vals["description"],
        source=vals["source"],
        nominal=vals["nominal"],
        gpus_per_node=vals["gpus_per_node"],
        cpu_arch=vals["cpu_arch"],
        domain_size=vals["domain_size"],
        nvlink_gbps_per_gpu=vals["nvlink_gbps_per_gpu"],
        nic_gbps_per_gpu=vals["nic_gbps_per_gpu"],
        latency_nvlink_us=vals["latency_nvlink_us"],
        latency_network_us=vals["latency_network_us"],
        eta_nvlink=vals["eta_nvlink"],
        eta_network=vals["eta_network"],
        peak_bf16_flops=vals["peak_bf16_tflops"] * 1e12,
        peak_fp8_flops=vals["peak_fp8_tflops"] * 1e12,
        gpu_memory_gib=vals["gpu_memory_gib"],
        hbm_bytes_per_s=vals["hbm_tbps"] * 1e12,
        env=types.MappingProxyType(env),
        env_source=types.MappingProxyType(env_source),
        slurm=slurm,
        container_image=types.MappingProxyType(container),
        gpu=gpu,
    )


def _check_gpu(gpu: str, where: str) -> str:
    """A ``gpu`` key must name a shipped XLA:GPU target config (``topology.targets``)."""
    from topology.targets import list_targets  # it imports this module

    if gpu and gpu not in list_targets():
        raise TopologyError(
            f"{where}: gpu {gpu!r} has no XLA:GPU target config; valid: {', '.join(list_targets())}"
        )
    return gpu


def _check_values(
    vals: dict, env: dict, env_source: dict, container: dict, slurm: SlurmOptions, where: str
) -> None:
    """Cross-field rules: ranges, architectures, env provenance, Slurm consistency."""
    for key in (
        "gpus_per_node",
        "domain_size",
        "nvlink_gbps_per_gpu",
        "nic_gbps_per_gpu",
        "peak_bf16_tflops",
        "peak_fp8_tflops",
        "gpu_memory_gib",
        "hbm_tbps",
    ):
        check_number(vals[key], f"key {key!r}", where)
    for key in ("latency_nvlink_us", "latency_network_us"):
        check_number(vals[key], f"key {key!r}", where, lo_open=False)
    for key in ("eta_nvlink", "eta_network"):
        check_number(vals[key], f"key {key!r}", where, hi=1.0)
    if vals["cpu_arch"] not in CPU_ARCHS:
        raise TopologyError(f"{where}: cpu_arch {vals['cpu_arch']!r} is not one of {', '.join(CPU_ARCHS)}")
    if vals["domain_size"] % vals["gpus_per_node"]:
        raise TopologyError(
            f"{where}: domain_size {vals['domain_size']} is not a multiple of "
            f"gpus_per_node {vals['gpus_per_node']}"
        )
    for key in sorted(set(env) ^ set(env_source)):
        side = "[env_source]" if key in env else "[env]"
        raise TopologyError(f"{where}: env variable {key!r} has no entry in {side}")
    for arch in container:
        if arch not in CPU_ARCHS:
            raise TopologyError(f"{where}: container key {arch!r} is not one of {', '.join(CPU_ARCHS)}")
    if vals["cpu_arch"] not in container:
        raise TopologyError(f"{where}: [container] has no image for cpu_arch {vals['cpu_arch']!r}")
    check_number(slurm.ntasks_per_node, "slurm.ntasks_per_node", where)
    if slurm.gpus_per_node != vals["gpus_per_node"]:
        raise TopologyError(
            f"{where}: slurm.gpus_per_node {slurm.gpus_per_node} differs from "
            f"gpus_per_node {vals['gpus_per_node']}"
        )
