"""Where a compiled program's time goes (``moe_train.bench.profile``): op events of a real
``jax.profiler`` trace on CPU, attributed by their HLO instructions' named scopes."""

import jax
import jax.numpy as jnp
import pytest

from moe_train.bench import profile
from moe_train.moe import Routing, layer
from moe_train.planner.compile import hlo


@pytest.mark.parametrize(
    "path, scope",
    [
        ("jit(loss)/transpose(jvp(permute))/gather", "permute"),
        ("jit(step)/jvp(Transformer)/moe_layers/attn/dot_general", "attention"),
        ("jit(step)/jvp(Transformer)/moe_layers/attn.qkv/dot_general", "attention"),
        ("jit(step)/jvp(Transformer)/moe_layers/attn_norm/mul", "norms"),
        ("jit(step)/jvp(Transformer)/embed/gather", "model, other"),
        ("jit(step)/transpose(jvp())/dot_general", "other"),
        ("jit(step)/jvp(Transformer)/moe/moe.routed/route/top_k", "route"),
    ],
)
def test_an_op_counts_for_the_scope_its_path_names(path, scope):
    assert profile.scope_of(path) == scope


def test_loops_are_not_ops_of_their_own():
    fn = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * 2, x))
    text = fn.lower(jnp.ones(8)).compile().as_text() or ""
    loops = [i.name for instrs in hlo.parse(text)[0].values() for i in instrs if i.op == "while"]
    paths = profile.instruction_paths(text)
    assert loops and paths and not set(loops) & set(paths)


@pytest.fixture(scope="module")
def layer_profile():
    T, H, E, F, K = 128, 64, 8, 128, 2
    keys = jax.random.split(jax.random.key(0), 5)
    ops = (
        jax.random.normal(keys[0], (T, H)),
        jax.random.normal(keys[1], (H, E)),
        *(jax.random.normal(k, s) for k, s in zip(keys[2:], [(E, H, F), (E, H, F), (E, F, H)])),
    )

    def loss(ops):
        y, stats = layer.dropless_moe(*ops, routing=Routing(K), backend="tiled")
        return jnp.sum(y) + stats.aux_loss

    compiled = jax.jit(jax.grad(loss)).lower(ops).compile()
    jax.block_until_ready(compiled(ops))
    return profile.breakdown(lambda: jax.block_until_ready(compiled(ops)), compiled.as_text())


@pytest.mark.parametrize("step", ["route", "permute", "grouped_gemm"])
def test_the_layers_steps_take_time(layer_profile, step):
    assert layer_profile["by_scope"][step] > 0


def test_the_traced_time_is_the_sum_of_the_scopes(layer_profile):
    assert layer_profile["traced_ms"] == pytest.approx(sum(layer_profile["by_scope"].values()))


def test_the_longest_ops_are_listed_longest_first(layer_profile):
    ms = [op["ms"] for op in layer_profile["top_ops"]]
    assert ms and ms == sorted(ms, reverse=True)


@pytest.fixture(scope="module")
def two_programs_profile():
    """A looped program profiled while a second program runs beside it in each call."""
    x = jnp.ones((64, 64))
    looped = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * 2, x)).lower(x).compile()
    other = jax.jit(jnp.cos).lower(x).compile()
    jax.block_until_ready((looped(x), other(x)))
    text = looped.as_text() or ""
    prof = profile.breakdown(lambda: jax.block_until_ready((looped(x), other(x))), text)
    return prof, text, other.as_text() or ""


def test_another_programs_ops_are_unmatched_not_traced(two_programs_profile):
    prof, text, other_text = two_programs_profile
    unmatched = {u["op"] for u in prof["unmatched_top"]}
    traced = {op["op"] for op in prof["top_ops"]}
    assert unmatched and unmatched <= set(profile.instruction_paths(other_text))
    assert not unmatched & (traced | set(profile.instruction_paths(text)))


def test_the_unmatched_time_is_the_sum_of_the_unmatched_ops(two_programs_profile):
    prof = two_programs_profile[0]
    listed = sum(u["ms"] for u in prof["unmatched_top"])
    assert prof["unmatched_ms"] > 0 and prof["unmatched_ms"] == pytest.approx(listed)


def test_a_loops_event_is_neither_traced_nor_unmatched(two_programs_profile):
    prof, text, _ = two_programs_profile
    loops = profile.control_instructions(text)
    listed = {u["op"] for u in prof["unmatched_top"]} | {op["op"] for op in prof["top_ops"]}
    assert loops and prof["control_ms"] > 0 and not loops & listed


def test_each_call_runs_each_unmatched_op_once(two_programs_profile):
    assert [u["count"] for u in two_programs_profile[0]["unmatched_top"]] == [1.0]


def test_a_cpu_trace_has_no_module_time(two_programs_profile):
    """XLA:CPU's trace has no "XLA Modules" line: only a device plane has one."""
    assert two_programs_profile[0]["module_ms"] is None


def test_the_op_events_seen_count_the_traced_and_unmatched_ones(two_programs_profile):
    prof = two_programs_profile[0]
    assert prof["events"] >= len(prof["top_ops"]) + sum(u["count"] for u in prof["unmatched_top"])


def test_the_table_sets_unmatched_and_module_time_after_the_traced_time(two_programs_profile):
    header, rows = profile.markdown_rows({"x": two_programs_profile[0]})
    at = header.index("traced ms")
    assert header[at : at + 4] == ["traced ms", "unmatched ms", "module ms", "MoE steps"]
    assert float(rows[0][at + 1]) >= 0 and rows[0][at + 2] == ""


def test_a_program_without_traced_ops_is_a_row_saying_so():
    header, rows = profile.markdown_rows({"x": {"skipped": "nothing traced"}})
    assert len(rows[0]) == len(header) and rows[0][-1] == "nothing traced"


def test_a_call_that_fails_under_the_trace_is_a_row_saying_so():
    def fail():
        raise RuntimeError("device lost")

    assert "device lost" in profile.breakdown(fail, "HloModule m\n")["skipped"]


def test_a_tpu_op_event_names_its_instruction_by_its_text():
    """A TPU's "XLA Ops" events are named by the instruction's HLO text (seen on a v5e, 2026-12-07)."""
    name = "%gmm.4 = bf16[131072,1536]{1,0:T(8,128)(2,1)} custom-call(s32[] %get-tuple-element.518)"
    assert profile.instruction_name(name) == "gmm.4"


def test_an_op_event_named_by_its_instruction_alone_keeps_the_name():
    assert profile.instruction_name("fusion.12") == "fusion.12"


def test_an_attention_kernel_without_a_path_counts_for_attention():
    assert profile.scope_of("", "splash_mha_fwd_residuals.18") == "attention"


def test_a_path_decides_over_the_instruction_name():
    assert profile.scope_of("jit(step)/jvp(Transformer)/embed/gather", "splash_x.1") == "model, other"
