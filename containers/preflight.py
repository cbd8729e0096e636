"""Preflight for one node, run inside the container before training: is this node usable?

    python3 -m containers.preflight [--preset NAME] [--expect-gpus N] [--json]
    python3 containers/preflight.py ...        (the same, from any directory)

Run it as one task per node (``srun --ntasks-per-node=1 ...``). Checks, each PASS, FAIL or SKIP
with a one-line detail:

- ``jax``: JAX imports, its backend is gpu, and it sees the expected number of local GPUs
  (``--expect-gpus``, else ``SLURM_GPUS_ON_NODE``/``SLURM_GPUS_PER_NODE``, else the preset's
  ``gpus_per_node``, else NVML's device count);
- ``transformer_engine``: ``transformer_engine.jax`` imports; its version;
- ``nccl``: ``ncclGetVersion`` from libnccl.so.2 (SKIP when no library is found); FAIL below
  2.25.2 on a preset whose NVLink domain spans nodes (multi-node NVLink needs it);
- ``imex``: an IMEX channel in /dev/nvidia-caps-imex-channels; required on GB200 presets
  (aarch64 or multi-node NVLink domain), else SKIP (PASS if one is there anyway);
- ``nvml``: NVML initialises; driver version and device count;
- ``xla_flags``: the preset's XLA_FLAGS are all known to this container's XLA (XLA aborts
  every rank on an unknown flag); SKIP without a preset that sets them;
- ``fabric``: NVML fabric state per GPU (clique, cluster UUID); informational, except that on
  a multi-node NVLink preset a GPU whose fabric registration is not COMPLETED is a FAIL.

Prints one aligned table (or JSON with ``--json``) and ``preflight: PASS`` or
``preflight: FAIL (n checks)``. Exit 0 when nothing failed, 1 otherwise, 2 on bad arguments.
Each check is a small function of injectable inputs (tests/test_containers.py).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib
import json
import os
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
IMEX_DIR = "/dev/nvidia-caps-imex-channels"
MNNVL_MIN_NCCL = (2, 25, 2)  # multi-node NVLink (hardware-and-topology.md)
FABRIC_STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
Importer = Callable[[str], Any]


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str


def _gpu_count(text: str) -> int | None:
    """GPUs in a Slurm GPU count: "8", "gpu:8", "h100:4" or "gpu:h100:4,gpu:a100:2" (sum)."""
    total = 0
    for part in filter(None, text.split(",")):
        tail = part.rsplit(":", 1)[-1].split("(", 1)[0]
        if not tail.isdigit():
            return None
        total += int(tail)
    return total or None


def expected_gpus(
    cli: int | None, env: Mapping[str, str], preset_gpus: int | None, nvml_count: int | None
) -> tuple[int | None, str]:
    """(expected local GPUs, where that number came from); None when nothing says."""
    if cli is not None:
        return cli, "--expect-gpus"
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        n = _gpu_count(env.get(var, ""))
        if n:
            return n, var
    if preset_gpus:
        return preset_gpus, "preset gpus_per_node"
    if nvml_count:
        return nvml_count, "NVML device count"
    return None, "no expectation"


def check_jax(expected: int | None, source: str, import_module: Importer = importlib.import_module) -> Check:
    """JAX imports, runs on the gpu backend, and sees ``expected`` local devices."""
    try:
        jax = import_module("jax")
        backend = jax.default_backend()
        devices = jax.local_devices()
    except Exception as e:  # an import or backend start-up failure is the finding
        return Check("jax", FAIL, f"jax failed: {type(e).__name__}: {e}")
    version = getattr(jax, "__version__", "?")
    if backend != "gpu":
        return Check(
            "jax",
            FAIL,
            f"backend is {backend}, expected gpu (jax {version}, "
            f"{len(devices)} {backend} devices; no CUDA plugin or GPU?)",
        )
    n = len(devices)
    kind = getattr(devices[0], "device_kind", "?") if devices else "?"
    if expected is not None and n != expected:
        return Check("jax", FAIL, f"{n} local GPUs ({kind}), expected {expected} ({source})")
    want = f", expected {expected} ({source})" if expected is not None else ""
    return Check("jax", PASS, f"jax {version}, {n} x {kind}{want}")


def check_transformer_engine(import_module: Importer = importlib.import_module) -> Check:
    """``transformer_engine.jax`` imports; report its version."""
    try:
        import_module("transformer_engine.jax")
    except ModuleNotFoundError as e:
        if (e.name or "").startswith("transformer_engine"):
            return Check(
                "transformer_engine",
                FAIL,
                "not installed (no transformer_engine module; use the NVIDIA JAX image)",
            )
        return Check("transformer_engine", FAIL, f"import failed: {e}")
    except Exception as e:
        return Check("transformer_engine", FAIL, f"import failed: {type(e).__name__}: {e}")
    version = getattr(import_module("transformer_engine"), "__version__", None)
    if version is None:
        try:
            from importlib import metadata

            version = metadata.version("transformer_engine")
        except Exception:
            version = "version unknown"
    return Check("transformer_engine", PASS, f"transformer_engine.jax {version}")


def decode_nccl(code: int) -> tuple[int, int, int]:
    """NCCL's version code: X*10000+Y*100+Z since 2.9, X*1000+Y*100+Z before."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def nccl_candidates() -> list[str]:
    """Where libnccl.so.2 may be: the loader's search path, then pip's nvidia-nccl wheels."""
    found = ["libnccl.so.2"]
    for entry in sys.path:
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so.2")))
    return found


