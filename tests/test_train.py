"""The trainer: metrics, single compilation, learning, preemption and resume, divergence."""

import json
import signal
import subprocess
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import pipe, records, start_train_cli, tiny

from moe_train import config
from moe_train.moe import Routing, dropless_moe
from moe_train.train import step as train
from moe_train.train.loop import EXIT_DIVERGED, EXIT_OK, run

METRIC_KEYS = {
    "step",
    "loss",
    "aux_loss",
    "z_loss",
    "grad_norm",
    "lr",
    "step_time_s",
    "tokens_per_s",
    "tflops_per_device",
    "mfu",
    "tokens_per_expert",
    "max_over_mean_load",
    "dropped_tokens",
    "compilations",
}


def test_pulse_two_steps_writes_metrics_and_config(tmp_path):
    assert run(tiny(), tmp_path, log=lambda s: None) == EXIT_OK
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2]
    assert METRIC_KEYS <= recs[-1].keys()
    assert np.isfinite([r["loss"] for r in recs]).all()
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 2


@pytest.mark.parametrize("scan", ["true", "false"])
def test_metrics_report_loads_per_moe_layer(tmp_path, scan):
    run(
        tiny("model.num_layers=3", "model.first_dense_layers=1", f"model.scan_layers={scan}"),
        tmp_path,
        log=lambda s: None,
    )
    rec = records(tmp_path)[-1]
    assert np.asarray(rec["tokens_per_expert"]).shape == (2, 8)
    assert all(sum(layer) == 8 * 64 * 2 for layer in rec["tokens_per_expert"])
    assert rec["dropped_tokens"] == 0 and rec["mfu"] is None


def test_step_compiles_once_while_routing_changes(tmp_path):
    run(tiny(steps=6), tmp_path, log=lambda s: None)
    recs = records(tmp_path)
    loads = [tuple(map(tuple, r["tokens_per_expert"])) for r in recs]
    assert len(set(loads)) > 1, "routing never changed; the test would prove nothing"
    assert [r["compilations"] for r in recs] == [1] * 6


def test_data_parallel_matches_single_device(tmp_path):
    run(tiny(steps=3), tmp_path / "one", log=lambda s: None)
    run(tiny("parallel.devices=2", steps=3), tmp_path / "two", log=lambda s: None)
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)


@pytest.mark.slow
def test_loss_falls_on_smoke_task(tmp_path):
    run(tiny(steps=30), tmp_path, log=lambda s: None)
    losses = [r["loss"] for r in records(tmp_path)]
    assert np.mean(losses[-3:]) < 0.9 * losses[0], losses


@pytest.mark.parametrize("tied", ["false", "true"])
def test_chunked_loss_equals_the_full_logits_loss(tied):
    """The train step's chunked cross-entropy (chunks of 40 of 128 tokens, the last one
    padded) against the old computation: fp32 logits [B, S, V] of the head, optax CE."""
    import optax

    from moe_train.model.settings import model_settings
    from moe_train.model.transformer import Transformer

    cfg = tiny(f"model.tie_embeddings={tied}", "train.loss_chunk=40", "train.seq_len=64")
    model = Transformer(model_settings(cfg))
    batch_BS = jax.random.randint(jax.random.key(1), (2, 65), 0, 256)
    variables = model.init(jax.random.key(0), batch_BS[:, :-1])
    params, moe_state = nn.unbox(variables["params"]), variables["moe_state"]

    def old(params):
        head, _ = model.apply({"params": params, "moe_state": moe_state}, batch_BS[:, :-1], logits=False)
        logits_BSV = (head.x_BSH @ head.head_HV * head.scale).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, batch_BS[:, 1:]).mean()

    def new(params):
        return train._loss_fn(params, {}, moe_state, batch_BS, model, cfg)[1]["ce"]

    (want, want_g), (got, got_g) = (jax.jit(jax.value_and_grad(f))(params) for f in (old, new))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), got_g, want_g)


