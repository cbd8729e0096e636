"""``moe_train.compile.overlap``: the windows of scheduled HLO text (what runs between an async
collective's start and its done), their GEMM FLOPs, loop trip counts and the seconds they can
hide. Hand-written HLO in XLA:GPU's text form; no plugin needed."""

from __future__ import annotations

import pytest

from moe_train.compile import overlap

OVERLAP = """HloModule m, is_scheduled=true

%fused_dot (p0: bf16[4,8], p1: bf16[8,2]) -> f32[4,2] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = bf16[8,2]{1,0} parameter(1)
  ROOT %d = f32[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[4,8], b: bf16[8,2], x: bf16[16,4]) -> f32[4,2] {
  %s1 = ((bf16[16,4]{1,0}), bf16[16,4]{1,0}) all-to-all-start(%x), dimensions={0}
  %g1 = f32[4,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %e1 = f32[4,2]{1,0} fusion(%g1), kind=kLoop, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton"}}
  %d1 = bf16[16,4]{1,0} all-to-all-done(%s1)
  %s2 = ((bf16[16,4]{1,0}), bf16[16,4]{1,0}) all-to-all-start(%d1), dimensions={0}
  %d2 = bf16[16,4]{1,0} all-to-all-done(%s2)
  %s3 = f32[64]{0} all-reduce-start(%c), backend_config={"collective_backend_config":{"is_sync":true}}
  %m3 = f32[4,2]{1,0} custom-call(%a), custom_call_target="mosaic_gpu_v2"
  %d3 = f32[64]{0} all-reduce-done(%s3)
  ROOT %r = f32[4,2]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm"
}
"""  # noqa: E501  (HLO text as XLA prints it, one instruction a line)

# a loop of 6 iterations whose body runs a grouped GEMM under an all-to-all; the entry runs a
# cuBLAS GEMM under an all-gather
LOOPED = """HloModule m, is_scheduled=true

%cond (p: (s32[])) -> pred[] {
  %p = (s32[]) parameter(0)
  ROOT %t = pred[] constant(true)
}

%body (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %x = bf16[32,8]{1,0} parameter(1)
  %s = ((bf16[32,8]{1,0}), bf16[32,8]{1,0}) all-to-all-start(%x), dimensions={0}
  %m = bf16[32,16]{1,0} custom-call(%g, %x, %w), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[4]{0}, bf16[32,8]{1,0}, bf16[4,8,16]{2,1,0}}, api_version=API_VERSION_TYPED_FFI
  %d = bf16[32,8]{1,0} all-to-all-done(%s)
  ROOT %r = (s32[]) tuple(%i)
}

ENTRY %main (a: bf16[4,8], b: bf16[8,2]) -> f32[4,2] {
  %w = (s32[]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %a = bf16[4,8]{1,0} parameter(0)
  %b = bf16[8,2]{1,0} parameter(1)
  %s = (bf16[1,8]{1,0}, bf16[4,8]{1,0}) all-gather-start(%y), dimensions={0}
  %c = f32[4,2]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %d = bf16[4,8]{1,0} all-gather-done(%s)
  ROOT %r = f32[4,2]{1,0} copy(%c)
}
"""  # noqa: E501  (HLO text as XLA prints it, one instruction a line)


def test_the_summary_counts_the_kernels_between_each_async_start_and_done():
    # a2a 1 hides a Triton GEMM and a Triton fusion, a2a 2 nothing; the sync all-reduce is no pair
    s = overlap.summary(overlap.windows(OVERLAP))
    assert list(s) == ["all-to-all"]
    assert {k: s["all-to-all"][k] for k in ("pairs", "with_gemm", "gemm_kernels", "other_kernels")} == {
        "pairs": 2,
        "with_gemm": 1,
        "gemm_kernels": 1,
        "other_kernels": 1,
    }


