"""What `tokenflow serve` checks before it starts Ray: each failure is one line naming what to fix.

A replica finds these problems too, but only after Ray and Serve started and the replica's constructor ran, and
Serve then reports a page of nested tracebacks 15-20 s later. Checked here, in the driver:
- the model: a local directory exists, has a config.json of a supported architecture, and its tokenizer loads
  (the embedded model is written to the cache on first use, as the replicas would);
- the image tokenizer directory, when one is given, loads;
- every config value: ServeConfig and the engine config it builds validate themselves on construction.
A hub id (org/name) is left to the replicas, which download it where they run. What only a replica can know (its
device, its memory) it still reports itself: serve/lifecycle.py prints that one line.
"""

from __future__ import annotations

from pathlib import Path

from tokenflow_ray.serve.config import ServeConfig


def is_local_model(model: str) -> bool:
    """A filesystem path (or 'embedded'), as opposed to a hub id the replicas download."""
    from tokenflow_ray.engine.config import EMBEDDED_MODEL

    if model == EMBEDDED_MODEL:
        return True
    return Path(model).expanduser().exists() or model.startswith((".", "/", "~")) or model.count("/") != 1


def check_model(model: str) -> Path | None:
    """The model directory if it is local and usable; ValueError with one line otherwise; None for a hub id."""
    from tokenflow_ray.models.loader import load_hf_config, load_tokenizer, resolve_model_dir

    if not is_local_model(model):
        return None
    model_dir = resolve_model_dir(model)  # "model: '/no/such/dir' is not a model directory ..."
    try:
        load_hf_config(model_dir)
    except ValueError:  # already one line: "model: architecture 'gpt2' is not supported; ..."
        raise
    except Exception as exc:  # noqa: BLE001 - a broken config.json raises many kinds
        raise ValueError(f"model: {model_dir}/config.json cannot be read ({type(exc).__name__}: "
                         f"{_first_line(exc)})") from None
    try:
        load_tokenizer(model_dir)
    except Exception as exc:  # noqa: BLE001 - missing files, bad JSON, unknown tokenizer class
        raise ValueError(f"model: the tokenizer in {model_dir} does not load ({type(exc).__name__}: "
                         f"{_first_line(exc)})") from None
    return model_dir


def check_image_tokenizer(tokenizer_dir: str | None) -> None:
    if tokenizer_dir is None:
        return
    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer

    try:
        DualCodebookTokenizer.from_pretrained(Path(tokenizer_dir).expanduser())
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"tokenizer: {tokenizer_dir} is not a loadable image tokenizer ({type(exc).__name__}: "
                         f"{_first_line(exc)})") from None


def preflight(config: ServeConfig) -> None:
    """Raise ValueError (one line) for anything that would make every replica fail to start."""
    check_model(config.engine.model.model)
    if config.images:
        check_image_tokenizer(config.tokenizer_dir)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
