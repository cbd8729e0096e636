"""The Slurm launcher without Slurm: rendering, golden files, quoting, refusals, --wait logic.

Golden files (slurm/golden/<preset>.sbatch) hold what the launcher renders (the planner's
figures for the same jobs are in the planner snapshot, tests/test_planner_snapshot.py) and change
only on purpose: MOE_TRAIN_UPDATE_GOLDEN=1 pytest tests/test_slurm_render.py (or python -m
slurm.examples --update-golden, make golden) rewrites them.
"""

from __future__ import annotations

import io
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import MIXTRAL_H100

from moe_train.planner.steptime import StepTime
from slurm import examples, follow, plan, render, submit, task
from slurm import site as site_mod
from topology import presets
from topology.placement import allocation

KIT = Path(__file__).resolve().parent.parent
CPU_TINY = ("--preset", "cpu-local", "--model", "tiny", "--nodes", "1")  # the smallest job


@pytest.fixture(autouse=True)
def no_site_file(monkeypatch, tmp_path):
    """Tests never read the user's site file."""
    monkeypatch.delenv(site_mod.SITE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = submit.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def dry(capsys, tmp_path, *args: str) -> tuple[int, str, str]:
    return run_cli(capsys, *args, "--out", str(tmp_path / "run"), "--dry-run")


def script_of(out: str) -> str:
    """The sbatch script part of --dry-run's output."""
    start = out.index("#!/bin/bash")
    return out[start : out.index("\n# training step (srun)")]


def dry_script(capsys, tmp_path, *args: str) -> tuple[str, str]:
    """A ``dry`` run that succeeded: its output and the sbatch script in it."""
    code, out, err = dry(capsys, tmp_path, *args)
    assert code == 0, err
    return out, script_of(out)


def run_script(script: str, tmp_path: Path, srun_exit: int = 0, env: dict | None = None):
    """Run a rendered script with stub srun/scontrol that log their arguments and environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nprintf 'srun %s\\n' \"$*\" >> " + shlex.quote(str(log)) + "\n"
        "printf 'ENV_A=%s\\n' \"${LAUNCH_TEST_A-}\" >> " + shlex.quote(str(log)) + "\n"
        'for a in "$@"; do [ "$a" = true ] && exit 0; done\n'
        f"exit {srun_exit}\n"
    )
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\nprintf 'scontrol %s\\n' \"$*\" >> " + shlex.quote(str(log)) + "\n"
    )
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    path = tmp_path / "job.sh"
    path.write_text(script)
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77", **(env or {})}
    proc = subprocess.run(
        ["bash", str(path)], env=full_env, capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    return proc, (log.read_text() if log.exists() else "")


# --------------------------------------------------------------------------- golden files


@pytest.mark.parametrize("preset", presets.list_presets())
def test_golden_file(preset):
    assert preset in examples.EXAMPLES, f"add an example job for {preset} to slurm/examples.py"
    text = examples.golden_text(preset)
    path = examples.golden_path(preset)
    if os.environ.get(examples.UPDATE_ENV) == "1":
        path.write_text(text)
    assert path.exists(), f"missing {path}; regenerate with {examples.UPDATE_ENV}=1"
    assert text == path.read_text(), (
        f"{preset}'s rendering changed; if on purpose, rerun with {examples.UPDATE_ENV}=1 and review the diff"
    )


def test_golden_nvl72_is_the_documented_job():
    text = examples.golden_path("gb200-nvl72").read_text()
    for line in (
        "#SBATCH --nodes=32",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --segment=16",
        "#SBATCH --exclusive",
        "#SBATCH --signal=USR2@300",
        "#SBATCH --requeue",
        "--container-name=moe-train true",
        "--no-container-mount-home",
        "--kill-on-bad-exit=1",
        "set -euo pipefail",
        "--set parallel.ep=64",
    ):
        assert line in text


# --------------------------------------------------------------------------- quoting


def test_hostile_job_name_is_quoted_and_never_run(capsys, tmp_path):
    marker = tmp_path / "pwned"
    name = f"x; touch {marker}"
    out, script = dry_script(capsys, tmp_path, *CPU_TINY, "--job-name", name)
    assert f"#SBATCH --job-name={shlex.quote(name)}" in script
    assert [ln for ln in script.splitlines() if str(marker) in ln] == [
        f"#SBATCH --job-name={shlex.quote(name)}"
    ]
    proc, calls = run_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "submitit.core._submit" in calls  # the training step ran (stubbed)
    assert not marker.exists()


def test_hostile_set_value_stays_data(capsys, tmp_path):
    marker = tmp_path / "pwned2"
    value = f"data.path=$(touch {marker}); `touch {marker}`"
    out, script = dry_script(capsys, tmp_path, *CPU_TINY, "--set", value)
    assert str(marker) not in script  # trainer arguments travel pickled, never through a shell
    shown = out.strip().splitlines()[-1]
    assert value in shlex.split(shown)  # the printed command quotes it
    run_script(script, tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--job-name", "a\ntouch /tmp/launch_x #"),
        ("--job-name", "tab\there"),
        ("--partition", "p\nq"),
        ("--account", "a b"),
    ],
)
def test_control_characters_and_bad_names_refused(capsys, tmp_path, flag, value):
    code, out, err = dry(capsys, tmp_path, *CPU_TINY, flag, value)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ")


def test_env_exported_with_quoting(capsys, tmp_path):
    hostile = 'it\'s $HOME; `id` "q" && rm -rf /nothing'
    text = (KIT / "topology/presets/cpu-local.toml").read_text()
    text = text.replace("[env]\n", "[env]\nLAUNCH_TEST_A = '''" + hostile + "'''\n", 1)
    text = text.replace("[env_source]\n", '[env_source]\nLAUNCH_TEST_A = "test"\n')
    preset = tmp_path / "site-cpu.toml"
    preset.write_text(text)
    assert presets.load(str(preset)).env["LAUNCH_TEST_A"] == hostile
    out, script = dry_script(capsys, tmp_path, "--preset", str(preset), "--model", "tiny", "--nodes", "1")
    assert f"export LAUNCH_TEST_A={shlex.quote(hostile)}" in script
    proc, calls = run_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"ENV_A={hostile}\n" in calls
    assert f"parallel.cluster={preset}" in out


# --------------------------------------------------------------------------- refusals

# the big presets' own fit (full remat, one-sequence micro-batches) switched off
BARE = ["--set", "train.remat=none", "--set", "train.micro_batch_size=0"]
REFUSALS = [  # (the command line, what its one error line says)
    (
        "--preset nope --model tiny --nodes 1",
        "unknown cluster preset 'nope'; valid presets: b200-hgx, cpu-local",
    ),
    ("--preset cpu-local --model nope --nodes 1", "unknown model preset 'nope'; valid presets:"),
    (
        "--preset cpu-local --model tiny --nodes 1 --set moe.topk=3",
        "unknown key moe.topk; valid keys in [moe]:",
    ),
    ("--preset gb200-nvl72 --model deepseek-v3 --nodes 20 --ep 64", "ep 64 does not divide the 80 GPUs"),
    (
        "--preset h100-dgx --model tiny --nodes 2 --ep 16",
        "ep 16 does not divide the model's 8 experts; valid ep: 1, 2, 4, 8",
    ),
    (
        "--preset gb200-nvl72 --model tiny --nodes 21 --ep 42 "
        "--set moe.num_experts=42 --set train.batch_size=84",
        "EP groups of 42 would straddle NVLink domains",
    ),
    (
        "--preset gb200-nvl72 --model deepseek-v3 --nodes 32 --ep 64 --image /nonexistent/moe.sqsh",
        "image file '/nonexistent/moe.sqsh' does not exist",
    ),
    ("--preset gb200-nvl72 --model deepseek-v3 --nodes 32 --ep 64", "no kit image"),
    ("--preset cpu-local --model tiny --nodes 1 --image x:y", "runs on the host without a container"),
    (
        "--preset cpu-local --model tiny --nodes 1 --set parallel.num_processes=3",
        "--set parallel.num_processes is chosen by the launcher",
    ),
    ("--preset cpu-local --model tiny --nodes 1 --time soon", "time 'soon' is not a Slurm time"),
    (
        "--preset cpu-local --model tiny --nodes 1 --set train.batch_size=6",
        "train.batch_size=6 is not divisible by the job's 8 GPUs",
    ),
    ("--preset cpu-local --model tiny", "--nodes is required (or --smoke)"),
    (
        "--preset h100-dgx --model mixtral-8x7b --nodes 8 --ep 8 --image KIMG "
        "--set train.remat=none --set train.micro_batch_size=0",
        "memory: does not fit: needs",
    ),
    (
        "--preset gb200-nvl72 --model deepseek-v3 --nodes 18 --ep 8 --set train.batch_size=144 --image KIMG",
        "model.hidden=7168 is not divisible by the data-parallel size 9",
    ),
]


def test_a_job_that_does_not_fit_names_the_override(capsys, tmp_path):
    image = tmp_path / "kit.sqsh"
    image.write_bytes(b"")
    code, _, err = run_cli(capsys, *MIXTRAL_H100, "--image", str(image), "--out", str(tmp_path / "r"), *BARE)
    assert code == 2 and "cheapest change that fits" in err and "--ignore-memory" in err


def test_a_dry_run_only_warns_about_memory(capsys, tmp_path):
    code, out, err = dry(capsys, tmp_path, *MIXTRAL_H100, *BARE)
    assert code == 0 and "warning: memory: does not fit" in out + err


def test_the_readme_cluster_example_fits_without_a_warning(capsys, tmp_path):
    code, out, err = dry(capsys, tmp_path, *MIXTRAL_H100)
    assert code == 0 and "memory: fits" in out + err and "warning: memory" not in out + err


def predicted(
    preset: str, nodes: int, model: str, ep: int, sets: tuple[str, ...], compute: str | None = None
) -> StepTime:
    """The planner's predicted step of a job (bf16 compute: there is one)."""
    from moe_train.planner.ep_plan import make_plan

    step = make_plan(preset, nodes, model, ep, overrides=sets, compute=compute).step
    assert step is not None
    return step


def test_overlap_chunks_default_to_the_planners_choice(capsys, tmp_path):
    from moe_train.planner import compute

    # the shipped shares without DeepSeek-V3's own (an empty [model] table): chunks pay off
    text = compute.DEFAULTS.read_text()
    shares = tmp_path / "c.toml"
    shares.write_text(text[: text.index("\n[model.")] + "\n[model]\n")
    sets = ("parallel.weight_gather=step", "train.micro_batch_size=3")  # overlap is left open
    best = predicted("gb200-nvl72", 64, "deepseek-v3", 64, sets, str(shares)).best_chunks
    assert best > 1  # the planner hides part of the exchange on this job
    job = ("--preset", "gb200-nvl72", "--model", "deepseek-v3", "--nodes", "64", "--ep", "64")
    job += ("--compute", str(shares))
    code, out, err = dry(capsys, tmp_path, *job, *(a for s in sets for a in ("--set", s)))
    assert code == 0 and f"overlap: moe.overlap_chunks={best}, the planner's choice" in out + err
    assert f"--set moe.overlap_chunks={best} --set parallel.ep=64" in out


def test_a_users_overlap_chunks_stay(capsys, tmp_path):
    code, out, err = dry(capsys, tmp_path, *MIXTRAL_H100, "--set", "moe.overlap_chunks=2")
    assert code == 0 and "overlap:" not in out + err
    assert out.count("moe.overlap_chunks=") == 1 and "--set moe.overlap_chunks=2" in out


def test_weight_gather_defaults_to_the_faster_mode_that_fits(capsys, tmp_path):
    micro = "train.micro_batch_size=1"  # kept as set: the choice left is the gather mode
    by = predicted("h100-dgx", 8, "mixtral-8x7b", 8, (micro,)).by_gather
    assert by["step"] < 0.99 * by["micro_batch"]  # gathering once per step is predicted faster
    code, out, err = dry(capsys, tmp_path, *MIXTRAL_H100, "--set", micro)
    assert code == 0 and "fsdp: parallel.weight_gather=step, the planner's choice" in out + err
    assert "--set parallel.weight_gather=step " in out


def test_the_memory_line_counts_the_chosen_job(capsys, tmp_path):
    from moe_train.planner import memory
    from moe_train.planner.decide import decide

    req = plan.Request(preset="h100-dgx", model="mixtral-8x7b", nodes=8, ep=8)
    total = memory.check_fits(decide(req).cfg, "h100-dgx", 8).total_bytes / 1024**3
    code, out, err = dry(capsys, tmp_path, *MIXTRAL_H100)
    assert code == 0 and f"({total:.1f} GiB of" in out + err


def test_a_users_weight_gather_stays(capsys, tmp_path):
    code, out, err = dry(capsys, tmp_path, *MIXTRAL_H100, "--set", "parallel.weight_gather=micro_batch")
    assert code == 0 and "fsdp:" not in out + err
    assert out.count("parallel.weight_gather=") == 1


def test_weight_gather_stays_where_the_faster_mode_does_not_fit(capsys, tmp_path):
    from moe_train import config
    from moe_train.planner import memory

    sets = ("train.micro_batch_size=2", "train.remat=full", "parallel.weight_gather=step")
    by = predicted("gb200-nvl72", 32, "deepseek-v3", 32, sets).by_gather
    step_cfg = config.build("deepseek-v3", [*sets, "parallel.ep=32"])
    assert by["step"] < by["micro_batch"]
    assert not memory.check_fits(step_cfg, "gb200-nvl72", 32).fits
    job = "--preset gb200-nvl72 --model deepseek-v3 --nodes 32 --ep 32".split()
    code, out, err = dry(capsys, tmp_path, *job, "--set", sets[0], "--set", sets[1])
    assert code == 0 and "fsdp:" not in out + err
    assert "parallel.weight_gather" not in script_of(out)


def test_no_overlap_choice_without_a_prediction(capsys, tmp_path):
    code, out, err = dry(capsys, tmp_path, *CPU_TINY, "--ep", "8")
    assert code == 0 and "overlap:" not in out + err and "moe.overlap_chunks" not in out
    assert "fsdp:" not in out + err and "weight_gather" not in out


@pytest.mark.parametrize("args,message", REFUSALS, ids=[m[:40] for _, m in REFUSALS])
def test_refusals_exit_2_with_one_line(capsys, monkeypatch, tmp_path, args, message):
    def never(*a, **k):
        raise AssertionError("submitted despite bad input")

    monkeypatch.setattr(submit, "submit_slurm", never)
    monkeypatch.setattr(submit, "submit_local", never)
    image = tmp_path / "kit.sqsh"
    image.write_bytes(b"")
    args = [str(image) if a == "KIMG" else a for a in args.split()]
    code, out, err = run_cli(capsys, *args, "--out", str(tmp_path / "run"))
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_run_dir_with_percent_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, *CPU_TINY, "--out", str(tmp_path / "a%jb"), "--dry-run")
    assert code == 2 and "'%'" in err