def test_a_dots_flops_are_twice_its_result_times_the_contracted_size():
    s = overlap.summary(overlap.windows(OVERLAP))["all-to-all"]
    assert s["gemm_flops"] == 2 * 4 * 2 * 8
    assert (s["bytes"], s["bytes_with_gemm"]) == (2 * 16 * 4 * 2, 16 * 4 * 2)


def test_a_loop_bodys_windows_run_its_trip_count_times():
    ws = {w.kind: w for w in overlap.windows(LOOPED)}
    assert (ws["all-to-all"].runs, ws["all-gather"].runs) == (6, 1)


def test_a_grouped_gemms_flops_come_from_its_rows_and_its_weight():
    w = {w.kind: w for w in overlap.windows(LOOPED)}["all-to-all"]
    assert w.gemm_flops == 2 * 32 * 8 * 16


def test_a_cublas_gemms_flops_come_from_its_contracting_dimensions():
    w = {w.kind: w for w in overlap.windows(LOOPED)}["all-gather"]
    assert w.gemm_flops == 2 * 4 * 2 * 8


def test_a_window_hides_at_most_the_smaller_of_its_transfer_and_its_gemms():
    ws = overlap.windows(LOOPED)  # a2a: 512 bytes x 6 runs, 8,192 FLOPs each
    slow_link = overlap.hidden(ws, "all-to-all", link_bytes_per_s=512, gemm_flops_per_s=8192e3)
    assert slow_link == pytest.approx({"comm_s": 6.0, "hidden_s": 6e-3})
    slow_gemm = overlap.hidden(ws, "all-to-all", link_bytes_per_s=512e3, gemm_flops_per_s=8192)
    assert slow_gemm == pytest.approx({"comm_s": 6e-3, "hidden_s": 6e-3})


def test_a_sync_collective_counts_its_transfer_and_hides_nothing():
    # the all-reduce marked is_sync (f32[64]: 256 bytes) has a Mosaic GPU kernel beside it
    assert overlap.hidden(overlap.windows(OVERLAP), "all-reduce", 1.0, 1.0) == {
        "comm_s": 256.0,
        "hidden_s": 0.0,
    }


def test_a_collective_without_a_start_is_a_sync_window():
    text = "HloModule m\n\nENTRY %main (x: f32[8]) -> f32[8] {\n  ROOT %r = f32[8]{0} all-reduce(%x)\n}\n"
    assert overlap.windows(text) == [overlap.Window("all-reduce", 32, 0, 0, 0.0, 1, sync=True)]


def test_a_collective_kind_that_is_absent_hides_nothing():
    assert overlap.hidden(overlap.windows(OVERLAP), "reduce-scatter", 1.0, 1.0) == {
        "comm_s": 0,
        "hidden_s": 0,
    }


# an all-gather in flight over a loop of 3 GEMM iterations, an all-reduce over a loop that
# runs an all-to-all of its own
NESTED = """HloModule m, is_scheduled=true

%fused_dot (p0: bf16[4,8], p1: bf16[8,2]) -> f32[4,2] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = bf16[8,2]{1,0} parameter(1)
  ROOT %d = f32[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemms (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %g = f32[4,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %r = (s32[]) tuple(%i)
}

%exchange (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %g = f32[4,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %s = ((bf16[16,4]{1,0}), bf16[16,4]{1,0}) all-to-all-start(%x), dimensions={0}
  %d = bf16[16,4]{1,0} all-to-all-done(%s)
  ROOT %r = (s32[]) tuple(%i)
}

ENTRY %main (a: bf16[4,8], b: bf16[8,2], c: f32[64]) -> f32[4,2] {
  %s1 = (bf16[1,8]{1,0}, bf16[4,8]{1,0}) all-gather-start(%y), dimensions={0}
  %w1 = (s32[]) while(%t0), condition=%cond, body=%gemms, backend_config={"known_trip_count":{"n":"3"}}
  %d1 = bf16[4,8]{1,0} all-gather-done(%s1)
  %s2 = f32[64]{0} all-reduce-start(%c)
  %w2 = (s32[]) while(%t1), condition=%cond, body=%exchange, backend_config={"known_trip_count":{"n":"5"}}
  %d2 = f32[64]{0} all-reduce-done(%s2)
  ROOT %r = f32[4,2]{1,0} copy(%a)
}
"""  # noqa: E501  (HLO text as XLA prints it, one instruction a line)