def nccl_version(
    candidates: list[str], load: Callable[[str], Any] = ctypes.CDLL
) -> tuple[tuple[int, int, int] | None, str]:
    """(version, library it came from) or (None, why not)."""
    errors = []
    for name in candidates:
        try:
            lib = load(name)
        except OSError as e:
            errors.append(str(e))
            continue
        code = ctypes.c_int(0)
        rc = lib.ncclGetVersion(ctypes.byref(code))
        if rc != 0:
            return None, f"{name}: ncclGetVersion returned {rc}"
        return decode_nccl(code.value), name
    return None, "libnccl.so.2 not found (" + "; ".join(errors)[:200] + ")"


def check_nccl(found: tuple[tuple[int, int, int] | None, str], need_mnnvl: bool) -> Check:
    """NCCL's version; too old for multi-node NVLink is a FAIL where the preset needs it."""
    version, where = found
    if version is None:
        return Check("nccl", SKIP, where)
    text = ".".join(map(str, version))
    if need_mnnvl and version < MNNVL_MIN_NCCL:
        need = ".".join(map(str, MNNVL_MIN_NCCL))
        return Check("nccl", FAIL, f"NCCL {text} ({where}); multi-node NVLink needs >= {need}")
    return Check("nccl", PASS, f"NCCL {text} ({where})")


def check_imex(required: bool, why: str, channel_dir: str = IMEX_DIR) -> Check:
    """An IMEX channel device exists; FAIL only where the preset requires one."""
    try:
        channels = sorted(p.name for p in Path(channel_dir).iterdir() if p.name.startswith("channel"))
    except OSError:
        channels = []
    if channels:
        return Check("imex", PASS, f"{len(channels)} channel(s) in {channel_dir}: {', '.join(channels[:4])}")
    if required:
        return Check(
            "imex",
            FAIL,
            f"no IMEX channel in {channel_dir} ({why}); the job needs "
            "one: Slurm SwitchType=switch/nvidia_imex, nvidia-imex running",
        )
    return Check("imex", SKIP, f"no IMEX channel ({why})")


def probe_nvml(import_module: Importer = importlib.import_module) -> dict[str, Any]:
    """NVML facts: {"error": why} or {"driver", "count", "fabric": [per-GPU dict or str]}."""
    try:
        nvml = import_module("pynvml")
    except ImportError as e:
        return {"error": f"nvidia-ml-py not installed ({e})"}
    try:
        nvml.nvmlInit()
    except Exception as e:
        return {
            "error": f"NVML unavailable: {e} (no NVIDIA driver, or the container was "
            "started without GPU access)"
        }
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        count = nvml.nvmlDeviceGetCount()
        fabric = [_fabric_info(nvml, i) for i in range(count)]
    except Exception as e:
        return {"error": f"NVML query failed: {type(e).__name__}: {e}"}
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    return {"driver": driver, "count": count, "fabric": fabric}