def test_bias_update_rule_moves_load_toward_balance():
    key_x, key_g = jax.random.split(jax.random.key(0))
    x_TH = jax.random.normal(key_x, (512, 16)) + 2.0  # a shared offset: most tokens agree
    gate_HE = jax.random.normal(key_g, (16, 8)) * 0.5
    w = jnp.zeros((8, 16, 4)), jnp.zeros((8, 16, 4)), jnp.zeros((8, 4, 16))
    state = {"moe_layers": {"moe": {"expert_bias": jnp.zeros((1, 8))}}}  # one scanned layer

    def imbalance(bias):
        _, stats = dropless_moe(x_TH, gate_HE, *w, Routing(2, score_function="sigmoid"), expert_bias=bias)
        load = stats.tokens_per_expert
        return float(load.max() / load.mean()), load

    start, _ = imbalance(state["moe_layers"]["moe"]["expert_bias"][0])
    for _ in range(200):
        _, load = imbalance(state["moe_layers"]["moe"]["expert_bias"][0])
        state = train.update_bias(state, load[None], rate=0.01)
    end, _ = imbalance(state["moe_layers"]["moe"]["expert_bias"][0])
    assert start > 2.0 and end < 0.6 * start, (start, end)


def test_bias_lives_in_state_and_is_checkpointed(tmp_path):
    cfg = tiny("moe.score_function=sigmoid", "moe.bias_update_rate=0.01", steps=3)
    run(cfg, tmp_path, log=lambda s: None)
    from moe_train.checkpoints.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path, keep=3, use_async=False)
    restored = ck.restore_saved(3)
    ck.close()
    bias_LE = np.asarray(restored["moe_state"]["moe_layers"]["moe"]["expert_bias"])
    assert bias_LE.shape == (2, 8) and np.all(np.abs(bias_LE).sum(axis=1) > 0)


def test_bf16_compute_with_fp32_master_weights(tmp_path):
    assert run(tiny("precision.compute=bf16"), tmp_path, log=lambda s: None) == EXIT_OK
    from moe_train.checkpoints.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path, keep=3, use_async=False)
    params = ck.restore_saved(2)["params"]
    ck.close()
    assert {np.asarray(p).dtype for p in jax.tree.leaves(params)} == {np.dtype("float32")}
    assert np.isfinite([r["loss"] for r in records(tmp_path)]).all()


def test_resumes_a_checkpoint_saved_before_the_fp8_state_existed(tmp_path):
    """Checkpoints of earlier releases hold no fp8_state: a non-fp8 run resumes them."""
    from moe_train.checkpoints.checkpoint import Checkpointer

    first, old = tmp_path / "first", tmp_path / "old"
    assert run(tiny(steps=2), first, log=lambda s: None) == EXIT_OK
    ck = Checkpointer(first, keep=3, use_async=False)
    saved, meta = ck.restore_saved(2), ck.read_meta(2)
    ck.close()
    assert saved.pop("fp8_state") == {}
    del meta["config"]["precision"]  # the earlier release's config had no [precision]
    ck = Checkpointer(old, keep=3, use_async=False)  # the earlier release's layout
    ck.save(2, saved, meta)
    ck.close()
    assert run(tiny(steps=3), old, log=lambda s: None) == EXIT_OK
    assert [r["step"] for r in records(old)] == [3]


def test_micro_batches_take_the_same_step(tmp_path):
    """Gradient accumulation over 4 micro-batches is the same step as the whole batch (no
    batch-level balance loss, so every term is a per-token mean)."""
    recs = {}
    for n in (1, 4):
        cfg = tiny("moe.aux_loss_coef=0", f"train.micro_batches={n}", steps=2)
        assert run(cfg, tmp_path / str(n), log=lambda s: None) == EXIT_OK
        recs[n] = records(tmp_path / str(n))
    for key in ("loss", "grad_norm", "z_loss"):
        np.testing.assert_allclose([r[key] for r in recs[4]], [r[key] for r in recs[1]], rtol=2e-6)
    assert [r["tokens_per_expert"] for r in recs[4]] == [r["tokens_per_expert"] for r in recs[1]]


def test_micro_batches_lower_the_compiled_step_memory(tmp_path):
    temp = {}
    for n in (1, 4):
        assert (
            run(tiny(f"train.micro_batches={n}", steps=1), tmp_path / str(n), log=lambda s: None) == EXIT_OK
        )
        temp[n] = records(tmp_path / str(n))[0]["compiled_temp_bytes"]
    assert temp[4] < 0.7 * temp[1], temp