def test_a_loop_in_a_window_counts_its_bodys_gemms_times_its_trip_count():
    w = {w.kind: w for w in overlap.windows(NESTED)}["all-gather"]
    assert (w.gemm_kernels, w.gemm_flops) == (3, 3 * 2 * 4 * 2 * 8)


def test_a_loop_that_runs_collectives_of_its_own_hides_nothing_of_another():
    w = {w.kind: w for w in overlap.windows(NESTED)}["all-reduce"]
    assert (w.gemm_kernels, w.gemm_flops) == (0, 0.0)


# the tiled experts' walk under an all-to-all: a loop over the experts with traced bounds, in
# it a loop of 8-row blocks and one of 2-row blocks, each slicing its block out of 32 rows
WALK = """HloModule m, is_scheduled=true

%fused_dot (p0: bf16[8,8], p1: bf16[8,2]) -> f32[8,2] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,2]{1,0} parameter(1)
  ROOT %d = f32[8,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_small (p0: bf16[2,8], p1: bf16[8,2]) -> f32[2,2] {
  %p0 = bf16[2,8]{1,0} parameter(0)
  %p1 = bf16[8,2]{1,0} parameter(1)
  ROOT %d = f32[2,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%big (p: (s32[], bf16[32,8])) -> (s32[], bf16[32,8]) {
  %p = (s32[], bf16[32,8]{1,0}) parameter(0)
  %x = bf16[8,8]{1,0} dynamic-slice(%r, %i, %z), dynamic_slice_sizes={8,8}
  %g = f32[8,2]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %t = (s32[], bf16[32,8]{1,0}) tuple(%i, %r)
}

%small (p: (s32[], bf16[32,8])) -> (s32[], bf16[32,8]) {
  %p = (s32[], bf16[32,8]{1,0}) parameter(0)
  %x = bf16[2,8]{1,0} dynamic-slice(%r, %i, %z), dynamic_slice_sizes={2,8}
  %g = f32[2,2]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_small, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %t = (s32[], bf16[32,8]{1,0}) tuple(%i, %r)
}

%experts (p: (s32[], bf16[32,8])) -> (s32[], bf16[32,8]) {
  %p = (s32[], bf16[32,8]{1,0}) parameter(0)
  %b = (s32[], bf16[32,8]{1,0}) while(%p), condition=%cond, body=%big
  %c = (s32[], bf16[32,8]{1,0}) while(%b), condition=%cond, body=%small
  ROOT %t = (s32[], bf16[32,8]{1,0}) copy(%c)
}

ENTRY %main (x: bf16[16,4], r: bf16[32,8]) -> bf16[16,4] {
  %s = ((bf16[16,4]{1,0}), bf16[16,4]{1,0}) all-to-all-start(%x), dimensions={0}
  %e = (s32[], bf16[32,8]{1,0}) while(%t0), condition=%cond, body=%experts
  ROOT %d = bf16[16,4]{1,0} all-to-all-done(%s)
}
"""  # noqa: E501  (HLO text as XLA prints it, one instruction a line)


def test_a_walk_over_rows_with_traced_bounds_counts_every_row_once():
    """32 rows in blocks of 8: 4 runs of the 8-row body's GEMM (not one run of each body)."""
    (w,) = overlap.windows(WALK)
    assert (w.gemm_kernels, w.gemm_flops) == (4, 4 * 2 * 8 * 2 * 8)
