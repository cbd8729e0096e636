"""The megablox tile sweep (``python -m moe_train.bench --accel --tune``): its rows, its choice
and the table it writes, at toy sizes on CPU (Pallas interpret mode)."""

import dataclasses
import json

import pytest

from moe_train.bench import tiles
from moe_train.moe import megablox
from moe_train.moe.routings import MoEShape

SHAPE = MoEShape(64, 128, 256, 4, 2)


def _row(kind, kn, tile, secs, model="m"):
    k, n = map(int, kn.split("x"))
    return dict(model=model, kind=kind, k=k, n=n, tile=list(tile), median_s=secs)


def test_the_gemms_the_backend_runs_cover_the_three_kinds_twice():
    kinds = [g.kind for g in tiles.gemms(SHAPE) if g.runs]
    assert sorted(kinds) == sorted(megablox.KINDS * 2)


def test_the_sweep_times_the_fused_gate_gemm_beside_the_two_apart():
    fwd = {(g.k, g.n, g.runs) for g in tiles.gemms(SHAPE) if g.kind == "fwd"}
    assert {(SHAPE.hidden, 2 * SHAPE.ffn, False), (SHAPE.hidden, SHAPE.ffn, True)} <= fwd


def test_a_gemm_the_backend_does_not_run_gets_no_tile():
    rows = [dict(_row("fwd", "128x512", (64, 128, 256), 1.0), runs=False)]
    assert tiles.best(rows) == {}


def test_the_sweep_covers_the_step_benchmark_s_experts():
    from moe_train.bench import accel_step

    moe = accel_step.configs(accel_step.FULL)["moe"]
    step = dict(tiles.FULL.shapes)["accel-step-moe"]
    tokens = moe.train.batch_size * moe.train.seq_len
    assert (step.tokens, step.hidden, step.ffn, step.experts, step.top_k) == (
        tokens,
        moe.model.hidden,
        moe.moe.expert_ffn,
        moe.moe.num_experts,
        moe.moe.top_k,
    )


def test_the_fastest_tile_wins():
    rows = [_row("fwd", "128x512", (64, 128, 256), 2.0), _row("fwd", "128x512", (128, 128, 128), 1.0)]
    assert tiles.best(rows) == {"fwd": {"128x512": [128, 128, 128]}}


def test_the_choice_sums_over_models_sharing_a_gemm():
    rows = [
        _row("fwd", "128x512", (64, 128, 256), 1.0, "a"),
        _row("fwd", "128x512", (128, 128, 128), 1.5, "a"),
        _row("fwd", "128x512", (64, 128, 256), 3.0, "b"),
        _row("fwd", "128x512", (128, 128, 128), 1.0, "b"),
    ]
    assert tiles.best(rows)["fwd"]["128x512"] == [128, 128, 128]


def test_a_tile_that_does_not_compile_is_listed_with_its_error():
    shape = MoEShape(512, 128, 256, 4, 2)  # row tile 64 (1,024 rows over 4 experts, / 4)
    s = dataclasses.replace(tiles.TINY, candidates=((48, 128, 128),))  # 48 does not divide 1,024 rows
    rows = tiles.gemm_rows("tiny", shape, tiles.gemms(shape)[1], s)
    assert rows and "divisible" in rows[0]["error"]


def test_writing_keeps_the_other_devices_tiles(tmp_path):
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tiles": {"TPU v9": {"fwd": {"1x1": [1, 1, 1]}}}, "measured": []}))
    tiles.write_table(path, "cpu", {"fwd": {"2x2": [8, 128, 128]}}, {"commit": "abc"})
    assert set(json.loads(path.read_text())["tiles"]) == {"TPU v9", "cpu"}


def test_writing_records_where_the_tiles_come_from(tmp_path):
    path = tmp_path / "tiles.json"
    tiles.write_table(path, "cpu", {}, {"commit": "abc", "date": "2026-12-06"})
    assert json.loads(path.read_text())["measured"] == [
        {"commit": "abc", "date": "2026-12-06", "device_kind": "cpu", "shapes": []}
    ]


