"""The memory planner against XLA:GPU on each model preset's own job and the README's searched
jobs: the planner within 15% of XLA:GPU's peak at the 1x and the planned bucket. The compiles
run the real ``python -m moe_train.planner.compile`` in a subprocess and skip with the reason
where the CUDA PJRT plugin is not installed; docs/compile.md has every figure.

- Mixtral's own job (8 h100-dgx nodes, EP 8, the preset's one-sequence micro-batches, weights
  gathered per micro-batch, one chunk) at 4 and 8 layers, and what four more layers add, so
  that the full depth holds too (a per-layer term the planner missed was 1.19x low at 32
  layers and 1.07x at 4).
- The README's Mixtral job (``make plan PRESET=h100-dgx MODEL=mixtral-8x7b NODES=8 EP=8``: the
  searched 8-sequence micro-batches) at full depth, about a minute each: at 4 layers the
  planner errs high by 1.2x.
- Qwen3-30B-A3B's own job (the same shape of job as Mixtral's) at full depth: at 4 and 8 layers
  the planner errs high by 1.2-1.25x on a term that does not grow with depth.
- DeepSeek-V3's own job (32 gb200-nvl72 nodes, EP 64, one-sequence micro-batches, weights
  gathered per micro-batch) at 4 layers (the planned bucket), 8 and 12 (1x), and what the four
  MoE layers from 8 to 12 add. Once the MoE layer loop runs twice or more, two layers'
  chunked-attention backward buffers are live (``estimate.attention_backward_bytes``; without
  them 1.18x and 1.15x low at 8 and 12 layers; 1.03x and 1.00x at full depth).
- The README's DeepSeek-V3 job (128 h100-dgx nodes, EP 128, weights gathered once per step,
  one-sequence micro-batches, one chunk) at full depth, about two minutes each: 0.90x at 1x
  and 0.85x at the planned 4x bucket, the band's edge. At 4 and 8 layers the planner errs high
  by 1.3x at the planned bucket: it counts six whole-vocabulary buffers beside the MoE layers'
  rows where XLA:GPU, in this job's MoE backward, holds two or three.
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
    "mixtral-readme": (*MIXTRAL_H100, "--json"),
    "qwen3": QWEN3_JOB,
    "deepseek": (
        *DEEPSEEK_32,
        *sets_of("train.micro_batch_size=1", "parallel.weight_gather=micro_batch"),
        "--json",
    ),
    "deepseek-readme": (
        *("--preset", "h100-dgx", "--model", "deepseek-v3", "--nodes", "128", "--ep", "128"),
        *sets_of("parallel.weight_gather=step", "train.micro_batch_size=1", "moe.overlap_chunks=1"),
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
        ("mixtral-readme", None, "1"),
        ("mixtral-readme", None, "planned"),
        ("qwen3", None, "1"),
        ("qwen3", None, "planned"),
        ("deepseek", 4, "planned"),
        ("deepseek", 8, "1"),
        ("deepseek", 12, "1"),
        ("deepseek-readme", None, "1"),
        ("deepseek-readme", None, "planned"),
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
    MoE layers)."""
    xla, planner = added(record, model, fewer, more)
    assert BAND[0] <= xla / planner <= BAND[1], (xla, planner)
