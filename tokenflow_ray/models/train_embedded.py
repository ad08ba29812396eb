"""Train the embedded model's weights once, offline, on the standard library's own text (see `embedded_corpus`).

    nice -n 10 python -m tokenflow_ray.models.train_embedded --work-dir .cache/train_embedded \
        --log docs/results/runs/embedded_lm_train.jsonl --out tokenflow_ray/models/weights/embedded-llama-10m.safetensors

Same shape as `EMBEDDED_SPEC` (the CPU benchmarks are measured on it), HF's LlamaForCausalLM as the trainer (the
serving model loads its checkpoint unchanged in meaning), one CPU thread by default: the box this was made on is
shared. Reproducible from the seed, the step count and the corpus digest the log records (the corpus depends on
the Python version). Resumable: the full state goes to --work-dir every --checkpoint-every steps and a rerun with
the same arguments continues from it. The shipped checkpoint is bf16 (half the bytes); it loads as the runtime
dtype.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    batch: int = 2
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1
    bf16_autocast: bool = True  # bf16 matmuls, fp32 master weights: about 1.6x the fp32 step rate on AVX512-BF16
    eval_every: int = 250
    eval_windows: int = 48  # held-out windows per periodic evaluation; the final one covers all of it
    checkpoint_every: int = 250

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len", "threads", "eval_every", "eval_windows", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps), got {self.warmup}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be > 0 and min_lr_ratio in [0, 1]")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine down to min_lr_ratio * lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenflow_ray.models.embedded import EMBEDDED_SPEC

    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in EMBEDDED_SPEC.items() if k not in ("architectures", "model_type")})
    return LlamaForCausalLM(config)


def held_out_bits_per_byte(model, held_out, seq_len: int, windows: int | None, autocast: bool) -> float:
    """Mean cross-entropy in bits over the held-out stream's byte targets (BOS/EOS targets are not bytes), in
    consecutive non-overlapping windows; `windows=None` covers the whole stream."""
    import numpy as np
    import torch

    total = (len(held_out) - 1) // seq_len
    n = total if windows is None else min(windows, total)
    nats, count = 0.0, 0
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for start in range(0, n, 8):
            rows = [held_out[w * seq_len: w * seq_len + seq_len + 1] for w in range(start, min(n, start + 8))]
            batch = torch.from_numpy(np.stack(rows))
            logits = model(input_ids=batch[:, :-1]).logits.float()
            targets = batch[:, 1:]
            mask = targets < 256
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                   reduction="none").view_as(targets)
            nats += float(ce[mask].sum())
            count += int(mask.sum())
    model.train()
    return nats / count / math.log(2)


def export_bf16(model, path: Path, metadata: dict) -> None:
    """The shipped checkpoint: HF parameter names, bf16, written atomically."""
    import torch
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, path)


def train(cfg: TrainConfig, work_dir: Path, log_path: Path, out: Path) -> dict:
    import numpy as np
    import torch

    from tokenflow_ray.models.embedded_corpus import build_corpus

    torch.set_num_threads(cfg.threads)
    corpus = build_corpus()
    model = build_model(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(cfg.seed)
    state_path = work_dir / "state.pt"
    step, wall_before, final_bpb = 0, 0.0, None
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state["config"] != asdict(cfg) or state["corpus_digest"] != corpus.digest:
            raise ValueError(f"{state_path} was made with other settings or another corpus; remove it to restart")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        step, wall_before = state["step"], state["wall_s"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("a")
    if step == 0:
        log.write(json.dumps({"event": "start", "config": asdict(cfg), "corpus_digest": corpus.digest,
                              "python": sys.version.split()[0], "torch": torch.__version__,
                              "train_bytes": len(corpus.train), "held_out_bytes": len(corpus.held_out),
                              "train_documents": corpus.train_documents,
                              "held_out_documents": corpus.held_out_documents,
                              "parameters": sum(p.numel() for p in model.parameters())}) + "\n")
    t0 = time.monotonic() - wall_before
    tokens_per_step = cfg.batch * cfg.seq_len
    model.train()
    while step < cfg.steps:
        starts = rng.integers(0, len(corpus.train) - cfg.seq_len - 1, size=cfg.batch)
        batch = torch.from_numpy(np.stack([corpus.train[s: s + cfg.seq_len + 1] for s in starts]))
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        record = {"step": step, "loss_nats": round(loss.item(), 4), "grad_norm": round(grad_norm, 3),
                  "lr": round(lr_at(cfg, step - 1), 6), "tokens": step * tokens_per_step,
                  "wall_s": round(time.monotonic() - t0, 1)}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            windows = None if step == cfg.steps else cfg.eval_windows
            record["held_out_bpb"] = round(held_out_bits_per_byte(model, corpus.held_out, cfg.seq_len, windows,
                                                                  cfg.bf16_autocast), 4)
            record["held_out_windows"] = "all" if windows is None else windows
            final_bpb = record["held_out_bpb"]
        if step % 10 == 0 or "held_out_bpb" in record:
            log.write(json.dumps(record) + "\n")
            log.flush()
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            work_dir.mkdir(parents=True, exist_ok=True)
            torch.save({"config": asdict(cfg), "corpus_digest": corpus.digest, "model": model.state_dict(),
                        "optimizer": opt.state_dict(), "rng": rng.bit_generator.state, "step": step,
                        "wall_s": time.monotonic() - t0}, work_dir / "state.tmp")
            os.replace(work_dir / "state.tmp", state_path)
            export_bf16(model, out, {"step": step, "corpus_digest": corpus.digest, "seed": cfg.seed,
                                     "tokens_seen": step * tokens_per_step})
    summary = {"event": "done", "steps": step, "tokens_seen": step * tokens_per_step,
               "wall_s": round(time.monotonic() - t0, 1), "corpus_digest": corpus.digest, "checkpoint": str(out),
               "held_out_bpb": final_bpb}
    log.write(json.dumps(summary) + "\n")
    log.close()
    return summary


def plot_training_log(log_path: Path, png: Path) -> Path:
    """The loss curve of a training log: train loss (bits/byte, every 10 steps) and held-out bits/byte."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "step" in r]
    held = [r for r in steps if "held_out_bpb" in r]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot([r["tokens"] / 1e6 for r in steps], [r["loss_nats"] / math.log(2) for r in steps], lw=0.8, alpha=0.6,
            label="train batch (bits/byte)")
    ax.plot([r["tokens"] / 1e6 for r in held], [r["held_out_bpb"] for r in held], "o-", label="held-out (bits/byte)")
    ax.set(xlabel="training tokens (millions of bytes)", ylabel="bits per byte", ylim=(0, 8.5),
           title="embedded 9.7M Llama on stdlib docstrings + pydoc topics")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=value)
        else:
            p.add_argument(flag, type=type(value), default=value)
    p.add_argument("--work-dir", type=Path, help="resumable training state")
    p.add_argument("--log", type=Path, required=True, help="JSON lines: the loss curve and held-out bits/byte")
    p.add_argument("--out", type=Path, help="the bf16 safetensors checkpoint to write")
    p.add_argument("--plot", type=Path, metavar="PNG", help="only plot --log's loss curve to PNG (no training)")
    args = vars(p.parse_args(argv))
    work_dir, log, out, plot = args.pop("work_dir"), args.pop("log"), args.pop("out"), args.pop("plot")
    if plot is not None:
        print(plot_training_log(log, plot))
        return 0
    if work_dir is None or out is None:
        p.error("--work-dir and --out are required to train")
    print(json.dumps(train(TrainConfig(**args), work_dir, log, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
