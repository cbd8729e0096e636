"""The memory planner against XLA:GPU on the model presets' own jobs.

Mixtral's: 8 h100-dgx nodes, EP 8,
the preset's one-sequence micro-batches (eight a step), weights gathered per micro-batch, one
overlap chunk. Compiled at reduced depth (4 and 8 layers; the compiles run the real ``python -m
moe_train.planner.compile`` in a subprocess and skip with the reason where the CUDA PJRT plugin is not
installed): the planner within 15% of XLA:GPU's peak at the 1x and the planned bucket, and
what four more layers add within 15% of what XLA:GPU adds, so that the full depth holds too (a
per-layer term the planner missed was 1.19x low at 32 layers and 1.07x at 4; docs/compile.md
has the full-depth figures).

Qwen3-30B-A3B's (the job its preset's comment names: 8 h100-dgx nodes, EP 8, one-sequence
micro-batches, weights gathered per micro-batch, one chunk), compiled at full depth (48 layers,
about a minute each): the planner within 15% at the 1x and the planned bucket. At 4 and 8
layers it errs high by 1.2-1.25x on a term that does not grow with depth (what XLA:GPU adds per
layer matches), so its reduced depth would not test the full job.
"""

from __future__ import annotations

import json

import pytest
from helpers import MIXTRAL_H100, run_module
from helpers import sets as sets_of

from moe_train.planner.compile import plugin

PROBLEM = plugin.version_problem(plugin.search_path())
needs_plugin = pytest.mark.skipif(PROBLEM is not None, reason=f"no CUDA PJRT plugin: {PROBLEM}")
PRESET_JOB = (
    *MIXTRAL_H100,
    *sets_of("train.micro_batch_size=1", "parallel.weight_gather=micro_batch", "moe.overlap_chunks=1"),
    "--json",
)
QWEN3_JOB = (
    *("--preset", "h100-dgx", "--model", "qwen3-30b-a3b", "--nodes", "8", "--ep", "8"),
    *sets_of("train.micro_batch_size=1", "parallel.weight_gather=micro_batch", "moe.overlap_chunks=1"),
    "--json",
)
BAND = (0.85, 1.15)  # XLA:GPU's peak over the planner's total


@pytest.fixture(scope="module")
def buckets(tmp_path_factory) -> dict[tuple[int, str], dict]:
    """(layers, bucket) -> the compile's bucket record: 4 layers at 1x and the planned
    bucket, 8 layers at 1x."""
    out = {}
    for layers, bucket in ((4, "1"), (4, "planned"), (8, "1")):
        parent = tmp_path_factory.mktemp(f"mixtral-{layers}-{bucket}")
        proc = run_module(
            "moe_train.planner.compile",
            *PRESET_JOB,
            *("--layers", str(layers), "--bucket", bucket, "--out", str(parent)),
            timeout=1200,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        (record,) = json.loads(proc.stdout)["buckets"]
        out[layers, "planned" if bucket == "planned" else record["bucket"]] = record
    return out


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("layers, bucket", [(4, "1"), (4, "planned"), (8, "1")])
def test_the_planner_is_within_15_percent_on_the_mixtral_presets_job(buckets, layers, bucket):
    record = buckets[layers, bucket]
    assert BAND[0] <= record["xla_over_planner"] <= BAND[1], record


@needs_plugin
@pytest.mark.slow
def test_what_more_layers_add_is_within_15_percent(buckets):
    """The per-layer terms, which full depth multiplies by 32."""
    four, eight = buckets[4, "1"], buckets[8, "1"]
    xla = eight["memory"]["peak"] - four["memory"]["peak"]
    planner = eight["planner"]["total"] - four["planner"]["total"]
    assert BAND[0] <= xla / planner <= BAND[1], (xla, planner)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> dict[str, dict]:
    """bucket ("1", "planned") -> the Qwen3 preset job's bucket record at full depth."""
    out = {}
    for bucket in ("1", "planned"):
        parent = tmp_path_factory.mktemp(f"qwen3-{bucket}")
        proc = run_module(
            "moe_train.planner.compile", *QWEN3_JOB, "--bucket", bucket, "--out", str(parent), timeout=1200
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        (out[bucket],) = json.loads(proc.stdout)["buckets"]
    return out


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("bucket", ["1", "planned"])
def test_the_planner_is_within_15_percent_on_the_qwen3_presets_job(qwen3, bucket):
    assert BAND[0] <= qwen3[bucket]["xla_over_planner"] <= BAND[1], qwen3[bucket]
