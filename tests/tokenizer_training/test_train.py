"""Ray Train runs on CPU (2 gloo workers). Each fit() costs ~20-40 s here, so each test combines its assertions."""

import math
import os
import signal

import pytest

from tokenflow_ray.tokenizer.training.config import TrainConfig

from .test_data import write_image_folder


def tiny_config(tmp_path, name, **sections) -> TrainConfig:
    base = TrainConfig().replace(
        data={"image_size": 16, "batch_size": 8},
        optim={"lr": 1e-3, "ema_decay": 0.9},
        scaling={"num_workers": 2, "cpus_per_worker": 0.5, "max_failures": 2},
        run={"name": name, "storage_path": str(tmp_path / "runs")})
    return base.replace(**sections)


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_train_resume_then_evaluate_and_export(ray_session, tmp_path, digits_parquet):
    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer
    from tokenflow_ray.tokenizer.training.evaluate import evaluate_checkpoint
    from tokenflow_ray.tokenizer.training.export import export_checkpoint
    from tokenflow_ray.tokenizer.training.trainer import run_training

    cfg = tiny_config(tmp_path, "resume", data={"source": "parquet", "path": str(digits_parquet)},
                      schedule={"steps": 6, "log_every": 2, "checkpoint_every": 2})
    first = run_training(cfg, show_progress=False)
    m = first.metrics
    assert m["step"] == 6 and m["world_size"] == 2 and m["resumed_from_step"] == 0
    curve = first.loss_curve
    assert [s for s, _ in curve] == [2, 4, 6]
    assert curve[-1][1] < curve[0][1], f"loss did not decrease: {curve}"
    for key in ("sem_loss", "vq_loss", "mse_loss", "gan_loss", "disc_loss"):  # per-term losses, both optimisers
        assert math.isfinite(m[key])
    assert m["disc_loss"] > 0  # the discriminator (second optimiser) ran
    assert 0 < m["usage"] <= 1 and m["images_per_s"] > 0 and m["step_time_s"] > 0 and m["data_wait_s"] >= 0
    assert m["skipped_images"] == 0 and first.checkpoint_path

    # Same name + storage and more steps: Train V2 hands the loop the latest checkpoint.
    second = run_training(cfg.replace(schedule={"steps": 10}), show_progress=False)
    assert second.metrics["resumed_from_step"] == 6 and second.metrics["step"] == 10
    assert second.loss_curve[:3] == curve  # the curve continues, not restarts
    assert [s for s, _ in second.loss_curve] == [2, 4, 6, 8, 10]
    assert second.loss_curve[-1][1] < curve[0][1]

    out = export_checkpoint(second.run_path, tmp_path / "exported")
    model = DualCodebookTokenizer.from_pretrained(out)
    assert model.config.quantizer.codebook_size == cfg.tokenizer_config().quantizer.codebook_size
    result = evaluate_checkpoint(second.checkpoint_path, tmp_path / "eval", num_images=32)
    assert result.num_images == 32 and math.isfinite(result.psnr) and -1 <= result.ssim <= 1
    assert (tmp_path / "eval" / "samples.png").stat().st_size > 0 and (tmp_path / "eval" / "metrics.json").exists()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_worker_killed_mid_run_resumes_from_checkpoint_and_counts_corrupt_files(ray_session, tmp_path):
    from tokenflow_ray.tokenizer.training.trainer import run_training

    folder = tmp_path / "imgs"
    write_image_folder(folder, n_good=60)
    cfg = tiny_config(tmp_path, "fault", data={"source": "images", "path": str(folder)},
                      schedule={"steps": 10, "log_every": 1, "checkpoint_every": 2})
    killed = []

    def kill_rank1_after_first_checkpoint(snap):
        if not killed and snap.checkpointed_step >= 2 and len(snap.workers) == 2:
            pid = next(w["pid"] for w in snap.workers if w["rank"] == 1)
            os.kill(pid, signal.SIGKILL)
            killed.append((snap.step, pid))

    run = run_training(cfg, show_progress=False, watcher=kill_rank1_after_first_checkpoint)
    assert killed, "the watcher never saw a checkpoint"
    m = run.metrics
    assert m["step"] == 10 and run.attempts >= 2
    assert m["resumed_from_step"] >= 2 and m["resumed_from_step"] % 2 == 0
    assert killed[0][1] not in m["worker_pids"]  # a new worker group finished the run
    steps = [s for s, _ in run.loss_curve]
    assert steps == sorted(set(steps)) and steps[-1] == 10
    assert m["skipped_images"] >= 1  # corrupt files were counted, and training went on
