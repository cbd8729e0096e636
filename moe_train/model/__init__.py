"""The model: a decoder-only MoE transformer written against logical axis names.

* ``transformer``: the Flax modules (embedding, blocks, scanned layer groups, head) and the
  scanned <-> looped parameter layouts;
* ``layers``: weight use under FSDP, initialisers, RMSNorm, the dense SwiGLU MLP;
* ``attention/``: the causal attention kernels (XLA, chunked, cuDNN/TE) and the choice;
* ``mla``, ``mtp``, ``rope``: DeepSeek-V3's latent attention and multi-token prediction,
  rotary embeddings with YaRN;
* ``loss``: the chunked LM cross-entropy; ``precision`` (+ ``precision_te``): fp32, bf16
  and fp8 matmuls; ``remat``: activation checkpointing policies;
* ``settings``: ``ModelSettings``, what the modules read of a run's config (``model_settings(cfg)``:
  the model, moe, rope, precision and study sections and ``train.remat``), with the precision
  policy resolved once;
* ``flops``: parameter counts and FLOPs per token from the config alone (no JAX).

May import: ``moe_train.config``, ``moe_train.parallel``, ``moe_train.moe``,
``moe_train.data.packing`` (the batch representation). Never the training loop
(``moe_train.train``), the launcher (``slurm``), the planners (``moe_train.planner.memory``,
``topology``) or the benchmarks.
"""
