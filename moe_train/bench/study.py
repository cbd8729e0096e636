"""``make study``: does dropless MoE deliver what MoE promises? Side by side on the shipped corpus.

The shipped English corpus (``moe_train/assets/corpus.txt``, blank-line-separated paragraphs)
is prepared with a byte-level BPE of 512 tokens trained on it here (``tokenizers``), a tenth
of the paragraphs held out (``python -m moe_train.data prepare``'s code). Then every variant
trains for the same tokens (same batches, same schedule, same seeds) and is evaluated on the
same held-out batches every ``EVAL_EVERY`` steps (``train.eval_every``):

* ``dropless``: this kit's MoE (the ``tiny`` shape: 8 experts of 128, top-2);
* ``capacity-1.0``, ``capacity-1.25``: the same MoE through the GShard-style baseline that
  drops assignments past factor x the balanced load (``study.capacity_factor``);
* ``aux-free``: the dropless MoE balanced by the expert bias (``moe.bias_update_rate``)
  instead of the auxiliary loss;
* ``dense-active``: a dense SwiGLU model of the MoE's active width (top_k x 128), the same
  FLOPs per token;
* ``dense-total``: a dense model of the MoE's total expert width (8 x 128), the same
  parameters.

Each variant runs with ``SEEDS`` seeds (initialisation and batch order); the table gives the
final held-out loss as mean and standard deviation over seeds, and the curves their means.
It writes ``runs/study/<UTC>/results.{json,md}`` and ``curves.png``. 16 minutes on this 2-core
VM (``STEPS`` steps of 16 x 128 tokens per run, 18 runs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from moe_train import config
from moe_train.config.cli import utc_stamp
from moe_train.data import KIT_ROOT, prepare
from moe_train.model import flops

CORPUS = KIT_ROOT / "moe_train" / "assets" / "corpus.txt"
STEPS, EVAL_EVERY, SEEDS = 300, 50, (0, 1, 2)
BASE = [
    "model.vocab_size=512",
    "train.batch_size=16",
    "train.seq_len=128",
    "train.log_every=100000",
    "optim.lr=3e-3",
    "optim.warmup_steps=20",
    "train.telemetry_interval_s=0",
    "train.tensorboard=false",
    "train.eval_tokens=8192",
]
VARIANTS = {
    "dropless": [],
    "capacity-1.0": ["study.capacity_factor=1.0"],
    "capacity-1.25": ["study.capacity_factor=1.25"],
    "aux-free": ["moe.aux_loss_coef=0", "moe.bias_update_rate=0.01"],
    "dense-active": ["model.first_dense_layers=2", "model.dense_ffn=256"],  # top_k x 128
    "dense-total": ["model.first_dense_layers=2", "model.dense_ffn=1024"],  # 8 x 128
}


def prepare_corpus(out: Path) -> Path:
    """The shipped corpus tokenized with a 512-token BPE trained on it, 10% held out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        [str(CORPUS)],
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    data = out / "corpus"
    prepare.run(
        prepare.Options(
            tokenizer=str(out / "tokenizer"), inputs=(str(CORPUS),), out=data, val_fraction=0.1, workers=1
        ),
        log=lambda s: None,
    )
    return data


def variant_config(name: str, data: Path, seed: int, steps: int) -> config.Config:
    return config.build(
        "tiny",
        [
            *BASE,
            *VARIANTS[name],
            "data.source=prepared",
            f"data.path={data}",
            f"train.steps={steps}",
            f"train.eval_every={EVAL_EVERY}",
            f"train.seed={seed}",
            f"data.seed={seed}",
            "parallel.devices=1",
        ],
    )


def train_one(cfg: config.Config, out: Path) -> list[dict]:
    from moe_train.train.loop import EXIT_OK, run  # orbax, optax: after the arguments are checked

    if run(cfg, out, log=lambda s: None) != EXIT_OK:
        raise RuntimeError(f"study run {out} did not finish")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(name: str, cfg: config.Config, runs: list[list[dict]]) -> dict:
    """One variant's row: parameters, final held-out loss over seeds, drops, curve."""
    finals = [[r for r in recs if "eval_loss" in r][-1]["eval_loss"] for recs in runs]
    steps = sorted({r["step"] for r in runs[0] if "eval_loss" in r})
    curve = [
        statistics.mean(next(r["eval_loss"] for r in recs if r["step"] == s) for recs in runs) for s in steps
    ]
    assigned = (
        cfg.train.batch_size
        * cfg.train.seq_len
        * cfg.moe.top_k
        * (cfg.model.num_layers - cfg.model.first_dense_layers)
    )
    dropped = [statistics.mean(r["dropped_tokens"] for r in recs) for recs in runs]
    counts = flops.param_counts(cfg)
    return {
        "variant": name,
        "total_params": counts["total"],
        "active_params": counts["active"],
        "train_flops_per_token": flops.train_flops_per_token(cfg),
        "eval_loss_mean": statistics.mean(finals),
        "eval_loss_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "eval_losses": finals,
        "drop_rate": statistics.mean(dropped) / assigned if assigned else 0.0,
        "train_loss_final": statistics.mean(recs[-1]["loss"] for recs in runs),
        "curve_steps": steps,
        "curve": curve,
    }


def markdown(rows: list[dict], steps: int, seeds: int, seconds: float) -> str:
    lines = [
        f"# Study: {steps} steps of 16 x 128 tokens, {seeds} seeds, {seconds / 60:.1f} min",
        "",
        "| variant | total params | active params | train GFLOP/token | held-out loss "
        "(mean ± std) | drop rate | train loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['total_params'] / 1e6:.2f}M | "
            f"{r['active_params'] / 1e6:.2f}M | {r['train_flops_per_token'] / 1e9:.4f} | "
            f"{r['eval_loss_mean']:.4f} ± {r['eval_loss_std']:.4f} | "
            f"{100 * r['drop_rate']:.1f}% | {r['train_loss_final']:.4f} |"
        )
    lines += ["", "![held-out loss curves, mean over seeds](curves.png)"]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        ax.plot(r["curve_steps"], r["curve"], marker=".", label=r["variant"])
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moe_train.study", description=(__doc__ or "").partition("\n")[0]
    )
    p.add_argument("--out", default="runs/study", help="parent of the <UTC> result directory")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--seeds", type=int, default=len(SEEDS))
    args = p.parse_args(argv)
    stamp = utc_stamp()
    out = Path(args.out) / stamp
    t0 = time.perf_counter()
    data = prepare_corpus(out)
    rows = []
    for name in VARIANTS:
        cfgs = [variant_config(name, data, seed, args.steps) for seed in range(args.seeds)]
        runs = [train_one(c, out / "runs" / f"{name}-seed{seed}") for seed, c in enumerate(cfgs)]
        rows.append(summarize(name, cfgs[0], runs))
        print(
            f"{name}: held-out loss {rows[-1]['eval_loss_mean']:.4f} ± "
            f"{rows[-1]['eval_loss_std']:.4f} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    seconds = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    text = markdown(rows, args.steps, args.seeds, seconds)
    (out / "results.md").write_text(text)
    plot(rows, out / "curves.png")
    print(text + f"\nwritten: {out}/results.md, results.json, curves.png")
    return 0 if all(math.isfinite(r["eval_loss_mean"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
