"""The image tokenizer that ships with the package (tokenizer/pretrained.py) and the script that made it.

The shipped weights are the experiment's TF arm trained on its generated digits; served through the same path as
/v1/images/* (PNG bytes -> tokenize -> detokenize -> PNG), held-out generated images come back at the input's size
and at the PSNR the experiment reports for that arm (docs/results/tokenizer.md, section 4: TF 18.60 +- 0.12 dB over
3 seeds; this checkpoint, seed 0: 18.47 dB in float on all of split C)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.timeout(300)

EXPERIMENT_TF_PSNR_DB = 18.60  # docs/results/tokenizer.md section 4, arm TF, seeds 0-2
EXPERIMENT_TF_PSNR_STD_DB = 0.12


def _png(img_CHW: torch.Tensor) -> tuple[bytes, np.ndarray]:
    arr = ((img_CHW.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue(), arr.astype(np.float32)


def test_the_default_service_round_trips_held_out_images_at_the_experiments_psnr(tmp_path):
    from tokenflow_ray.tokenizer.experiment.arms import ArmSpec, arm_config
    from tokenflow_ray.tokenizer.experiment.default_tokenizer import (
        RECIPE,
        held_out_images,
        round_trip_figure,
        served_round_trip,
    )
    from tokenflow_ray.tokenizer.service import ImageTokenizerService

    service = ImageTokenizerService()  # no directory: the packaged one
    assert service.model.config == arm_config(ArmSpec("TF"), RECIPE.side, RECIPE.codebook_size, RECIPE.usage_window)
    images = held_out_images()
    assert images.shape[1:] == (3, 16, 16)
    _, original = _png(images[0])
    tok = service.tokenize(_png(images[0])[0])
    assert tok["size"] == tok["original_size"] == [16, 16]  # back at the size it came in
    trip = served_round_trip(images[::10])  # 216 of split C's 2160: other source drawings than training saw
    assert all(b.shape == o.shape == original.shape for b, o in zip(trip.returned, trip.originals))
    mean = float(np.mean(trip.psnr_db))
    # Within 3 standard deviations of the experiment's mean (one seed, 8-bit PNGs in and out): 18.24-18.96 dB.
    assert abs(mean - EXPERIMENT_TF_PSNR_DB) <= 3 * EXPERIMENT_TF_PSNR_STD_DB, mean
    assert round_trip_figure(trip, tmp_path / "trip.png").stat().st_size > 1000


def test_a_random_tokenizer_of_the_same_shape_is_far_below(tmp_path):
    """What the check above tells apart: the same architecture untrained (what served before) scores far less."""
    from tokenflow_ray.tokenizer.experiment.arms import ArmSpec, arm_config
    from tokenflow_ray.tokenizer.experiment.default_tokenizer import RECIPE, held_out_images
    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer
    from tokenflow_ray.tokenizer.service import ImageTokenizerService

    torch.manual_seed(0)
    DualCodebookTokenizer(arm_config(ArmSpec("TF"), RECIPE.side, RECIPE.codebook_size,
                                     RECIPE.usage_window)).save_pretrained(tmp_path)
    service = ImageTokenizerService(str(tmp_path))
    data, original = _png(held_out_images()[0])
    back = np.asarray(Image.open(io.BytesIO(service.detokenize(service.tokenize(data)["indices"]))), np.float32)
    assert 10 * np.log10(255.0 ** 2 / ((back - original) ** 2).mean()) < 14.0


def test_the_training_script_writes_a_loadable_tokenizer_and_scores_split_c(tmp_path):
    """The recipe end to end at a few steps (the shipped run: docs/results/runs/tokenizer_default_train.json)."""
    from dataclasses import replace

    from tokenflow_ray.tokenizer.experiment.default_tokenizer import RECIPE, train_default
    from tokenflow_ray.tokenizer.service import ImageTokenizerService

    result = train_default(replace(RECIPE, copies=1, teacher_steps=3, steps=3), tmp_path / "tok")
    assert result["held_out"] == "split C" and result["held_out_images"] > 0
    assert set(result["scores_c"]) >= {"psnr", "ssim", "digit_acc", "usage"}
    service = ImageTokenizerService(str(tmp_path / "tok"))
    assert service.side == RECIPE.side
