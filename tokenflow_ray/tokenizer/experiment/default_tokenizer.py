"""Train the image tokenizer `tokenflow serve` uses by default: the experiment's TF arm, exactly as the experiment
trains and scores it (colourised digits at 16 px, the seed's teacher, shared index, K 256), saved as a
`save_pretrained` folder that ships with the package (tokenflow_ray/tokenizer/weights/).

    nice -n 10 python -m tokenflow_ray.tokenizer.experiment.default_tokenizer \
        --out tokenflow_ray/tokenizer/weights/digits-tf-16px --json docs/results/runs/tokenizer_default_train.json

Split A trains the teacher and the tokenizer; split C (other source drawings) is held out and scored, so the
PSNR recorded is the one the experiment reports for this arm and seed. `held_out_images` rebuilds that split
(the generator is deterministic in its seed) for tests and for the serving check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class DefaultTokenizerRecipe:
    dataset: str = "digits"
    seed: int = 0
    side: int = 16
    copies: int = 6
    codebook_size: int = 256
    usage_window: int = 8192
    teacher_steps: int = 300  # the experiment's digits budget (teacher.TEACHER_STEPS)
    steps: int = 250  # the experiment's tokenizer steps per arm (batch 64)
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("side", "copies", "codebook_size", "usage_window", "teacher_steps", "steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


RECIPE = DefaultTokenizerRecipe()


def held_out_images(recipe: DefaultTokenizerRecipe = RECIPE):
    """Split C of the recipe's generated data: N x 3 x side x side in [-1, 1], never seen in training."""
    from tokenflow_ray.tokenizer.experiment.data import make_data

    return make_data(recipe.dataset, recipe.seed, copies=recipe.copies, side=recipe.side).c.images_NCHW


@dataclass(frozen=True)
class RoundTrip:
    psnr_db: list[float]  # per image, on 8-bit pixels
    originals: list  # H x W x 3 uint8 arrays, as sent
    returned: list  # as the service gave them back


def served_round_trip(images_NCHW, model_dir: str | None = None) -> RoundTrip:
    """Each image as a PNG through the serving path (ImageTokenizerService: the preprocessing, tokenize,
    detokenize and PNG encoding that /v1/images/* run), compared with what was sent."""
    import io

    import numpy as np
    from PIL import Image

    from tokenflow_ray.tokenizer.service import ImageTokenizerService

    service = ImageTokenizerService(model_dir)
    psnr, originals, returned = [], [], []
    for x in images_NCHW:
        arr = ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "PNG")
        back = np.asarray(Image.open(io.BytesIO(service.detokenize(service.tokenize(buf.getvalue())["indices"]))))
        mse = float(((back.astype(np.float64) - arr) ** 2).mean())
        psnr.append(10 * float(np.log10(255.0 ** 2 / max(mse, 1e-10))))
        originals.append(arr)
        returned.append(back)
    return RoundTrip(psnr, originals, returned)


def round_trip_figure(trip: RoundTrip, png: Path, columns: int = 12) -> Path:
    """Originals (top row) over what the service returned (bottom row), nearest-neighbour upscaled."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    n = min(columns, len(trip.originals))
    fig, axes = plt.subplots(2, n, figsize=(n * 0.9, 2.4), squeeze=False)
    for i in range(n):
        for row, img in enumerate((trip.originals[i], trip.returned[i])):
            axes[row][i].imshow(img, interpolation="nearest")
            axes[row][i].axis("off")
        axes[1][i].set_title(f"{trip.psnr_db[i]:.1f} dB", fontsize=7, y=-0.32)
    fig.suptitle("held-out generated digits (top) through /v1/images tokenize -> detokenize (bottom)", fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def train_default(recipe: DefaultTokenizerRecipe, out: Path) -> dict:
    from tokenflow_ray.tokenizer.experiment.arms import (
        ArmSpec,
        TrainSettings,
        arm_config,
        evaluate_arm,
        teacher_semantic_config,
        train_arm,
    )
    from tokenflow_ray.tokenizer.experiment.data import make_data
    from tokenflow_ray.tokenizer.experiment.teacher import train_teacher
    from tokenflow_ray.torch_threads import torch_threads

    t0 = time.perf_counter()
    with torch_threads(recipe.threads):
        data = make_data(recipe.dataset, recipe.seed, copies=recipe.copies, side=recipe.side)
        teacher = train_teacher(teacher_semantic_config(recipe.side), data.a, data.c, recipe.teacher_steps,
                                recipe.seed)
        cfg = arm_config(ArmSpec("TF"), recipe.side, recipe.codebook_size, recipe.usage_window)
        model = train_arm(cfg, teacher.tower, data, TrainSettings(steps=recipe.steps), recipe.seed)
        scores = evaluate_arm(model, data)
    model.save_pretrained(out)
    scores.pop("cluster_sizes")
    return {"recipe": asdict(recipe), "teacher_digit_acc_c": teacher.acc_c, "held_out": "split C",
            "held_out_images": len(data.c.images_NCHW), "scores_c": scores,
            "parameters": sum(p.numel() for p in model.parameters()), "train_s": time.perf_counter() - t0,
            "out": str(out)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the save_pretrained folder to write")
    p.add_argument("--json", type=Path, help="write the recipe and the held-out scores here")
    p.add_argument("--steps", type=int, default=RECIPE.steps)
    p.add_argument("--seed", type=int, default=RECIPE.seed)
    p.add_argument("--figure", type=Path, metavar="PNG",
                   help="only serve --out's tokenizer a held-out sample and draw it (no training)")
    args = p.parse_args(argv)
    from dataclasses import replace

    if args.figure is not None:
        trip = served_round_trip(held_out_images()[::10], str(args.out))
        print(json.dumps({"figure": str(round_trip_figure(trip, args.figure)), "images": len(trip.psnr_db),
                          "served_psnr_db_mean": sum(trip.psnr_db) / len(trip.psnr_db)}))
        return 0
    result = train_default(replace(RECIPE, steps=args.steps, seed=args.seed), args.out)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
