"""Ray job entrypoint: train the tokenizer on the cluster the job runs in.

    RAY_AUTH_MODE=token ray job submit --address http://HEAD:8265 --working-dir . -- \
        python jobs/train_tokenizer.py --config configs/tokenizer/tiny.yaml [--workers N] [--storage DIR] [--name NAME] \
        [--set model.quantizer.codebook_size=1024 ...]

Inside a job `ray.init()` joins the job's cluster. Resubmitting with the same --name and --storage resumes the run.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the uploaded working dir, if not pip-installed

from tokenflow_ray.tokenizer.train_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", "--no-progress", *sys.argv[1:]]))
