"""XLA:GPU target configs: the GPU a cluster preset names, described for a compiler that has no
such GPU in front of it.

Each ``topology/targets/<gpu>.txtpb`` is a ``stream_executor.GpuTargetConfigProto`` in text
form (SM count, shared memory, memory size and bandwidth, compute capability, cuDNN version),
with a comment naming its source. A cluster preset names its GPU with the key ``gpu``
(``topology.presets``); ``python -m moe_train.planner.compile`` hands the file's text to
``jax.experimental.topologies.get_topology_desc(..., "cuda", target_config=...)``.

``load(name)`` reads one and the few facts the kit itself needs (memory, compute capability,
cuDNN version); unknown names raise ``TopologyError`` naming the shipped ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from topology.presets import TopologyError

TARGET_DIR = Path(__file__).resolve().parent / "targets"


@dataclass(frozen=True)
class Target:
    """One GPU's target config and the facts read from it."""

    name: str  # file stem, as a preset's ``gpu`` names it
    text: str  # the whole text proto, as XLA reads it
    description: str  # device_description_str, e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int  # gpu_device_info.device_memory_size
    cores: int  # gpu_device_info.core_count (SMs)
    compute_capability: tuple[int, int]  # (major, minor)
    cudnn: tuple[int, int]  # dnn_version_info (major, minor)

    @property
    def sm(self) -> str:
        """The architecture as nvcc names it: sm_90, sm_100."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def cudnn_version(self) -> int:
        """cuDNN's integer version (9.10 -> 91000), the form cudnnGetVersion returns."""
        return self.cudnn[0] * 10000 + self.cudnn[1] * 100


def list_targets() -> list[str]:
    """Names of the shipped target configs, sorted."""
    return sorted(p.stem for p in TARGET_DIR.glob("*.txtpb"))


def _field(text: str, block: str | None, key: str, where: str) -> str:
    """The value of ``key`` (inside ``block { ... }`` when given) in a text proto."""
    body = text
    if block is not None:
        m = re.search(rf"^\s*{block}\s*{{(.*?)}}", text, re.S | re.M)
        if m is None:
            raise TopologyError(f"{where}: no {block} {{ ... }} block")
        body = m.group(1)
    m = re.search(rf"^\s*{key}\s*:\s*(\"[^\"]*\"|\S+)", body, re.M)
    if m is None:
        raise TopologyError(f"{where}: missing {f'{block}.' if block else ''}{key}")
    return m.group(1).strip('"')


def load(name: str) -> Target:
    """The target config named ``name`` (``topology/targets/<name>.txtpb``)."""
    path = TARGET_DIR / f"{name}.txtpb"
    if not path.is_file():
        raise TopologyError(f"no XLA:GPU target config {name!r}; valid targets: {', '.join(list_targets())}")
    text, where = path.read_text(), str(path)
    if _field(text, None, "platform_name", where) != "CUDA":
        raise TopologyError(f'{where}: platform_name must be "CUDA"')

    def major_minor(section: str) -> tuple[int, int]:
        return int(_field(text, section, "major", where)), int(_field(text, section, "minor", where))

    cc, dnn = major_minor("cuda_compute_capability"), major_minor("dnn_version_info")
    return Target(
        name=name,
        text=text,
        description=_field(text, None, "device_description_str", where),
        memory_bytes=int(_field(text, None, "device_memory_size", where)),
        cores=int(_field(text, None, "core_count", where)),
        compute_capability=cc,
        cudnn=dnn,
    )