def test_site_file_errors(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(site_mod.SITE_ENV, str(tmp_path / "missing.toml"))
    code, _, err = dry(capsys, tmp_path, *CPU_TINY)
    assert code == 2 and "does not exist" in err
    bad = tmp_path / "bad.toml"
    bad.write_text('partiton = "x"\n')
    code, _, err = dry(capsys, tmp_path, *CPU_TINY, "--site", str(bad))
    assert code == 2 and "unknown key 'partiton'; valid keys:" in err


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("nodes,ep", [(32, 64), (18, 8), (36, 8), (27, 4), (16, 64)])
def test_segment_is_what_allocation_says(capsys, tmp_path, nodes, ep):
    image = tmp_path / "kit.sqsh"
    image.write_bytes(b"")
    job = f"--preset gb200-nvl72 --model deepseek-v3 --nodes {nodes} --ep {ep} --image {image}".split()
    # model.hidden divisible by every dp here (9, 18, 27)
    sets = ["--set", f"train.batch_size={nodes * 4 * 8}", "--set", "model.hidden=6912"]
    code, out, err = dry(capsys, tmp_path, *job, *sets)
    assert code == 0, err
    alloc = allocation(presets.load("gb200-nvl72"), nodes, ep, num_experts=256)
    assert f"#SBATCH --segment={alloc.segment}\n" in out
    assert f"placement: {alloc.reason}" in out
    assert f"--container-image={image}" in out


def test_allow_straddle_warns_with_predicted_cost(capsys, tmp_path):
    args = (
        "--preset gb200-nvl72 --model tiny --nodes 21 --ep 42 --set moe.num_experts=42 "
        "--set train.batch_size=84 --allow-straddle"
    ).split()
    code, out, err = dry(capsys, tmp_path, *args)
    assert code == 0, err
    assert "warning: EP groups of 42 straddle gb200-nvl72's NVLink domains" in err
    assert "ms per MoE layer" in err and "GB over the network per GPU per step" in err
    assert "--segment" not in script_of(out)
    assert "parallel.allow_straddle=true" in out


def test_cpu_preset_has_no_gpus_and_no_container(capsys, tmp_path):
    out, script = dry_script(capsys, tmp_path, *CPU_TINY, "--steps", "5")
    assert "--gpus-per-node" not in script and "--container" not in script
    assert "#SBATCH --ntasks-per-node=2" in script and "%t_log.out" in script
    assert "--devices 4" in out and "--steps 5" in out


def test_no_container_on_gpu_preset_uses_host_python(capsys, tmp_path):
    code, out, err = dry(
        capsys, tmp_path, "--preset", "h100-dgx", "--model", "tiny", "--nodes", "1", "--no-container"
    )
    assert code == 0, err
    script = script_of(out)
    assert "--container" not in script and "#SBATCH --gpus-per-node=8" in script
    assert "--devices" not in out


def test_site_defaults_and_flag_overrides(capsys, tmp_path):
    image = tmp_path / "kit.sqsh"
    image.write_bytes(b"")
    site_file = tmp_path / "site.toml"
    site_file.write_text(
        f'partition = "gpu"\naccount = "proj"\nqos = "high"\ntime = "3:00:00"\n'
        f'image = "{image}"\nmounts = ["/data:/data:ro"]\nmax_requeues = 5\n'
    )
    job = "--preset h100-dgx --model tiny --nodes 1".split()
    out, script = dry_script(capsys, tmp_path, *job, "--site", str(site_file), "--account", "other")
    for line in (
        "#SBATCH --partition=gpu",
        "#SBATCH --account=other",
        "#SBATCH --qos=high",
        "#SBATCH --time=180",
        f"--container-image={image}",
        "/data:/data:ro",
        "-lt 5 ]",
    ):
        assert line in script


def test_smoke_job_renders_preflight(capsys, tmp_path):
    image = tmp_path / "kit.sqsh"
    image.write_bytes(b"")
    out, script = dry_script(capsys, tmp_path, "--preset", "gb200-nvl72", "--smoke", "--image", str(image))
    assert "#SBATCH --nodes=1" in script
    assert (
        "--container-name=moe-train --container-workdir=/opt/moe-train "
        "--no-container-mount-home python3 -m containers.preflight --preset gb200-nvl72 "
        "--expect-gpus 4"
    ) in script
    assert "--preset tiny" in out and "parallel.ep=4" in out and "--steps 20" in out
    proc, calls = run_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert calls.index("true") < calls.index("containers.preflight") < calls.index("_submit")


def test_relative_image_path_becomes_absolute(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    Path("kit.sqsh").write_bytes(b"")
    code, out, err = dry(
        capsys, tmp_path, "--preset", "h200-hgx", "--model", "tiny", "--nodes", "1", "--image", "./kit.sqsh"
    )
    assert code == 0, err
    assert f"--container-image={tmp_path / 'kit.sqsh'}" in out


def test_registry_reference_in_pyxis_syntax(capsys, tmp_path):
    job = "--preset h200-hgx --model tiny --nodes 1 --image nvcr.io/me/moe-train:1".split()
    code, out, err = dry(capsys, tmp_path, *job)
    assert code == 0, err
    assert "'--container-image=nvcr.io#me/moe-train:1'" in out


@pytest.mark.parametrize(
    "srun_exit,restarts,requeued", [(4, "0", True), (4, "3", False), (3, "0", False), (0, "0", False)]
)
def test_teardown_requeues_only_a_hung_step(capsys, tmp_path, srun_exit, restarts, requeued):
    code, out, _ = dry(capsys, tmp_path, *CPU_TINY)
    proc, calls = run_script(
        script_of(out), tmp_path, srun_exit=srun_exit, env={"SLURM_RESTART_COUNT": restarts}
    )
    assert proc.returncode == srun_exit
    assert ("scontrol requeue 77" in calls) == requeued


# --------------------------------------------------------------------------- parsing, task, follow


@pytest.mark.parametrize(
    "text,minutes", [("90", 90), ("01:30:00", 90), ("1-00:00:00", 1440), ("0:59", 1), ("2-3", 3060)]
)
def test_parse_time(text, minutes):
    assert plan.parse_time(text) == minutes


def test_task_requeues_are_bounded(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    t = task.TrainTask(("--preset", "tiny"), str(tmp_path), steps=10, max_requeues=2)
    nxt = t.checkpoint()
    assert nxt is not None and nxt.function.requeues == 1
    assert nxt.function.checkpoint().function.requeues == 2
    assert nxt.function.checkpoint().function.checkpoint() is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert t.checkpoint() is None
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "10.orbax-checkpoint-tmp-1").mkdir()
    assert task.latest_checkpoint(tmp_path) == 4


def test_follow_streams_rank0_and_reports(tmp_path):
    folder = tmp_path / "slurm"
    folder.mkdir()
    log = folder / "5_0_log.out"
    states = iter(["PENDING", "RUNNING", "RUNNING", "COMPLETED"])

    def state_of(job_id):
        st = next(states)
        if st == "RUNNING":
            with log.open("a") as f:
                f.write("step 1/2 | loss 5.0\n")
        return follow.JobState(st, "0:0")

    out, err = io.StringIO(), io.StringIO()
    assert follow.follow("5", folder, out=out, err=err, poll_s=0, state_of=state_of) == 0
    assert out.getvalue().count("step 1/2") == 2
    assert "job 5: RUNNING" in err.getvalue() and "COMPLETED" in err.getvalue()


def test_follow_names_the_failing_rank(tmp_path):
    folder = tmp_path / "slurm"
    folder.mkdir()
    (folder / "9_0_log.err").write_text(
        "error: process 0 of 2: a collective with the other processes failed, most likely a peer died\n"
    )
    (folder / "9_1_log.err").write_text("Traceback ...\nerror: loss became nan at step 3\n")
    err = io.StringIO()
    code = follow.follow(
        "9", folder, out=io.StringIO(), err=err, poll_s=0, state_of=lambda j: follow.JobState("FAILED", "3:0")
    )
    assert code == 3
    assert "job 9 ended FAILED (exit 3:0); rank 1: error: loss became nan at step 3" in err.getvalue()


def test_render_matches_submitit_parameters():
    spec = examples.spec_for("h100-dgx")
    params = render.executor_parameters(spec)
    assert params["ntasks_per_node"] == 8 and params["gpus_per_node"] == 8
    assert params["signal_delay_s"] == 300 and params["time"] == 120
    assert render.srun_command(render.render_script(spec)).startswith("srun --unbuffered")


def test_follow_prefers_sruns_report_of_a_killed_rank(tmp_path):
    folder = tmp_path / "slurm"
    folder.mkdir()
    (folder / "7_0_log.err").write_text(
        "srun: error: node3: task 1: Killed\nsrun: error: node3: task 0: Killed\n"
    )
    err = io.StringIO()
    code = follow.follow(
        "7", folder, out=io.StringIO(), err=err, poll_s=0, state_of=lambda j: follow.JobState("FAILED", "9:0")
    )
    assert code == 9 and "rank 1 on node3: Killed" in err.getvalue()
