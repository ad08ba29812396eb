"""Ray job entrypoint: evaluate a training checkpoint on its held-out split (PSNR, SSIM, rFID with --fid-features,
usage) and write samples.png + metrics.json.

    ray job submit --working-dir . -- python jobs/evaluate_tokenizer.py --checkpoint RUN_OR_CKPT_DIR --out DIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenflow_ray.tokenizer.train_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["evaluate", *sys.argv[1:]]))
