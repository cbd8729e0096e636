"""Value tables shared by the config's validation (``moe_train.config.schema.CHOICES``) and the
code that acts on the values, kept here once."""

from __future__ import annotations

SCORE_FUNCTIONS = ("softmax", "sigmoid")  # moe.score_function: how router logits become scores
BACKENDS = ("auto", "tiled", "ragged_dot", "mgpu", "te", "megablox")  # moe.backend: grouped-GEMM backends
