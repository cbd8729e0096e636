"""moe_train.planner.compile.peak: XLA's live-at-peak buffers traced to their source scopes."""

from moe_train.planner.compile import peak

HLO = """HloModule jit_step

%fused_dus (param_0: f32[4,8], param_1: f32[8], param_2: s32[]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[8]{0} parameter(1)
  %bitcast.1 = f32[1,8]{1,0} bitcast(%param_1)
  %param_2 = s32[] parameter(2)
  %c0 = s32[] constant(0)
  ROOT %dus.1 = f32[4,8]{1,0} dynamic-update-slice(%param_0, %bitcast.1, %param_2, %c0), metadata={op_name="jit(step)/Transformer._blocks/while/body/dynamic_update_slice"}
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %act = f32[8]{0} fusion(%i), kind=kLoop, calls=%fused_act, metadata={op_name="jit(step)/jvp(Transformer)/Transformer._blocks/while/body/closed_call/moe_layers/attn/dot_general"}
  %dus_fusion.1 = f32[4,8]{1,0} fusion(%stack, %act, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(step)/Transformer._blocks/while/body/dynamic_update_slice"}
  ROOT %tuple.2 = (s32[], f32[4,8]{1,0}) tuple(%i, %dus_fusion.1)
}

ENTRY %main (param.1: f32[8,8]) -> f32[8,8] {
  %param.1 = f32[8,8]{1,0} parameter(0), metadata={op_name="state.params['attn']['q']"}
  %zero = f32[4,8]{1,0} broadcast(%c), dimensions={}, metadata={op_name="jit(step)/jvp(Transformer)/Transformer._blocks/broadcast_in_dim"}
  %tuple.1 = (s32[], f32[4,8]{1,0}) tuple(%c, %zero)
  %while.1 = (s32[], f32[4,8]{1,0}) while(%tuple.1), condition=%cond, body=%body
  %grad = f32[8,8]{1,0} fusion(%param.1), kind=kLoop, calls=%fused_grad
  ROOT %out = f32[8,8]{1,0} copy(%grad), metadata={op_name="jit(step)/transpose(jvp(Transformer))/moe_layers/attn/dot_general"}
}
"""  # noqa: E501  (HLO text as XLA prints it, one instruction a line)

LIVE = """Peak memory
  Live ranges at 7 (peak):
    while.1{1}: 128 bytes (cumulative: 128 bytes)
    param.1{}: 256 bytes (cumulative: 384 bytes)
    out{}: 256 bytes (cumulative: 640 bytes)
  Stack trace breakdown for peak usage: 640 bytes
"""


def test_the_peak_section_is_read_and_nothing_after_it():
    assert peak.live_at_peak(LIVE) == [("while.1", "{1}", 128), ("param.1", "{}", 256), ("out", "{}", 256)]


def test_a_loop_carry_is_named_by_what_the_body_stacks_into_it():
    got = peak.summarize(peak.live_at_peak(LIVE), HLO)
    assert ("stacked per layer: Transformer._blocks/moe_layers/attn: dot_general", 128, 1) in got.scopes


def test_state_arguments_are_grouped_by_kind():
    got = peak.summarize(peak.live_at_peak(LIVE), HLO)
    assert ("state: parameters", 256, 1) in got.scopes


def test_a_transposed_op_is_marked_backward():
    assert peak.scope_of("jit(step)/transpose(jvp(Transformer))/moe_layers/attn/dot_general") == (
        "moe_layers/attn: dot_general (backward)"
    )


def test_scopes_sum_to_the_live_bytes_largest_first():
    got = peak.summarize(peak.live_at_peak(LIVE), HLO)
    assert got.live_bytes == 640 == sum(b for _, b, _ in got.scopes)
    assert [b for _, b, _ in got.scopes] == sorted((b for _, b, _ in got.scopes), reverse=True)


def test_the_printed_lines_show_each_scope_and_its_share():
    text = "\n".join(peak.lines(peak.summarize(peak.live_at_peak(LIVE), HLO).record()))
    assert "40.0%" in text and "state: parameters" in text and "MiB" in text