def test_a_sweep_of_other_shapes_keeps_the_earlier_tiles(tmp_path):
    path = tmp_path / "tiles.json"
    tiles.write_table(path, "cpu", {"fwd": {"2x2": [8, 128, 128]}}, {"commit": "a"})
    tiles.write_table(path, "cpu", {"fwd": {"4x4": [16, 128, 128]}, "drhs": {"4x4": [8, 128, 128]}}, {})
    fwd = json.loads(path.read_text())["tiles"]["cpu"]["fwd"]
    assert fwd == {"2x2": [8, 128, 128], "4x4": [16, 128, 128]}


def test_a_sweep_takes_over_the_provenance_of_the_shapes_it_measured_again(tmp_path):
    path = tmp_path / "tiles.json"
    tiles.write_table(path, "cpu", {"fwd": {"2x2": [8, 128, 128], "4x4": [8, 128, 128]}}, {"commit": "a"})
    tiles.write_table(path, "cpu", {"fwd": {"4x4": [16, 128, 128]}}, {"commit": "b"})
    measured = json.loads(path.read_text())["measured"]
    assert [(m["commit"], m["shapes"]) for m in measured] == [("a", ["fwd:2x2"]), ("b", ["fwd:4x4"])]


def test_the_recorded_command_names_no_output_folder():
    from moe_train.bench.__main__ import without_out

    argv = ["--accel", "--tune", "--out", "/root/out", "--write-tiles", "--out=/tmp/x"]
    assert without_out(argv) == ["--accel", "--tune", "--write-tiles"]


@pytest.mark.slow
def test_the_tiny_sweep_writes_a_tile_for_every_gemm_the_backend_runs(tmp_path):
    path = tmp_path / "tiles.json"
    tiles.run(tiles.TINY, say=lambda line: None, write=path)
    written = json.loads(path.read_text())["tiles"]["cpu"]
    assert {kind: len(v) for kind, v in written.items()} == {"fwd": 2, "dlhs": 2, "drhs": 2}


@pytest.mark.slow
def test_missing_only_sweeps_the_gemms_the_table_lacks(monkeypatch):
    g_fwd = tiles.gemms(tiles.TINY.shapes[0][1])[0]
    have = {"cpu": {g_fwd.kind: {f"{g_fwd.k}x{g_fwd.n}": [64, 128, 256]}}}
    monkeypatch.setattr(megablox, "load_table", lambda: have)
    rows = tiles.run(tiles.TINY, say=lambda line: None, missing_only=True)["rows"]
    skipped = {r["gemm"] for r in rows if r.get("skipped") == "in the table already"}
    assert skipped == {
        g.name for g in tiles.gemms(SHAPE) if (g.kind, g.k, g.n) == (g_fwd.kind, g_fwd.k, g_fwd.n)
    }


def test_missing_needs_tune(capsys):
    code, line = _refusal(capsys, "--accel", "--missing")
    assert code == 2 and "--missing only applies to --accel --tune" in line


def _refusal(capsys, *argv):
    from moe_train.bench.__main__ import parse

    with pytest.raises(SystemExit) as exit_:
        parse(list(argv))
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def test_tune_needs_accel(capsys):
    code, line = _refusal(capsys, "--tune")
    assert code == 2 and "--tune only applies to --accel" in line


def test_writing_tiles_needs_tune(capsys):
    code, line = _refusal(capsys, "--accel", "--write-tiles")
    assert code == 2 and "--write-tiles only applies to --accel --tune" in line


def test_routed_loads_count_every_row():
    shape = MoEShape(512, 64, 32, 32, 8)
    assert tiles.routed_loads(shape).sum() == 512 * 8


def test_routed_loads_are_not_balanced():
    """Balanced loads align every group to the tiles; a router's do not."""
    shape = MoEShape(512, 64, 32, 32, 8)
    assert len(set(tiles.routed_loads(shape).tolist())) > 1
