"""Ray Train runs on CPU (2 gloo workers). Each fit() costs ~20-40 s on this box, so one test carries the train,
fault, resume (exact data position), LPIPS, evaluate and export assertions over two fits (the multi-node test runs
in its own subprocess)."""

import math
import os
import signal

import pytest

from tokenflow_ray.tokenizer.training.config import TrainConfig


def tiny_config(storage, name, **sections) -> TrainConfig:
    base = TrainConfig().replace(
        data={"batch_size": 8},
        optim={"lr": 1e-3, "ema_decay": 0.9},
        scaling={"num_workers": 2, "cpus_per_worker": 0.5, "max_failures": 2},
        run={"name": name, "storage_path": str(storage)})
    return base.replace(**sections)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_train_survives_worker_kill_then_resumes_by_rerun(ray_session, tmp_path, digits_parquet):
    import torch

    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer
    from tokenflow_ray.tokenizer.perceptual import LPIPS
    from tokenflow_ray.tokenizer.training import data as data_module
    from tokenflow_ray.tokenizer.training.checkpoint import latest_checkpoint_dir, load_state, read_position
    from tokenflow_ray.tokenizer.training.evaluate import evaluate_checkpoint
    from tokenflow_ray.tokenizer.training.export import export_checkpoint
    from tokenflow_ray.tokenizer.training.split import resolve_split
    from tokenflow_ray.tokenizer.training.trainer import run_training

    # The first fit pins each worker to its own CPU and puts bf16 gradients on the wire.
    cfg = tiny_config(tmp_path / "runs", "tiny", data={"source": "parquet", "path": str(digits_parquet)},
                      schedule={"steps": 8, "log_every": 1, "checkpoint_every": 2},
                      scaling={"pin_cpus": True, "grad_compress": "bf16"})
    killed = []

    def kill_rank1_after_first_checkpoint(snap):
        # checkpointed_step comes from the Train controller, so the checkpoint is registered and restorable.
        if not killed and snap.checkpointed_step >= 2 and len(snap.workers) == 2:
            pid = next(w["pid"] for w in snap.workers if w["rank"] == 1)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    # --- 1. two workers over a parquet dataset; a worker is killed mid-run; FailureConfig restarts the group ---
    first = run_training(cfg, show_progress=False, watcher=kill_rank1_after_first_checkpoint)
    m = first.metrics
    assert killed, "the watcher never saw a registered checkpoint"
    assert m["step"] == 8 and m["world_size"] == 2 and first.attempts >= 2
    assert m["resumed_from_step"] >= 2 and m["resumed_from_step"] % 2 == 0  # restarted from a checkpoint, not 0
    assert killed[0] not in m["worker_pids"]  # a new worker group finished the run
    curve = first.loss_curve
    assert [s for s, _ in curve] == list(range(1, 9))
    assert curve[-1][1] < curve[0][1], f"loss did not decrease: {curve}"
    for key in ("sem_loss", "vq_loss", "mse_loss", "gan_loss", "disc_loss"):  # per-term losses, both optimisers
        assert math.isfinite(m[key])
    assert m["disc_loss"] > 0  # the discriminator (second optimiser) ran
    assert 0 < m["usage"] <= 1 and m["images_per_s"] > 0 and m["step_time_s"] > 0 and m["data_wait_s"] >= 0
    assert m["skipped_images"] == 0 and first.checkpoint_path
    assert 0 < m["sync_time_s"] < m["step_time_s"]  # the gradient all-reduce ran, inside the step
    if len(os.sched_getaffinity(0)) >= 2:  # one CPU each, different ones
        assert sorted(map(tuple, m["worker_cpus"])) == [(c,) for c in sorted(os.sched_getaffinity(0))[:2]]

    state = load_state(latest_checkpoint_dir(first.run_path))
    assert not [k for k in state.model if "teacher" in k or "lpips" in k]  # the tokenizer only
    assert state.samples == 8 * 8 * 2 and read_position(first.run_path) == {"step": 8, "samples": 128}

    # --- 2. same name + storage, more steps: Train V2 hands the loop the latest checkpoint and the pipeline starts
    # at its data position (sample 128). The first fit averaged gradients with the flat all-reduce (the CPU
    # default); the rest runs under torch DDP, accumulates gradients over 2 micro-batches per step (DDP's no_sync on
    # the first) and adds LPIPS, the reference network with weights this test writes (not part of the checkpoint,
    # so the resumed model loads without it) ---
    torch.manual_seed(0)
    lpips_net = LPIPS()
    for lin in lpips_net.lins:  # non-negative layer weights, as in the real file: the distance is then > 0
        lin.model[1].weight.data.abs_()
    torch.save(lpips_net.state_dict(), tmp_path / "lpips_vgg.pt")
    built = []
    real_build = data_module.build_train_data

    def spy(*args, **kwargs):
        built.append(kwargs.get("offset"))
        return real_build(*args, **kwargs)

    data_module.build_train_data = spy
    try:
        second = run_training(cfg.replace(schedule={"steps": 12, "log_every": 2}, optim={"accum_steps": 2},
                                          scaling={"grad_sync": "ddp", "pin_cpus": False, "grad_compress": "none"},
                                          model={"loss": {"lpips_weight": 1.0,
                                                          "lpips_path": str(tmp_path / "lpips_vgg.pt")}}),
                              show_progress=False)
    finally:
        data_module.build_train_data = real_build
    assert built == [128]  # resumed exactly where the checkpoint's data position was, nothing read and dropped
    assert second.metrics["resumed_from_step"] == 8 and second.metrics["step"] == 12
    assert second.metrics["lpips_loss"] > 0  # LPIPS ran in the Ray training step
    assert load_state(latest_checkpoint_dir(second.run_path)).samples == 128 + 4 * 2 * 8 * 2
    assert second.metrics["worker_cpus"] == [None, None]
    assert second.metrics["images"] == 2 * 2 * 8 * 2  # per interval: steps x micro-batches x batch x workers
    assert second.loss_curve[:8] == curve  # the curve continues, not restarts
    assert [s for s, _ in second.loss_curve][8:] == [10, 12]
    assert second.loss_curve[-1][1] < curve[0][1]

    # --- 3. export to the save_pretrained format, and evaluate (PSNR/SSIM + PNG grid) ---
    out = export_checkpoint(second.run_path, tmp_path / "exported")
    model = DualCodebookTokenizer.from_pretrained(out)
    assert model.config.quantizer.codebook_size == cfg.tokenizer_config().quantizer.codebook_size
    # Evaluation reads the held-out split only: every file it opens is outside the training split.
    train_files = set(resolve_split(cfg.data, cfg.run.storage_dir, 16).train_files)
    opened = []
    real_read = data_module._read_rows

    def record(files, data_cfg):
        opened.extend(files)
        return real_read(files, data_cfg)

    data_module._read_rows = record
    try:
        result = evaluate_checkpoint(second.checkpoint_path, tmp_path / "eval", num_images=32)
    finally:
        data_module._read_rows = real_read
    assert opened and not set(opened) & train_files and set(result.files) == set(opened)
    assert result.num_images == 32 and math.isfinite(result.psnr) and -1 <= result.ssim <= 1
    assert result.rfid is None  # no feature network configured
    assert (tmp_path / "eval" / "samples.png").stat().st_size > 0 and (tmp_path / "eval" / "metrics.json").exists()
