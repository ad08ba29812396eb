"""The image tokenizer that ships with the package, and where it lives.

`weights/digits-tf-16px`: the tokenizer experiment's TF arm (shared index, K 256, 16 px, one 4x4 scale) trained on
the experiment's colourised digits exactly as the experiment trains it, seed 0
(`python -m tokenflow_ray.tokenizer.experiment.default_tokenizer`, docs/results/tokenizer.md). It is what
`tokenflow serve` answers /v1/images/* with unless `--tokenizer DIR` names another.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_TOKENIZER_DIR = Path(__file__).parent / "weights" / "digits-tf-16px"


def default_tokenizer_dir() -> Path:
    if not (DEFAULT_TOKENIZER_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the packaged image tokenizer is missing from {DEFAULT_TOKENIZER_DIR}; reinstall "
                                "tokenflow_ray or pass --tokenizer DIR")
    return DEFAULT_TOKENIZER_DIR