def _fabric_info(nvml: Any, index: int) -> dict[str, Any] | str:
    """One GPU's fabric registration, or why it could not be read."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        info = nvml.c_nvmlGpuFabricInfoV_t()
        nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return {"state": int(info.state), "clique": int(info.cliqueId), "cluster": bytes(info.clusterUuid).hex()}


def check_nvml(nvml: Mapping[str, Any]) -> Check:
    """NVML works: driver version and device count."""
    if "error" in nvml:
        return Check("nvml", FAIL, nvml["error"])
    return Check("nvml", PASS, f"driver {nvml['driver']}, {nvml['count']} GPUs")


def check_fabric(nvml: Mapping[str, Any], required: bool) -> Check:
    """Per-GPU NVLink fabric state; FAIL only when ``required`` and not all COMPLETED."""
    if "error" in nvml:
        return Check("fabric", SKIP, "NVML unavailable")
    infos = nvml["fabric"]
    if not infos:
        return Check("fabric", SKIP, "no GPUs")
    states = [i["state"] if isinstance(i, dict) else None for i in infos]
    if all(s in (None, 0) for s in states):
        why = "not supported on these GPUs (no multi-node NVLink)"
        return Check("fabric", FAIL if required else SKIP, why)
    bad = [
        f"GPU{k} {FABRIC_STATES.get(s, s) if s is not None else infos[k]}"
        for k, s in enumerate(states)
        if s != 3
    ]
    domains = sorted({(i["cluster"], i["clique"]) for i in infos if isinstance(i, dict) and i["state"] == 3})
    where = "; ".join(f"cluster {c[:8]}.. clique {q}" for c, q in domains) or "none"
    if bad:
        return Check(
            "fabric", FAIL if required else PASS, f"not COMPLETED: {', '.join(bad)}; domains: {where}"
        )
    return Check("fabric", PASS, f"{len(infos)}/{len(infos)} COMPLETED; {where}")


def load_preset(name: str) -> Any:
    """The topology preset (a name or a .toml path); the repo root is importable as fallback."""
    try:
        from topology import presets  # the installed kit; else this checkout (below)
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from topology import presets  # this checkout's, where the kit is not installed
    return presets.load(name)


def check_xla_flags(preset: Any, unknown: Callable[[str], list[str]] | None = None) -> Check:
    """Every XLA flag the preset sets is known to the XLA in this container."""
    flags = preset.env.get("XLA_FLAGS", "") if preset else ""
    if not flags:
        return Check("xla_flags", SKIP, "no preset XLA_FLAGS to check")
    if unknown is None:
        from topology.xla_flags import unknown_flags as unknown  # the parameter's default
    try:
        bad = unknown(flags)
    except Exception as err:  # a broken jax install is the jax check's to report
        return Check("xla_flags", FAIL, f"could not check: {err}")
    if bad:
        return Check("xla_flags", FAIL, f"unknown to this XLA: {' '.join(bad)} (preset {preset.name})")
    return Check("xla_flags", PASS, f"{len(flags.split())} flags of preset {preset.name} accepted")


def run_checks(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[list[Check], dict]:
    """Every check in report order, plus the context for the JSON output."""
    preset = load_preset(args.preset) if args.preset else None
    multi_node_domain = bool(preset and preset.nodes_per_domain > 1)
    need_imex = bool(preset and (preset.cpu_arch == "aarch64" or multi_node_domain))
    why = (
        f"preset {preset.name}: {'required' if need_imex else 'NVLink domain is one node'}"
        if preset
        else "no --preset; pass one to require it on GB200"
    )
    nvml = probe_nvml()
    expected, source = expected_gpus(
        args.expect_gpus, env, preset.gpus_per_node if preset else None, nvml.get("count")
    )
    checks = [
        check_jax(expected, source),
        check_transformer_engine(),
        check_nccl(nccl_version(nccl_candidates()), multi_node_domain),
        check_imex(need_imex, why),
        check_xla_flags(preset),
        check_nvml(nvml),
        check_fabric(nvml, need_imex),
    ]
    context = {
        "host": platform.node(),
        "arch": platform.machine(),
        "preset": preset.name if preset else None,
        "expected_gpus": expected,
        "expected_from": source,
    }
    return checks, context


def summary(checks: list[Check]) -> str:
    """The final line: ``preflight: PASS`` or ``preflight: FAIL (n checks)``."""
    failed = sum(c.status == FAIL for c in checks)
    return "preflight: PASS" if not failed else f"preflight: FAIL ({failed} checks)"


def table(checks: list[Check]) -> str:
    """The checks as one aligned table."""
    width = max(len("check"), *(len(c.name) for c in checks))
    rows = [f"{'check':<{width}}  status  detail"]
    rows += [f"{c.name:<{width}}  {c.status:<6}  {c.detail}" for c in checks]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the checks, print the report, return the exit code."""
    p = argparse.ArgumentParser(prog="preflight", description=(__doc__ or "").partition("\n")[0])
    p.add_argument(
        "--expect-gpus",
        type=int,
        metavar="N",
        help="local GPUs JAX must see (default: Slurm's count, preset, or NVML's)",
    )
    p.add_argument("--preset", metavar="NAME", help="cluster preset (topology/presets) or .toml")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    # Checking must not grab most of each GPU's memory, as JAX does by default.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        checks, context = run_checks(args, os.environ)
    except ValueError as e:  # TopologyError: unknown preset or bad site file
        print(f"preflight: {e}", file=sys.stderr)
        return 2
    line = summary(checks)
    failed = sum(c.status == FAIL for c in checks)
    if args.json:
        print(
            json.dumps(
                {
                    "result": FAIL if failed else PASS,
                    "failed": failed,
                    "summary": line,
                    **context,
                    "checks": [asdict(c) for c in checks],
                },
                indent=1,
            )
        )
    else:
        print(table(checks))
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
