"""The benchmarks run at tiny sizes and write valid results (they measure nothing here)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(tmp_path, *flags):
    """Run ``python -m moe_train.bench FLAGS`` in its own process (it sets up its devices)."""
    proc = subprocess.run(
        [sys.executable, "-m", "moe_train.bench", *flags, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return json.loads((run_dir / "results.json").read_text()), (run_dir / "results.md").read_text()


def positive(v):
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def check_timing(t, min_reps=3):
    assert all(positive(t[k]) for k in ("median_s", "min_s", "max_s")), t
    assert t["min_s"] <= t["median_s"] <= t["max_s"] and t["reps"] >= min_reps


def check_gemm(sec):
    rows = [r for r in sec["rows"] if not r["skipped"]]
    assert {r["backend"] for r in rows} >= {"dense", "tiled", "capacity"}
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    assert {r["backend"] for r in sec["rows"] if r["skipped"]} >= {"mgpu", "te"}  # CPU
    for r in rows:
        check_timing(r["time"])
        assert positive(r["ratio"]) and 0 < r["ratio_min"] <= r["ratio_max"]
        assert r["padding_waste"] >= 1.0 and 0.0 <= r["drop_rate"] <= 1.0
        assert r["executed_flops"] >= r["useful_flops"] > 0
    for r in rows:
        if r["backend"] == "tiled":
            assert r["tile_rows"] >= 1 and r["block_rows"] >= r["tile_rows"]
            assert r["drop_rate"] == 0.0
    assert any(r["drop_rate"] > 0 for r in rows if r["backend"] == "capacity" and r["routing"] == "hot")


def check_layer(sec):
    rows = [r for r in sec["rows"] if not r["skipped"]]
    assert {r["backend"] for r in rows} >= {"dense", "tiled", "ragged_dot", "capacity"}
    for r in rows:
        check_timing(r["time"])
        assert positive(r["tokens_per_s"]) and positive(r["ratio"])
        if r["backend"] in ("tiled", "ragged_dot"):
            assert r["drop_rate"] == 0.0
    step = sec["train_step"]
    check_timing(step["time"])
    check_timing(step["time_moe_removed"])
    assert positive(step["tokens_per_s"]) and math.isfinite(step["moe_fraction"])


def check_ep(ep):
    rows = ep["timing"]
    assert {r["dispatcher"] for r in rows} >= {"dense (dropless_moe)", "allgather", "a2a", "hierarchical"}
    for r in rows:
        check_timing(r["time"])
        if r["kind"] == "ep":
            assert 0 < r["fill"] <= 1, r
            assert not r["overflow"]
            assert positive(r["fwd_bytes_per_device"]["total"])
    assert {r["routing"] for r in rows} >= {"uniform", "zipf", "balanced"}
    # forced balance: every expert and every EP pair the same load; dropless timed beside it
    assert ep["realized_skew"]["balanced"]["expert_max_over_mean"] == 1.0
    assert all(b["pair_load_bound"] == 1.0 for b in ep["buckets"] if b["routing"] == "balanced")
    beside = ep["beside_balanced"]
    assert {(r["dispatcher"], r["routing"]) for r in beside} >= {("a2a", "uniform"), ("a2a", "zipf")}
    assert all(positive(r["over_balanced"]) for r in beside)
    buckets = ep["buckets"]
    assert {b["dispatcher"] for b in buckets} == {"a2a", "hierarchical"}
    for b in buckets:
        assert 0 < b["fill"] <= 1 and 0 < b["worst_fill"] <= 1, b
        assert b["worst_fill"] <= b["fill"] + 1e-9  # the worst case never fills better
        assert b["buffer_over_received"] == pytest.approx(1 / b["fill"])
        assert b["reruns"] >= 0 and b["held_bucket"]


def check_compiles(sec):
    # a correctness property, not a speed: one compilation per capacity bucket touched
    d, e = sec["dropless"], sec["ep"]
    assert d["ok"] and d["traces"] == d["compilations"] == 1 and d["distinct_routings"] > 1
    assert e["ok"] and e["traces"] == e["compilations"] == len(e["buckets_touched"]) >= 1
    assert len(e["bucket_by_step"]) == e["steps"]


@pytest.mark.slow
def test_quick_bench_writes_results(tmp_path):
    results, md = _bench(tmp_path, "--quick")
    assert results["quick"] is True
    sections = results["sections"]
    assert set(sections) == {"gemm", "layer", "ep", "compiles"}
    for title in (
        "Grouped GEMM efficiency",
        "MoE layer and train step",
        "Expert parallel (8 fake CPU devices)",
        "Compilations over drifting routing",
        "## Targets",
    ):
        assert title in md
    check_gemm(sections["gemm"])
    check_layer(sections["layer"])
    check_ep(sections["ep"])
    check_compiles(sections["compiles"])
    assert results["targets"] and all(isinstance(t["met"], bool) for t in results["targets"])


def test_loss_section_shows_chunking_saves_memory_at_a_real_vocab():
    from moe_train.bench import loss
    from moe_train.bench.report import targets

    sec = loss.run(loss.QUICK)
    rows = {r["vocab"]: r for r in sec["rows"]}
    assert rows[131072]["chunk"] < loss.QUICK.tokens  # really chunked there
    assert rows[131072]["chunked_temp_bytes"] < 0.5 * rows[131072]["whole_temp_bytes"]
    assert rows[131072]["vs_first_vocab"] <= 1.3  # flat in the vocab
    flat = [r for r in sec["plan_rows"] if r["equal_tokens"] and r["memory"] == "flash"]
    assert flat and all(r["vs_first_seq"] == 1.0 for r in flat)
    xla = [r for r in sec["plan_rows"] if r["memory"] == "scores"]
    assert xla[-1]["vs_first_seq"] > 1.5  # [S, S] scores: grows with S at equal tokens
    assert [t["met"] for t in targets({"loss": sec})] == [True, True]


def test_moe_removed_ablation_skips_exactly_the_routed_experts():
    """The train-step ablation's interceptor zeroes MoEBlock.routed (no tokens reach an
    expert) inside the scanned blocks; without it every token is routed."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from helpers import call

    from moe_train import config
    from moe_train.bench.layer import _without_routed_experts
    from moe_train.model.settings import model_settings
    from moe_train.model.transformer import Transformer

    cfg = config.build("tiny", ["parallel.devices=1"])
    tokens = jnp.zeros((2, 8), jnp.int32)
    model = Transformer(model_settings(cfg))
    variables = model.init(jax.random.key(0), tokens)
    _, stats = call(model, variables, tokens)
    with nn.intercept_methods(_without_routed_experts):
        _, removed = call(model, variables, tokens)
    routed = 2 * 8 * cfg.moe.top_k * (cfg.model.num_layers - cfg.model.first_dense_layers)
    assert int(stats.tokens_per_expert.sum()) == routed
    assert int(removed.tokens_per_expert.sum()) == 0


def test_collective_bytes_counts_each_exchange_per_device():
    from moe_train.bench.common import collective_bytes  # JAX: the other tests run it in a subprocess

    hlo = "\n".join(
        [
            "%a = bf16[8,128]{1,0} all-to-all(bf16[8,128]{1,0} %x), replica_groups={{0,1},{2,3}}",
            "%b = f32[16,64]{1,0} all-gather(f32[4,64]{1,0} %y), replica_groups=[2,2]<=[4]",
            "%c = s32[32]{0} reduce-scatter(s32[64]{0} %z), replica_groups=[2,2]<=[2,2]T(1,0)",
        ]
    )
    got = collective_bytes(hlo, lambda d: d // 2)
    assert (got["all_to_all"], got["all_gather"], got["reduce_scatter"]) == (2048, 4096, 256)
    assert got["count"] == 3 and got["total"] == 2048 + 4096 + 256
    # groups {0,1},{2,3} stay in a domain; [2,2]T(1,0) pairs {0,2},{1,3}: half of it crosses
    assert got["cross_domain"] == 0.5 * 256
