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

DeepSeek-V3's (its preset's one-sequence micro-batches on 32 gb200-nvl72 nodes, EP 64, the
weights gathered once per step, one chunk), at 4 layers (the planned bucket), 8 and 12 (1x):
the planner within 15%, and what four more MoE layers add from 8 to 12 layers within 15%
(from 4 to 8 XLA:GPU adds a one-time ~3 GiB as its layer loop gets a second iteration to
double-buffer; at full depth the planner is 0.99x, docs/compile.md).
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
DEEPSEEK_JOB = (
    *("--preset", "gb200-nvl72", "--model", "deepseek-v3", "--nodes", "32", "--ep", "64"),
    *sets_of("train.micro_batch_size=1", "parallel.weight_gather=step", "moe.overlap_chunks=1"),
    "--json",
)
BAND = (0.85, 1.15)  # XLA:GPU's peak over the planner's total


def compiled(factory, job: tuple[str, ...], runs) -> dict[tuple[int | None, str], dict]:
    """(layers, bucket) -> the bucket record of ``job`` compiled at each (layers, bucket) of
    ``runs`` (layers None: full depth)."""
    out = {}
    for layers, bucket in runs:
        depth = () if layers is None else ("--layers", str(layers))
        parent = factory.mktemp(f"{job[3]}-{layers}-{bucket}")
        proc = run_module(
            "moe_train.planner.compile", *job, *depth, "--bucket", bucket, "--out", str(parent), timeout=1200
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        (out[layers, bucket],) = json.loads(proc.stdout)["buckets"]
    return out


def added(records: dict, fewer: int, more: int) -> tuple[float, float]:
    """(XLA:GPU, planner): what going from ``fewer`` to ``more`` layers adds at 1x."""
    a, b = records[fewer, "1"], records[more, "1"]
    return b["memory"]["peak"] - a["memory"]["peak"], b["planner"]["total"] - a["planner"]["total"]


@pytest.fixture(scope="module")
def buckets(tmp_path_factory) -> dict[tuple[int | None, str], dict]:
    """Mixtral's job at 4 layers at 1x and the planned bucket, 8 layers at 1x."""
    return compiled(tmp_path_factory, PRESET_JOB, ((4, "1"), (4, "planned"), (8, "1")))


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
    xla, planner = added(buckets, 4, 8)
    assert BAND[0] <= xla / planner <= BAND[1], (xla, planner)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> dict[tuple[int | None, str], dict]:
    """The Qwen3 preset's job at full depth at 1x and the planned bucket."""
    return compiled(tmp_path_factory, QWEN3_JOB, ((None, "1"), (None, "planned")))


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("bucket", ["1", "planned"])
def test_the_planner_is_within_15_percent_on_the_qwen3_presets_job(qwen3, bucket):
    record = qwen3[None, bucket]
    assert BAND[0] <= record["xla_over_planner"] <= BAND[1], record


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> dict[tuple[int | None, str], dict]:
    """DeepSeek-V3's job at 4 layers at the planned bucket, 8 and 12 layers at 1x."""
    return compiled(tmp_path_factory, DEEPSEEK_JOB, ((4, "planned"), (8, "1"), (12, "1")))


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("layers, bucket", [(4, "planned"), (8, "1"), (12, "1")])
def test_the_planner_is_within_15_percent_on_the_deepseek_presets_job(deepseek, layers, bucket):
    record = deepseek[layers, bucket]
    assert BAND[0] <= record["xla_over_planner"] <= BAND[1], record


@needs_plugin
@pytest.mark.slow
def test_what_four_more_deepseek_layers_add_is_within_15_percent(deepseek):
    """Four MoE layers' terms (the stacked expert gradients XLA:GPU holds twice among them),
    which full depth multiplies by 14."""
    xla, planner = added(deepseek, 8, 12)
    assert BAND[0] <= xla / planner <= BAND[1], (xla, planner)
