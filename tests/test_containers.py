"""containers/: the preflight (run here on CPU and check by check), the build and import
scripts (with fake docker/enroot on a bare PATH), the enroot name conversion, the pinned base
image, and the pip pins that keep the base image's GPU stack."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
from helpers import search

from containers import images, pins, preflight
from containers.preflight import FAIL, PASS, SKIP
from topology import presets

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS = ROOT / "containers"
BASH = shutil.which("bash") or "/bin/bash"  # the scripts' interpreter (absolute: fake tools' #!)
CHECKS = {"jax", "transformer_engine", "nccl", "imex", "xla_flags", "nvml", "fabric"}


def _env(**extra: str) -> dict[str, str]:
    """This environment without Slurm's or JAX's platform choices, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k not in ("JAX_PLATFORMS", "XLA_FLAGS")
    }
    return {**env, **extra}


# ---------------------------------------------------------------- preflight, end to end on CPU


def test_preflight_on_cpu_prints_table_and_fails():
    r = subprocess.run(
        [sys.executable, "-m", "containers.preflight"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == ["check", "status", "detail"]
    rows = {ln.split()[0]: ln for ln in lines[1:-1]}
    assert set(rows) == CHECKS
    status_col = lines[0].index("status")
    assert all(ln[status_col : status_col + 4] in (PASS, FAIL, SKIP) for ln in lines[1:-1])
    assert "FAIL" in rows["jax"] and "backend is cpu, expected gpu" in rows["jax"]
    assert "FAIL" in rows["transformer_engine"] and "not installed" in rows["transformer_engine"]
    assert re.fullmatch(r"preflight: FAIL \(\d+ checks\)", lines[-1])


def test_preflight_json_script_form_with_gb200_preset():
    r = subprocess.run(
        [sys.executable, str(CONTAINERS / "preflight.py"), "--json", "--preset", "gb200-nvl72"],
        cwd="/",
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    checks = {c["name"]: c for c in out["checks"]}
    assert set(checks) == CHECKS
    assert out["result"] == FAIL and out["failed"] == sum(c["status"] == FAIL for c in checks.values())
    assert out["preset"] == "gb200-nvl72" and out["expected_gpus"] == 4
    assert checks["jax"]["status"] == FAIL
    if not os.path.isdir(preflight.IMEX_DIR):  # required on GB200: absent here -> FAIL
        assert checks["imex"]["status"] == FAIL and "IMEX" in checks["imex"]["detail"]


def test_preflight_unknown_preset_exits_2():
    r = subprocess.run(
        [sys.executable, "-m", "containers.preflight", "--preset", "nope"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unknown cluster preset 'nope'" in r.stderr


# ---------------------------------------------------------------- preflight, check by check


def _fake_jax(backend: str, n: int, kind: str = "NVIDIA H100 80GB HBM3"):
    dev = types.SimpleNamespace(device_kind=kind)
    mod = types.SimpleNamespace(
        __version__="0.11.0", default_backend=lambda: backend, local_devices=lambda: [dev] * n
    )
    return lambda name: mod


def test_check_jax_count_mismatch_and_match():
    c = preflight.check_jax(8, "SLURM_GPUS_ON_NODE", _fake_jax("gpu", 4))
    assert c.status == FAIL and "4 local GPUs" in c.detail and "expected 8" in c.detail
    assert "SLURM_GPUS_ON_NODE" in c.detail
    ok = preflight.check_jax(4, "preset gpus_per_node", _fake_jax("gpu", 4))
    assert ok.status == PASS and "4 x NVIDIA H100" in ok.detail
    assert preflight.check_jax(None, "no expectation", _fake_jax("gpu", 2)).status == PASS


def test_check_jax_cpu_backend_and_import_error():
    assert "backend is cpu, expected gpu" in preflight.check_jax(1, "x", _fake_jax("cpu", 8)).detail

    def broken(name):
        raise ImportError("libcuda.so.1: cannot open shared object file")

    c = preflight.check_jax(8, "x", broken)
    assert c.status == FAIL and "libcuda" in c.detail


def test_expected_gpus_precedence():
    f = preflight.expected_gpus
    assert f(2, {"SLURM_GPUS_ON_NODE": "8"}, 4, 8) == (2, "--expect-gpus")
    assert f(None, {"SLURM_GPUS_ON_NODE": "8"}, 4, 2) == (8, "SLURM_GPUS_ON_NODE")
    assert f(None, {"SLURM_GPUS_PER_NODE": "h100:4"}, 8, 2) == (4, "SLURM_GPUS_PER_NODE")
    assert f(None, {"SLURM_GPUS_PER_NODE": "gpu:h100:4,gpu:a100:2"}, None, None)[0] == 6
    assert f(None, {}, 4, 8) == (4, "preset gpus_per_node")
    assert f(None, {}, None, 8) == (8, "NVML device count")
    assert f(None, {"SLURM_GPUS_ON_NODE": "junk"}, None, None) == (None, "no expectation")


def test_check_transformer_engine_missing_and_present():
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name="transformer_engine")

    c = preflight.check_transformer_engine(missing)
    assert c.status == FAIL and "not installed" in c.detail
    te = types.SimpleNamespace(__version__="2.9.0")
    c = preflight.check_transformer_engine(lambda name: te)
    assert c.status == PASS and "2.9.0" in c.detail


def test_check_imex_present_absent(tmp_path):
    chan = tmp_path / "imex"
    assert preflight.check_imex(True, "gb200", str(chan)).status == FAIL  # no directory
    chan.mkdir()
    assert preflight.check_imex(True, "gb200", str(chan)).status == FAIL  # empty
    assert preflight.check_imex(False, "h100", str(chan)).status == SKIP
    (chan / "channel0").touch()
    c = preflight.check_imex(True, "gb200", str(chan))
    assert c.status == PASS and "channel0" in c.detail
    assert preflight.check_imex(False, "h100", str(chan)).status == PASS


class _NVMLError(Exception):
    pass


def _fake_nvml(count=0, states=(), init_error=None):
    """A pynvml stand-in: real fabric-info structs, filled in by the fake getter."""
    pynvml = pytest.importorskip("pynvml")

    def init():
        if init_error:
            raise _NVMLError(init_error)

    def fabric(handle, ref):
        info = ref._obj
        info.state, info.cliqueId = states[handle], 7
        info.clusterUuid[:] = list(range(16))

    return types.SimpleNamespace(
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"580.65.06",
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        c_nvmlGpuFabricInfoV_t=pynvml.c_nvmlGpuFabricInfoV_t,
        nvmlDeviceGetGpuFabricInfoV=fabric,
    )


def test_nvml_unavailable_and_not_installed():
    info = preflight.probe_nvml(lambda n: _fake_nvml(init_error="Driver Not Loaded"))
    c = preflight.check_nvml(info)
    assert c.status == FAIL and "NVML unavailable" in c.detail and "Driver Not Loaded" in c.detail
    assert preflight.check_fabric(info, required=True).status == SKIP

    def missing(name):
        raise ImportError("No module named 'pynvml'")

    c = preflight.check_nvml(preflight.probe_nvml(missing))
    assert c.status == FAIL and "not installed" in c.detail


def test_nvml_and_fabric_states():
    info = preflight.probe_nvml(lambda n: _fake_nvml(4, (3, 3, 3, 3)))
    assert info["count"] == 4 and info["driver"] == "580.65.06"
    assert preflight.check_nvml(info).status == PASS
    c = preflight.check_fabric(info, required=True)
    assert c.status == PASS and "4/4 COMPLETED" in c.detail and "clique 7" in c.detail
    part = preflight.probe_nvml(lambda n: _fake_nvml(2, (3, 2)))
    assert preflight.check_fabric(part, required=True).status == FAIL
    c = preflight.check_fabric(part, required=False)  # informational off GB200
    assert c.status == PASS and "GPU1 IN_PROGRESS" in c.detail
    hopper = preflight.probe_nvml(lambda n: _fake_nvml(8, (0,) * 8))
    assert preflight.check_fabric(hopper, required=False).status == SKIP


def test_nccl_version_decoding_and_checks():
    assert preflight.decode_nccl(23004) == (2, 30, 4)
    assert preflight.decode_nccl(2708) == (2, 7, 8)

    def loader(code):
        def get_version(ref):
            ref._obj.value = code
            return 0

        return lambda name: types.SimpleNamespace(ncclGetVersion=get_version)

    found = preflight.nccl_version(["libnccl.so.2"], loader(23004))
    assert found == ((2, 30, 4), "libnccl.so.2")
    assert preflight.check_nccl(found, need_mnnvl=True).status == PASS
    old = preflight.nccl_version(["libnccl.so.2"], loader(21903))
    c = preflight.check_nccl(old, need_mnnvl=True)
    assert c.status == FAIL and ">= 2.25.2" in c.detail
    assert preflight.check_nccl(old, need_mnnvl=False).status == PASS

    def absent(name):
        raise OSError(f"{name}: cannot open shared object file")

    c = preflight.check_nccl(preflight.nccl_version(["libnccl.so.2"], absent), True)
    assert c.status == SKIP and "not found" in c.detail


def test_summary_line():
    ok = preflight.Check("a", PASS, "")
    assert preflight.summary([ok, preflight.Check("b", SKIP, "")]) == "preflight: PASS"
    bad = [ok, preflight.Check("b", FAIL, ""), preflight.Check("c", FAIL, "")]
    assert preflight.summary(bad) == "preflight: FAIL (2 checks)"


# ---------------------------------------------------------------- build.sh / import.sh


def _bare_path(tmp_path: Path, *tools: str) -> Path:
    """A bin dir holding symlinks to just ``tools`` (and nothing else on PATH)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in ("bash", "git", "uname", "mkdir", "rm", *tools):
        target = shutil.which(tool)
        assert target, tool
        (bindir / tool).symlink_to(target)
    return bindir


def _fake_tool(bindir: Path, name: str, info_rc: int = 0) -> None:
    """A fake docker/podman/enroot that logs its arguments to $CTR_LOG."""
    script = bindir / name
    script.write_text(
        f'#!{BASH}\nprintf \'{name} %s\\n\' "$*" >> "$CTR_LOG"\n'
        f'[[ "$1" == info ]] && exit {info_rc}\nexit 0\n'
    )
    script.chmod(0o755)


def _run(script: str, args: list[str], bindir: Path, log: Path | None = None):
    env = {"PATH": str(bindir), "HOME": os.environ.get("HOME", "/tmp"), "CTR_LOG": str(log or "/dev/null")}
    return subprocess.run(
        [BASH, str(CONTAINERS / script), *args], env=env, capture_output=True, text=True, timeout=60
    )


def _rev(full: bool = False) -> str:
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", *([] if full else ["--short"]), "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return rev + ("-dirty" if dirty else "")


def test_build_without_container_tool_says_so(tmp_path):
    bindir = _bare_path(tmp_path)
    r = _run("build.sh", ["--out", str(tmp_path / "out")], bindir)
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "neither docker nor podman" in r.stderr
    r = _run("build.sh", ["--tool", "podman"], bindir)
    assert r.returncode == 3 and "podman is not on PATH" in r.stderr
    assert not (tmp_path / "out").exists()


def test_build_with_unreachable_daemon(tmp_path):
    bindir = _bare_path(tmp_path)
    _fake_tool(bindir, "docker", info_rc=1)
    r = _run("build.sh", [], bindir)
    assert r.returncode == 3 and "daemon is unreachable" in r.stderr


def test_build_rejects_bad_arguments(tmp_path):
    bindir = _bare_path(tmp_path)
    r = _run("build.sh", ["--arch", "riscv64"], bindir)
    assert r.returncode == 2 and "got 'riscv64'" in r.stderr
    assert _run("build.sh", ["--tool", "buildah"], bindir).returncode == 2
    assert _run("build.sh", ["--base", "x; touch /tmp/ctr_pwned"], bindir).returncode == 2
    assert _run("build.sh", ["--bogus"], bindir).returncode == 2


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="image tags need a git checkout")
def test_build_then_enroot(tmp_path):
    bindir, log, out = _bare_path(tmp_path), tmp_path / "log", tmp_path / "out dir"
    _fake_tool(bindir, "docker")
    r = _run("build.sh", ["--arch", "aarch64", "--out", str(out)], bindir, log)
    rev = _rev()
    assert r.returncode == 3 and "needs enroot" in r.stderr, r.stderr
    calls = log.read_text().splitlines()
    build = next(c for c in calls if c.startswith("docker build"))
    assert "--platform linux/arm64" in build and f"-f {CONTAINERS}/Dockerfile" in build
    assert f"-t moe-train:{rev} " in build and f"-t moe-train:{rev}-arm64 " in build
    assert f"GIT_COMMIT={_rev(full=True)}" in build and build.endswith(str(ROOT))

    _fake_tool(bindir, "enroot")
    r = _run("build.sh", ["--arch", "arm64", "--out", str(out)], bindir, log)
    assert r.returncode == 0, r.stderr
    sqsh = out / f"moe-train-{rev}-arm64.sqsh"
    assert (
        log.read_text().splitlines()[-1]
        == f"enroot import --arch aarch64 -o {sqsh} dockerd://moe-train:{rev}-arm64"
    )


def test_import_rejects_shell_injection(tmp_path):
    pwned = Path("/tmp/ctr_pwned")
    pwned.unlink(missing_ok=True)
    bindir, log, out = _bare_path(tmp_path), tmp_path / "log", tmp_path / "out"
    _fake_tool(bindir, "enroot")
    for bad in (
        "foo; touch /tmp/ctr_pwned",
        "$(touch /tmp/ctr_pwned)",
        "`touch /tmp/ctr_pwned`",
        "ghcr.io/nvidia/jax:tag extra",
        "ghcr.io/NVIDIA/jax:x",
        "a|b",
        "",
    ):
        r = _run("import.sh", [bad, "--out", str(out)], bindir, log)
        assert r.returncode == 2, bad
    r = _run("import.sh", ["ghcr.io/nvidia/jax@sha256:" + "0" * 64], bindir, log)
    assert r.returncode == 2 and "digest" in r.stderr
    assert not pwned.exists() and not out.exists() and not log.exists()


def test_import_without_enroot_and_with_it(tmp_path):
    bindir, log, out = _bare_path(tmp_path), tmp_path / "log", tmp_path / "out"
    image = "ghcr.io/nvidia/jax:jax-2026-06-27"
    r = _run("import.sh", [image, "--out", str(out)], bindir)
    assert r.returncode == 3 and "enroot is not on PATH" in r.stderr and not out.exists()
    _fake_tool(bindir, "enroot")
    r = _run("import.sh", [image, "--out", str(out), "--arch", "arm64"], bindir, log)
    assert r.returncode == 0, r.stderr
    assert log.read_text().strip() == (
        f"enroot import --arch aarch64 -o "
        f"{out}/ghcr.io+nvidia+jax+jax-2026-06-27.sqsh "
        "docker://ghcr.io#nvidia/jax:jax-2026-06-27"
    )


ENROOT_CASES = {
    "ghcr.io/nvidia/jax:jax-2026-06-27": "docker://ghcr.io#nvidia/jax:jax-2026-06-27",
    "nvcr.io/nvidia/jax:26.01-py3": "docker://nvcr.io#nvidia/jax:26.01-py3",
    "localhost:5000/moe-train:abc": "docker://localhost:5000#moe-train:abc",
    "docker.io/library/ubuntu:24.04": "docker://library/ubuntu:24.04",
    "nvidia/cuda:13.0.0-base-ubuntu24.04": "docker://nvidia/cuda:13.0.0-base-ubuntu24.04",
    "ubuntu": "docker://ubuntu",
    "ghcr.io#nvidia/jax:jax": "docker://ghcr.io#nvidia/jax:jax",
}


def _shell_uri(image: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BASH, "-c", 'source "$1"; enroot_uri "$2"', "_", str(CONTAINERS / "lib.sh"), image],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("image", sorted(ENROOT_CASES))
def test_enroot_name_conversion(image):
    r = _shell_uri(image)
    assert r.returncode == 0 and r.stdout.strip() == ENROOT_CASES[image]
    assert images.enroot_uri(image) == ENROOT_CASES[image]


@pytest.mark.parametrize(
    "bad", ["foo; rm -rf /", "a b", "x:tag$(id)", "Upper/Case:x", "a#b#c", "ghcr.io/x@sha256:00"]
)
def test_enroot_conversion_rejects_bad_references(bad):
    assert _shell_uri(bad).returncode != 0
    assert not images.validate_image(bad)
    with pytest.raises(ValueError):
        images.pyxis_image(bad)


def test_shell_and_python_share_one_pattern():
    text = (CONTAINERS / "lib.sh").read_text()
    assert search(r"^IMAGE_RE='([^']*)'$", text, re.M).group(1) == images.IMAGE_RE


@pytest.mark.parametrize("script", ["build.sh", "import.sh", "lib.sh"])
def test_shell_scripts_are_strict_and_parse(script):
    path = CONTAINERS / script
    if script != "lib.sh":  # lib.sh is sourced by them
        assert "\nset -euo pipefail\n" in path.read_text()
    assert subprocess.run([BASH, "-n", str(path)]).returncode == 0


# ---------------------------------------------------------------- Dockerfile and presets


def _dockerfile_base() -> str:
    text = (CONTAINERS / "Dockerfile").read_text()
    return search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)


def test_dockerfile_pins_a_dated_base():
    text = (CONTAINERS / "Dockerfile").read_text()
    base = _dockerfile_base()
    repo, tag = base.rsplit(":", 1)
    assert repo == "ghcr.io/nvidia/jax" and tag not in ("latest", "jax")
    assert re.fullmatch(r"jax-20\d\d-\d\d-\d\d", tag), "a dated JAX-Toolbox nightly"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert 'org.opencontainers.image.revision="${GIT_COMMIT}"' in text
    assert re.search(r"^WORKDIR /opt/moe-train$", text, re.M)
    assert "pip install --no-deps -e ." in text and "pins.py verify" in text
    assert not re.search(r"(?i)^(ARG|ENV)\s+\S*(TOKEN|PASSWORD|SECRET)", text, re.M)
    ignore = (CONTAINERS / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignore)


@pytest.mark.parametrize("name", presets.list_presets())
def test_preset_image_is_the_dockerfile_base(name):
    cluster = presets.load(name)
    assert set(cluster.container_image.values()) == {_dockerfile_base()}
    assert images.pyxis_image(cluster.image) == "ghcr.io#" + _dockerfile_base().split("/", 1)[1]


# ---------------------------------------------------------------- pins.py


def test_pins_keep_the_gpu_stack_of_the_base():
    lock = pins.parse_lock(
        "# c\njax==0.10.2\njaxlib==0.10.2\nflax==0.12.8\nnumpy==2.4.6\n"
        "nvidia-ml-py==13.615.71\nnvidia-nccl-cu13==2.28.9\nsubmitit==1.5.4\n"
    )
    base = {
        "jax": "0.11.0.dev20260627+060c1f383",
        "jaxlib": "0.11.0.dev20260627",
        "numpy": "2.3.1",
        "flax": "0.12.0",
        "python-apt": "2.7.7ubuntu4",
        "transformer-engine": "2.9.0",
    }
    lines = pins.constraints(lock, base)
    assert "jax==0.11.0.dev20260627+060c1f383" in lines and "numpy==2.3.1" in lines
    assert "transformer-engine==2.9.0" in lines
    assert "flax==0.12.8" in lines and "submitit==1.5.4" in lines  # the tested versions
    assert "nvidia-ml-py==13.615.71" in lines  # pure Python, not part of the GPU stack
    assert not any(
        x in lines for x in ("jax==0.10.2", "jaxlib==0.10.2", "numpy==2.4.6", "nvidia-nccl-cu13==2.28.9")
    )
    assert not any(x.startswith("python-apt") for x in lines)


def test_pins_kit_requirements_skip_jax():
    with (ROOT / "pyproject.toml").open("rb") as f:
        reqs = pins.kit_requirements(tomllib.load(f), ["cluster"])
    names = {search(r"^[A-Za-z0-9._-]+", r).group(0) for r in reqs}
    assert {"flax", "optax", "orbax-checkpoint", "submitit", "nvidia-ml-py"} <= names
    assert not names & {"jax", "jaxlib", "numpy"}


def test_pins_verify():
    before = {"jax": "0.11.0.dev1", "flax": "0.12.0", "numpy": "2.3.1"}
    after = {
        "jax": "0.11.0.dev1",
        "flax": "0.12.8",
        "numpy": "2.3.1",
        "jaxlib": "0.10.2",
        "submitit": "1.5.4",
    }
    problems, notes = pins.verify(before, after)
    assert problems == ["jaxlib 0.10.2 was installed, but the GPU stack must come from the base image"]
    assert notes == ["flax changed from the base image's 0.12.0 to 0.12.8"]
    problems, _ = pins.verify(before, {**after, "jax": "0.10.2"})
    assert any(p.startswith("jax changed") for p in problems)
    assert pins.verify(before, before) == ([], [])


def test_pins_cli_in_this_environment(tmp_path):
    snap = tmp_path / "snap.json"
    snap.write_text(
        subprocess.run(
            [sys.executable, str(CONTAINERS / "pins.py"), "snapshot"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    r = subprocess.run(
        [sys.executable, str(CONTAINERS / "pins.py"), "verify", "--before", str(snap)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "unchanged" in r.stdout
    assert "jax" in json.loads(snap.read_text())


def test_xla_flags_check_names_unknown_flags():
    preset = presets.load("h100-dgx")
    check = preflight.check_xla_flags(preset, unknown=lambda flags: ["--xla_gone=1"])
    assert (check.status, check.detail) == ("FAIL", "unknown to this XLA: --xla_gone=1 (preset h100-dgx)")


def test_xla_flags_check_passes_known_flags():
    assert preflight.check_xla_flags(presets.load("h100-dgx"), unknown=lambda flags: []).status == "PASS"


def test_xla_flags_check_skips_without_preset():
    assert preflight.check_xla_flags(None).status == "SKIP"
