"""Export a training checkpoint to the tokenizer's save_pretrained directory (config.json + model.safetensors)."""

from __future__ import annotations

from pathlib import Path


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, use_ema: bool = True) -> Path:
    """`checkpoint` is a checkpoint folder or a run folder (its latest checkpoint is used). EMA weights by default:
    they are what a trained tokenizer is evaluated and served with."""
    from tokenflow_ray.tokenizer.training.checkpoint import (
        latest_checkpoint_dir,
        load_state,
        model_from_state,
    )

    state = load_state(latest_checkpoint_dir(checkpoint))
    model = model_from_state(state, use_ema=use_ema)
    model.save_pretrained(out_dir)
    return Path(out_dir)
