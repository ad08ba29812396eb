"""The training checkpoint format: one `state.pt` per Ray Train checkpoint directory.

It holds the generator (unwrapped from DDP), the discriminator, both optimisers, the EMA weights, the step, the data
position (epoch and batch within it), the loss curve so far and the training config, so a resumed run continues the
step count and the curve, and `export` can rebuild the model without the original YAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

STATE_NAME = "state.pt"
POSITION_NAME = "data_position.json"  # {step, samples}: read by the driver to build the resumed pipeline cheaply


@dataclass
class TrainState:
    step: int  # optimiser steps completed
    epoch: int  # data position: the pass over the dataset in progress
    batch_in_epoch: int  # batches of that pass already consumed
    model: dict
    opt_g: dict
    ema: dict | None = None  # parameter name -> EMA tensor (None when ema_decay = 0)
    disc: dict | None = None
    opt_d: dict | None = None
    curve: list = field(default_factory=list)  # [step, loss] per reported interval
    skipped_images: int = 0
    config: dict = field(default_factory=dict)  # TrainConfig.to_dict()
    samples: int = 0  # global samples consumed (all ranks): the indexed pipeline's data position


def save_state(directory: str | Path, state: TrainState) -> Path:
    import json

    import torch

    path = Path(directory) / STATE_NAME
    torch.save(state.__dict__, path)
    (Path(directory) / POSITION_NAME).write_text(json.dumps({"step": state.step, "samples": state.samples}))
    return path


def read_position(run_dir: str | Path) -> dict:
    """{step, samples} of the run's latest checkpoint, or zeros when there is none (a fresh run)."""
    import json

    try:
        ckpt = latest_checkpoint_dir(run_dir)
    except FileNotFoundError:
        return {"step": 0, "samples": 0}
    file = ckpt / POSITION_NAME
    return json.loads(file.read_text()) if file.is_file() else {"step": 0, "samples": 0}


def load_state(directory: str | Path) -> TrainState:
    import torch

    path = Path(directory) / STATE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a tokenizer training checkpoint (no {STATE_NAME})")
    # weights_only=False: the state holds plain dicts/lists next to tensors, written by this module only.
    return TrainState(**torch.load(path, map_location="cpu", weights_only=False))


def latest_checkpoint_dir(run_dir: str | Path) -> Path:
    """The newest `checkpoint_*` folder holding a state file, under a Ray Train run directory (or the folder itself)."""
    root = Path(run_dir).expanduser()
    if (root / STATE_NAME).is_file():
        return root
    found = sorted((p for p in root.glob("checkpoint_*") if (p / STATE_NAME).is_file()),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no training checkpoint under {root}")
    return found[-1]


def model_from_state(state: TrainState, use_ema: bool = True):
    """Rebuild the DualCodebookTokenizer from a training state (EMA weights when present and asked for)."""
    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer
    from tokenflow_ray.tokenizer.training.config import TrainConfig

    model = DualCodebookTokenizer(TrainConfig.from_dict(state.config).model)
    model.load_state_dict(state.model, strict=True)
    if use_ema and state.ema:
        params = dict(model.named_parameters())
        for name, value in state.ema.items():
            params[name].data.copy_(value)
    return model.eval()
