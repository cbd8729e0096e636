"""Checkpoint interop with Hugging Face: ``python -m moe_train.convert from-hf|to-hf``.

* ``from_hf.from_hf(HF_DIR, OUT)``: a Mixtral, Qwen3-MoE or DeepSeek-V3 checkpoint (config.json
  and safetensors shards, with or without an index; DeepSeek-V3's fp8 block-scaled weights are
  dequantized) -> ``OUT/preset.toml`` + ``OUT/weights/`` (orbax), streamed tensor by tensor.
* ``to_hf.to_hf(CKPT, HF_OUT)``: a converted checkpoint, a run or one step -> config.json and
  sharded ``model-*.safetensors`` with ``model.safetensors.index.json`` that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads, every tensor in its stored
  dtype (or all cast with ``--dtype bf16|fp32``).

``families`` maps the configs both ways, ``tensors`` the tensor names and layouts,
``hf_files`` reads and writes the files. Train from converted weights with
``--set train.init_from=OUT``; score any of them with ``python -m moe_train.score``.

``weights`` finds and restores model weights wherever they are kept (a converted checkpoint,
a run, one step); ``score`` scores token ids (``python -m moe_train.score``).

May import: ``moe_train.base`` (exit codes), ``moe_train.config``, ``moe_train.model``,
``moe_train.parallel`` and ``moe_train.checkpoints`` (to read runs, verified). Never the
training loop (it imports ``weights`` for ``train.init_from``), the launcher, the planners or
the benchmarks.
"""
