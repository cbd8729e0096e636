"""``moe_train.planner.compile.overlap``: the windows of scheduled HLO text (what runs between an async
collective's start and its done), their GEMM FLOPs, loop trip counts and the seconds they can
hide. Hand-written HLO in XLA:GPU's text form; no plugin needed."""

from __future__ import annotations

import pytest

from moe_train.planner.compile import groups, hlo, overlap, trips

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
    ws = overlap.windows(LOOPED)  # a2a: 512 bytes, 256 sent by each of 2 GPUs, x 6 runs; 8,192 FLOPs
    slow_link = overlap.hidden(ws, "all-to-all", link_bytes_per_s=256, gemm_flops_per_s=8192e3, devices=2)
    assert slow_link == pytest.approx({"comm_s": 6.0, "hidden_s": 6e-3})
    slow_gemm = overlap.hidden(ws, "all-to-all", link_bytes_per_s=256e3, gemm_flops_per_s=8192, devices=2)
    assert slow_gemm == pytest.approx({"comm_s": 6e-3, "hidden_s": 6e-3})


def test_a_sync_collective_counts_its_transfer_and_hides_nothing():
    # the all-reduce marked is_sync (f32[64]: 256 bytes, a ring of 2 sends them once) has a
    # Mosaic GPU kernel beside it
    assert overlap.hidden(overlap.windows(OVERLAP), "all-reduce", 1.0, 1.0, devices=2) == {
        "comm_s": 256.0,
        "hidden_s": 0.0,
    }


def test_a_collective_without_a_start_is_a_sync_window():
    text = "HloModule m\n\nENTRY %main (x: f32[8]) -> f32[8] {\n  ROOT %r = f32[8]{0} all-reduce(%x)\n}\n"
    assert overlap.windows(text) == [overlap.Window("all-reduce", 32, 0, 0, 0.0, 1, sync=True)]


