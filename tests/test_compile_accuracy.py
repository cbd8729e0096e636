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
double-buffer; at full depth the planner is 0.99x, docs/compile.md); and the preset's own
``micro_batch`` job at 4 layers, the planned bucket (1.04x and 1.01x at full depth).
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
DEEPSEEK_32 = ("--preset", "gb200-nvl72", "--model", "deepseek-v3", "--nodes", "32", "--ep", "64")
DEEPSEEK_JOB = (
    *DEEPSEEK_32,
    *sets_of("train.micro_batch_size=1", "parallel.weight_gather=step", "moe.overlap_chunks=1"),
    "--json",
)
BAND = (0.85, 1.15)  # XLA:GPU's peak over the planner's total


def compiled(parent, job: tuple[str, ...], layers: int | None, bucket: str) -> dict:
    """The bucket record of ``job`` compiled at ``layers`` (None: full depth), one bucket."""
    depth = () if layers is None else ("--layers", str(layers))
    proc = run_module(
        "moe_train.planner.compile", *job, *depth, "--bucket", bucket, "--out", str(parent), timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (found,) = json.loads(proc.stdout)["buckets"]
    return found


def added(record, model: str, fewer: int, more: int) -> tuple[float, float]:
    """(XLA:GPU, planner): what going from ``fewer`` to ``more`` layers adds at 1x."""
    a, b = record(model, fewer, "1"), record(model, more, "1")
    return b["memory"]["peak"] - a["memory"]["peak"], b["planner"]["total"] - a["planner"]["total"]


JOBS = {
    "mixtral": PRESET_JOB,
    "qwen3": QWEN3_JOB,
    "deepseek": DEEPSEEK_JOB,
    "deepseek-preset": (
        *DEEPSEEK_32,
        *sets_of("train.micro_batch_size=1", "parallel.weight_gather=micro_batch"),
        "--json",
    ),
}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """``record(model, layers, bucket)``: the bucket record of that model preset's job (JOBS)
    at that depth (None: full), compiled at its first use in this module."""
    cache: dict[tuple[str, int | None, str], dict] = {}

    def get(model: str, layers: int | None, bucket: str) -> dict:
        key = (model, layers, bucket)
        if key not in cache:
            parent = tmp_path_factory.mktemp(f"{model}-{layers}-{bucket}")
            cache[key] = compiled(parent, JOBS[model], layers, bucket)
        return cache[key]

    return get


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize(
    "model, layers, bucket",
    [
        ("mixtral", 4, "1"),
        ("mixtral", 4, "planned"),
        ("mixtral", 8, "1"),
        ("qwen3", None, "1"),
        ("qwen3", None, "planned"),
        ("deepseek", 4, "planned"),
        ("deepseek", 8, "1"),
        ("deepseek", 12, "1"),
        ("deepseek-preset", 4, "planned"),
    ],
)
def test_the_planner_is_within_15_percent_on_the_presets_job(record, model, layers, bucket):
    found = record(model, layers, bucket)
    assert BAND[0] <= found["xla_over_planner"] <= BAND[1], found


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("model, fewer, more", [("mixtral", 4, 8), ("deepseek", 8, 12)])
def test_what_more_layers_add_is_within_15_percent(record, model, fewer, more):
    """The per-layer terms, which full depth multiplies (Mixtral's 32 layers, DeepSeek-V3's 58
    MoE layers: the stacked expert gradients XLA:GPU holds twice among them)."""
    xla, planner = added(record, model, fewer, more)
    assert BAND[0] <= xla / planner <= BAND[1], (xla, planner)
