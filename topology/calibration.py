"""Calibration files: measured all-to-all link numbers that replace a preset's.

``python -m topology probe`` times all-to-alls of growing size on the devices it runs on and
fits the time of one collective as a line in the bytes each device sends:

    t(V) = alpha + V / rate

``alpha`` is the fixed latency and ``rate`` the achieved bandwidth per device. When every
probed device is in one NVLink domain the fit describes NVLink; when the devices span several
domains the network bytes dominate and the fit describes the network (the NVLink numbers of
the preset are kept). The file is TOML:

    [calibration]
    preset = "h100-dgx"             # the preset it was measured against
    link = "nvlink"                 # nvlink | network
    latency_us = 21.5               # fitted alpha
    gbps_per_gpu = 310.2            # fitted rate, GB/s (1e9 bytes/s), efficiency included
    [[calibration.samples]]         # the raw medians the fit came from
    bytes_per_device = 1048576
    seconds = 0.00041

``apply(cluster, path)`` returns the preset with the link's bandwidth, latency and efficiency
replaced (efficiency 1.0: the measured rate is already what an all-to-all reaches), so the
cost model and ``topology plan --calibration FILE`` use measured numbers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moe_train.base.tomlfile import read_toml
from topology.presets import Cluster, TopologyError, check_number

LINKS = ("nvlink", "network")


@dataclass(frozen=True)
class Sample:
    """One probed message size."""

    bytes_per_device: int  # bytes each device sends to the others in one all-to-all
    seconds: float  # median time of one all-to-all of that size


@dataclass(frozen=True)
class Fit:
    """A straight line through the samples: t = latency_s + bytes / rate_bytes_per_s."""

    latency_s: float  # intercept, clamped at >= 0
    rate_bytes_per_s: float  # 1 / slope


def fit(samples: Sequence[Sample]) -> Fit:
    """Least-squares line through (bytes, seconds); needs two or more distinct sizes."""
    xs = [float(s.bytes_per_device) for s in samples]
    ys = [float(s.seconds) for s in samples]
    if len(set(xs)) < 2:
        raise ValueError("a calibration fit needs samples of at least two message sizes")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        # time did not grow with size (noise dominates): the largest message bounds the rate
        big = max(samples, key=lambda s: s.bytes_per_device)
        return Fit(latency_s=min(ys), rate_bytes_per_s=big.bytes_per_device / big.seconds)
    return Fit(latency_s=max(0.0, my - slope * mx), rate_bytes_per_s=1.0 / slope)


def write(
    path: str | os.PathLike[str],
    preset: str,
    link: str,
    result: Fit,
    samples: Sequence[Sample],
    device_kind: str,
    devices: int,
) -> Path:
    """Write a calibration file (TOML) and return its path."""
    if link not in LINKS:
        raise ValueError(f"link must be one of {LINKS}, got {link!r}")
    lines = [
        "# Written by `python -m topology probe`: measured all-to-all numbers.",
        "[calibration]",
        f'preset = "{preset}"',
        f'link = "{link}"',
        f'device_kind = "{device_kind}"',
        f"devices = {devices}",
        f"latency_us = {result.latency_s * 1e6:.4f}",
        f"gbps_per_gpu = {result.rate_bytes_per_s / 1e9:.6f}",
    ]
    for s in samples:
        lines += [
            "",
            "[[calibration.samples]]",
            f"bytes_per_device = {s.bytes_per_device}",
            f"seconds = {s.seconds:.9f}",
        ]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def read(path: str | os.PathLike[str]) -> dict:
    """The ``[calibration]`` table of a file, checked; TopologyError names what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise TopologyError(f"calibration file {str(p)!r} does not exist")
    table = read_toml(p, TopologyError).get("calibration")
    if not isinstance(table, dict):
        raise TopologyError(f"{p}: no [calibration] table (write one with `python -m topology probe`)")
    if table.get("link") not in LINKS:
        raise TopologyError(f"{p}: calibration.link must be one of {', '.join(LINKS)}")
    check_number(table.get("latency_us"), "calibration.latency_us", str(p), lo_open=False)
    check_number(table.get("gbps_per_gpu"), "calibration.gbps_per_gpu", str(p))
    samples = table.get("samples", [])
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise TopologyError(f"{p}: calibration.samples must be an array of tables")
    for i, s in enumerate(samples):
        check_number(s.get("bytes_per_device"), f"calibration.samples[{i}].bytes_per_device", str(p))
        check_number(s.get("seconds"), f"calibration.samples[{i}].seconds", str(p), lo_open=False)
    return table


def apply(cluster: Cluster, path: str | os.PathLike[str]) -> Cluster:
    """``cluster`` with the calibrated link's numbers replaced by the measured ones."""
    table = read(path)
    if table["link"] == "nvlink":
        changes = dict(
            nvlink_gbps_per_gpu=float(table["gbps_per_gpu"]),
            latency_nvlink_us=float(table["latency_us"]),
            eta_nvlink=1.0,
        )
    else:
        changes = dict(
            nic_gbps_per_gpu=float(table["gbps_per_gpu"]),
            latency_network_us=float(table["latency_us"]),
            eta_network=1.0,
        )
    return dataclasses.replace(cluster, **changes)