def test_micro_batches_not_dividing_the_batch_exit_2(tmp_path, capsys):
    from moe_train.train import cli

    args = ["--preset", "tiny", "--out", str(tmp_path), "--set", "train.micro_batches=3"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ")
        and ("train.micro_batches=3 must divide train.batch_size=8; choose one of [1, 2, 4, 8]") in err
    ), err


def test_micro_batches_not_dividing_the_rows_per_device_are_refused(tmp_path):
    cfg = tiny("train.micro_batches=4", "parallel.devices=4")
    with pytest.raises(
        config.ConfigError,
        match=r"does not divide the 2 sequences per device "
        r"\(train.batch_size=8 over 4 devices\); choose one of \[1, 2\]",
    ):
        run(cfg, tmp_path, log=lambda s: None)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    lines = []
    cfg = tiny(
        "optim.lr=1e30",
        "optim.warmup_steps=0",
        "optim.grad_clip=0",
        "train.checkpoint_every=1",
        "train.async_checkpoint=false",
        steps=6,
    )
    assert run(cfg, tmp_path, log=lines.append) == EXIT_DIVERGED
    bad = [r for r in lines if r.startswith("error: step")]
    assert bad and "was not applied" in bad[0] and "rerun resumes there" in bad[0]
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and all(r["step"] <= max(steps) for r in records(tmp_path))


def test_periodic_checkpoints_keep_the_last_n(tmp_path):
    run(tiny("train.checkpoint_every=1", "train.keep_checkpoints=2", steps=5), tmp_path, log=lambda s: None)
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [4, 5]


def test_unfinished_checkpoint_is_ignored_on_resume(tmp_path):
    run(tiny(steps=2), tmp_path, log=lambda s: None)
    (tmp_path / "checkpoints" / "5.orbax-checkpoint-tmp-123").mkdir()
    lines = []
    assert run(tiny(steps=3), tmp_path, log=lines.append) == EXIT_OK
    assert any("resumed from" in l and "(step 2)" in l for l in lines)
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]


def _train_cli(out: Path, steps: int) -> subprocess.Popen:
    args = ["--steps", steps, "--devices", 1, "--set", "train.checkpoint_every=2"]
    return start_train_cli(out, *args, stderr=subprocess.STDOUT)


RESUME_STEPS = 14


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("full")
    proc = _train_cli(out, RESUME_STEPS)
    assert proc.wait(timeout=300) == 0, pipe(proc.stdout).read()
    return records(out)


def _wait_for_steps(out: Path, n: int) -> None:
    metrics, deadline = out / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < n):
        time.sleep(0.02)


def _finish_and_compare(out: Path, reference: list[dict]) -> None:
    again = _train_cli(out, RESUME_STEPS)
    assert again.wait(timeout=300) == 0, pipe(again.stdout).read()
    cut = records(out)
    assert [r["step"] for r in cut] == list(range(1, RESUME_STEPS + 1))
    assert [r["loss"] for r in cut] == [r["loss"] for r in reference]  # bitwise on CPU in fp32


@pytest.mark.slow
def test_resume_after_sigusr2_matches_uninterrupted_run(tmp_path, uninterrupted):
    proc = _train_cli(tmp_path, RESUME_STEPS)
    _wait_for_steps(tmp_path, 5)
    proc.send_signal(signal.SIGUSR2)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    assert "stopped by signal SIGUSR2" in output
    assert len(records(tmp_path)) < RESUME_STEPS
    _finish_and_compare(tmp_path, uninterrupted)


@pytest.mark.slow
def test_resume_after_sigkill_mid_run_matches_uninterrupted_run(tmp_path, uninterrupted):
    """A hard crash (possibly during an async save) leaves only loadable checkpoints."""
    proc = _train_cli(tmp_path, RESUME_STEPS)
    _wait_for_steps(tmp_path, 7)
    proc.kill()
    proc.wait(timeout=60)
    _finish_and_compare(tmp_path, uninterrupted)