def test_a_collective_kind_that_is_absent_hides_nothing():
    assert overlap.hidden(overlap.windows(OVERLAP), "reduce-scatter", 1.0, 1.0, devices=2) == {
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


# the micro-batch loop as XLA:GPU leaves it once it has peeled iterations into the caller: no
# known_trip_count; its counter starts at 1 (through a copy), the condition (a fusion) is
# counter < 19 and the body (a fusion) adds 1: 18 runs; the reduce-scatter inside it is over
# groups of 4 devices 64 apart, the all-gather over the first 64 devices (iota and mesh forms)
PEELED = """HloModule m, is_scheduled=true

%fused_compare (p0: s32[]) -> pred[] {
  %p0 = s32[] parameter(0)
  %k = s32[] constant(19)
  ROOT %lt = pred[] compare(%p0, %k), direction=LT
}

%fused_add (p0: s32[]) -> s32[] {
  %p0 = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %a = s32[] add(%p0, %one)
}

%cond (p: (s32[], bf16[8])) -> pred[] {
  %p = (s32[], bf16[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %c = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}

%body (p: (s32[], bf16[8])) -> (s32[], bf16[8]) {
  %p = (s32[], bf16[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8]{0} get-tuple-element(%p), index=1
  %s = bf16[2]{0} reduce-scatter-start(%x), replica_groups=[64,4]<=[4,64]T(1,0), dimensions={0}
  %d = bf16[2]{0} reduce-scatter-done(%s)
  %g = bf16[512]{0} all-gather-start(%x), replica_groups=mesh['axis_0'=1,'axis_1'=64,'axis_2'=4], device_ids=([4,64]T(1,0)) {'axis_1'}, dimensions={0}
  %h = bf16[512]{0} all-gather-done(%g)
  %n = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], bf16[8]{0}) tuple(%n, %x)
}

ENTRY %main (x: bf16[8]) -> (s32[], bf16[8]) {
  %x = bf16[8]{0} parameter(0)
  %one = s32[] constant(1)
  %c = s32[] copy(%one)
  %t = (s32[], bf16[8]{0}) tuple(%c, %x)
  ROOT %w = (s32[], bf16[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
}
"""  # noqa: E501  (HLO text as XLA prints it, one instruction a line)


def test_a_loop_without_a_trip_count_runs_as_its_counter_says():
    comps, entry = hlo.parse(PEELED)
    (loop,) = [i for i in comps[entry] if i.op == "while"]
    assert trips.trip(loop, comps[entry], comps) == 18


def test_a_loop_with_a_traced_bound_has_no_trip_count():
    text = PEELED.replace("%k = s32[] constant(19)", "%k = s32[] parameter(1)")
    comps, entry = hlo.parse(text)
    (loop,) = [i for i in comps[entry] if i.op == "while"]
    assert trips.trip(loop, comps[entry], comps) is None


def test_a_collective_in_that_loop_counts_every_run():
    assert {w.runs for w in overlap.windows(PEELED)} == {18}


def test_a_window_knows_the_devices_its_collective_spans():
    ws = {w.kind: w for w in overlap.windows(PEELED)}
    assert (ws["reduce-scatter"].span, ws["reduce-scatter"].size) == (193, 4)
    assert (ws["all-gather"].span, ws["all-gather"].size) == (64, 64)


def test_each_collective_is_timed_at_the_link_its_group_spans():
    ws = overlap.windows(PEELED)  # reduce-scatter: a 4-byte shard, 12 bytes sent per run
    slow_wide = lambda span: 1.0 if span > 64 else 1e6  # noqa: E731
    rs = overlap.hidden(ws, "reduce-scatter", slow_wide, 1.0, devices=256)
    ag = overlap.hidden(ws, "all-gather", slow_wide, 1.0, devices=256)
    assert rs["comm_s"] == pytest.approx(18 * 12.0)
    assert ag["comm_s"] == pytest.approx(18 * 1024 * 63 / 64 / 1e6)


@pytest.mark.parametrize(
    "kind,size,sent",
    [
        ("all-gather", 4, 75.0),
        ("all-to-all", 4, 75.0),
        ("reduce-scatter", 4, 300.0),
        ("all-reduce", 4, 150.0),
    ],
)
def test_each_kind_sends_what_a_ring_of_its_group_sends(kind, size, sent):
    w = overlap.Window(kind, 100, 0, 0, 0.0, 1, span=193, size=size)
    assert overlap.traffic(w, devices=256) == pytest.approx(sent)


def test_a_group_of_every_device_takes_the_jobs_device_count():
    w = overlap.Window("all-reduce", 100, 0, 0, 0.0, 1)
    assert overlap.traffic(w, devices=8) == pytest.approx(2 * 100 * 7 / 8)


@pytest.mark.parametrize(
    "attrs,group",
    [
        ("replica_groups={{0,1},{2,3}}, dimensions={0}", (0, 1)),
        ("replica_groups=[2,4]<=[8], dimensions={0}", (0, 1, 2, 3)),
        ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", (0, 4)),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}", (0, 4)),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, x", (0, 1, 2, 3)),
        ("replica_groups={}, dimensions={0}", None),
        ("source_target_pairs={{0,1}}", None),
    ],
)
def test_the_first_replica_group_is_read_in_each_of_xlas_forms(attrs, group):
    assert groups.first_group(attrs) == group


def _row_of(w: overlap.Window, step: bool) -> list[str]:
    from moe_train.planner.compile import report

    return [r for r, (kinds, keep) in report.rows(256, 64, step).items() if w.kind in kinds and keep(w)]


@pytest.mark.parametrize(
    "kind,span,size,row",
    [
        ("all-gather", 64, 64, "gather_group"),
        ("all-gather", 193, 4, "gather_data"),
        ("reduce-scatter", 64, 64, "reduce_scatter_group"),
        ("reduce-scatter", 193, 4, "reduce_scatter_data"),
        ("all-reduce", 193, 4, "all_reduce"),
        ("all-reduce", 256, 256, "all_reduce_every_device"),
        ("all-reduce", 0, 0, "all_reduce_every_device"),
    ],
)
def test_the_report_puts_each_step_mode_collective_in_the_models_part(kind, span, size, row):
    assert _row_of(overlap.Window(kind, 8, 0, 0, 0.0, 1, span=span, size=size), step=True) == [row]


def test_in_micro_batch_mode_every_gather_and_reduce_scatter_is_fsdp():
    ws = [overlap.Window(k, 8, 0, 0, 0.0, 1, span=193, size=4) for k in ("all-gather", "reduce-scatter")]
    assert [_row_of(w, step=False) for w in ws] == [["fsdp"], ["fsdp"]]


def test_the_report_has_a_row_for_each_part_of_the_step_time_model():
    from moe_train.planner import steptime
    from moe_train.planner.compile import report

    assert set(steptime.STEP_PARTS) <= set(report.rows(256, 64, step=True))
