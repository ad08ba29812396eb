"""The per-worker training loop run by Ray Train's TorchTrainer.

Per step: generator (the tokenizer) forward + backward over `optim.accum_steps` micro-batches, and once the GAN is
active the discriminator's backward on the same micro-batches; gradients are averaged over ranks once per step
(`scaling.grad_sync`: a flat all-reduce per model, started as soon as that model's gradients are complete so it
overlaps the next piece of work, or DDP for the generator; `scaling.grad_compress` can put bfloat16 on the wire);
then Adam for each, and the EMA update. Each `log_every` steps every rank calls `ray.train.report`
with metrics all-reduced over ranks (per-term losses, codebook usage, images/s, step vs data-wait time, skipped
images, which nodes the workers run on); every `checkpoint_every` steps rank 0 also attaches a checkpoint. On start
the loop resumes from `ray.train.get_checkpoint()` (a rerun with the same run name and storage, or a FailureConfig
restart).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time

import torch
import torch.distributed as dist

from tokenflow_ray.affinity import pin_this_worker
from tokenflow_ray.tokenizer.training.checkpoint import TrainState, load_state, save_state
from tokenflow_ray.tokenizer.training.config import TrainConfig
from tokenflow_ray.tokenizer.training.grad_sync import broadcast_params, start_average, world_size
from tokenflow_ray.tokenizer.training.metrics import IntervalMeter

log = logging.getLogger(__name__)
LOSS_TERMS = ("loss", "sem_loss", "vq_loss", "mse_loss", "l1_loss", "lpips_loss", "gan_loss")


def _world() -> tuple[int, int]:
    world = world_size()
    return (dist.get_rank() if world > 1 else 0), world


def _all_reduce(values: list[float], op=None) -> list[float]:
    """Sum (or `op`) a list of floats over ranks in one collective."""
    if world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def _all_gather(obj) -> list:
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def _build(cfg: TrainConfig, device):
    from ray.train.torch import prepare_model

    from tokenflow_ray.tokenizer.criterion import TokenizerLoss
    from tokenflow_ray.tokenizer.discriminator import PatchDiscriminator
    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer

    tok_cfg = cfg.model
    torch.manual_seed(cfg.data.seed)  # same init on every rank (rank 0's weights are also broadcast)
    raw = DualCodebookTokenizer(tok_cfg).to(device)
    # Before any checkpoint is loaded: the teacher is the tower as it starts (pretrained, or this seeded init).
    criterion = TokenizerLoss.for_model(raw).to(device)
    if cfg.scaling.gradient_sync == "ddp":
        # find_unused_parameters: the trainable tower's pooler/projection and a dropped scale's gain get no
        # gradient. broadcast_buffers=False: the usage window is per rank bookkeeping, not state to overwrite from
        # rank 0. gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, no copy in and out each step.
        model = prepare_model(raw, parallel_strategy_kwargs={"find_unused_parameters": True,
                                                             "broadcast_buffers": False,
                                                             "gradient_as_bucket_view": True})
        if cfg.scaling.grad_compress == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            model.register_comm_hook(None, bf16_compress_hook)
    else:  # flat: the loop averages gradients itself (grad_sync.start_average), once a step
        model = prepare_model(raw, parallel_strategy=None)
    o = cfg.optim
    opt_g = torch.optim.Adam([p for p in raw.parameters() if p.requires_grad], lr=o.lr, betas=o.betas)
    disc = opt_d = None
    if tok_cfg.loss.gan_weight > 0:
        disc = PatchDiscriminator(tok_cfg.loss.disc_ndf, tok_cfg.loss.disc_layers).to(device)
        opt_d = torch.optim.Adam(disc.parameters(), lr=o.disc_lr, betas=o.betas)
    ema = ({n: p.detach().clone() for n, p in raw.named_parameters() if p.requires_grad}
           if o.ema_decay > 0 else None)
    return raw, model, criterion, opt_g, disc, opt_d, ema


def train_loop(loop_config: dict) -> dict:
    import ray.train
    from ray.train import Checkpoint
    from ray.train.torch import get_device

    from tokenflow_ray.tokenizer.losses import discriminator_loss, gan_active

    cfg = TrainConfig.from_dict(loop_config["train"])
    progress = loop_config.get("progress")  # a ProgressActor handle, or None
    pinned = None
    if cfg.scaling.pin_cpus:  # before torch's thread pool exists, so its threads inherit the CPUs
        ctx = ray.train.get_context()
        pinned, why = pin_this_worker(ctx.get_local_rank(), ctx.get_local_world_size(), cfg.scaling.torch_threads)
        if pinned is None:
            log.warning("scaling.pin_cpus: not pinned: %s", why)
    torch.set_num_threads(cfg.scaling.torch_threads)
    rank, world = _world()
    device = get_device()
    raw, model, criterion, opt_g, disc, opt_d, ema = _build(cfg, device)
    tok_cfg = raw.config

    state = TrainState(step=0, epoch=0, batch_in_epoch=0, model={}, opt_g={}, config=cfg.to_dict())
    resumed_from = 0
    if (ckpt := ray.train.get_checkpoint()) is not None:
        with ckpt.as_directory() as d:
            state = load_state(d)
        raw.load_state_dict(state.model)
        opt_g.load_state_dict(state.opt_g)
        if disc is not None and state.disc is not None:
            disc.load_state_dict(state.disc)
            opt_d.load_state_dict(state.opt_d)
        if ema is not None and state.ema:
            ema = {n: v.to(device) for n, v in state.ema.items()}
        resumed_from = state.step
    workers = _all_gather({"rank": rank, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                           "cpus": sorted(pinned) if pinned else None})
    if progress is not None and rank == 0:
        progress.register.remote(workers, resumed_from)

    meter = IntervalMeter(LOSS_TERMS)
    shard = ray.train.get_dataset_shard("train")
    step, epoch = state.step, state.epoch
    prev_x = None
    accum = cfg.optim.accum_steps
    per_step = accum * cfg.data.batch_size * world  # global samples one optimiser step consumes
    ddp = cfg.scaling.gradient_sync == "ddp"
    g_params = [p for p in raw.parameters() if p.requires_grad]
    compress = cfg.scaling.grad_compress
    ema_values, ema_params = [], []  # aligned lists for one in-place foreach lerp per step
    for name, p in raw.named_parameters():
        if ema is not None and name in ema:
            ema_values.append(ema[name])
            ema_params.append(p)
    if not ddp:
        broadcast_params([raw] + ([disc] if disc is not None else []))
    data = loop_config.get("data", {"indexed": False, "offset": 0, "num_rows": None})
    position = _Position(epoch, state.batch_in_epoch)
    batches = _batch_stream(shard, cfg, device, data, state.samples, position)
    while step < cfg.schedule.steps:
        t0 = time.perf_counter()
        group = [b for _, b in zip(range(accum), batches)]
        if len(group) < accum:
            raise RuntimeError(f"the data pipeline ended at step {step} of {cfg.schedule.steps}")
        t1 = time.perf_counter()
        xs = []
        for batch in group:
            valid = batch["valid"].bool()
            x = batch["image"][valid]
            meter.skipped += int((~valid).sum())
            if x.shape[0] == 0:
                # Why reuse: every rank must run the same number of DDP steps, even if its whole batch was corrupt.
                x = prev_x if prev_x is not None else batch["image"]
            prev_x = x
            xs.append(x)
        use_gan = disc is not None and gan_active(tok_cfg.loss, step)
        opt_g.zero_grad(set_to_none=True)
        if use_gan:
            opt_d.zero_grad(set_to_none=True)
        terms = dict.fromkeys(LOSS_TERMS, 0.0)
        sync_s, pending_g = 0.0, None
        for i, x in enumerate(xs):
            last_micro = i == len(xs) - 1
            if use_gan:
                disc.requires_grad_(False)  # G's adversarial term must not write gradients into D
            # DDP all-reduces on the last micro-batch's backward only; earlier ones accumulate locally.
            with contextlib.nullcontext() if last_micro or not ddp else model.no_sync():
                out = criterion(model, x, step=step, discriminator=disc if use_gan else None)
                (out.loss / len(xs)).backward()
            if last_micro and not ddp:
                t_sync = time.perf_counter()
                pending_g = start_average(g_params, compress)  # travels while D computes below
                sync_s += time.perf_counter() - t_sync
            for k in LOSS_TERMS:
                terms[k] += float(getattr(out, k).detach()) / len(xs)
            if use_gan:
                disc.requires_grad_(True)
                d = discriminator_loss(disc, x, out.recon_BCHW)  # fakes of this step's G, as without accumulation
                (d.loss / len(xs)).backward()
                terms["disc_loss"] = terms.get("disc_loss", 0.0) + float(d.loss) / len(xs)
        t_sync = time.perf_counter()
        # D's average travels while G's optimiser steps. D is never under DDP: it runs several times a step
        # (real, fake, inside G's loss), which DDP's reducer does not expect.
        pending_d = start_average(list(disc.parameters()) if use_gan else [], compress)
        if pending_g is not None:
            pending_g.wait()
        sync_s += time.perf_counter() - t_sync
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.optim.grad_clip)
        opt_g.step()
        if ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(ema_values, ema_params, 1 - cfg.optim.ema_decay)
        t_sync = time.perf_counter()
        pending_d.wait()
        sync_s += time.perf_counter() - t_sync
        if use_gan:
            opt_d.step()
        step += 1
        state.samples += per_step
        epoch = position.epoch if not data["indexed"] else state.samples // data["num_rows"]
        meter.add(terms, images=sum(x.shape[0] for x in xs), wait_s=t1 - t0, step_s=time.perf_counter() - t1,
                  usage=out.usage, sync_s=sync_s)
        last = step == cfg.schedule.steps
        if step % cfg.schedule.log_every and step % cfg.schedule.checkpoint_every and not last:
            continue
        metrics = meter.flush(_all_reduce, world)
        state.skipped_images += metrics.pop("skipped_images_interval")
        state.curve.append([step, metrics["loss"]])
        metrics.update(step=step, epoch=epoch, world_size=world, resumed_from_step=resumed_from,
                       skipped_images=int(state.skipped_images), loss_curve=list(state.curve),
                       worker_node_ids=[w["node_id"] for w in workers], worker_pids=[w["pid"] for w in workers],
                       worker_cpus=[w["cpus"] for w in workers])
        if progress is not None and rank == 0:
            progress.update.remote(metrics)
        if step % cfg.schedule.checkpoint_every == 0 or last:
            _report_with_checkpoint(metrics, state, step, epoch, position.batch_in_epoch, raw, opt_g, disc,
                                    opt_d, ema, rank, Checkpoint)
        else:
            ray.train.report(metrics)
        meter.restart_clock()  # why: images/s measures training, not the report/checkpoint just done
    return {"loss_curve": state.curve, "step": step}


class _Position:
    """The streaming pipeline's data position (epoch, batches of it consumed on this rank)."""

    def __init__(self, epoch: int, batch_in_epoch: int) -> None:
        self.epoch, self.batch_in_epoch = epoch, batch_in_epoch


def _batch_stream(shard, cfg: TrainConfig, device, data: dict, samples_done: int, position: _Position):
    """Batches for the rest of the run. Indexed pipeline: one iterator over every remaining epoch; it starts at the
    driver's offset, so after a rerun-resume nothing is skipped; only a worker-group restart inside one fit (the
    pipeline was built before it) skips the samples consumed since, by count. Streaming: one pass per epoch."""
    kwargs = {"batch_size": cfg.data.batch_size, "drop_last": True, "device": device}
    if cfg.data.local_shuffle_buffer_size:
        kwargs["local_shuffle_buffer_size"] = cfg.data.local_shuffle_buffer_size
    world = world_size()
    if data["indexed"]:
        skip = max(0, samples_done - data["offset"]) // (cfg.data.batch_size * world)
        for i, batch in enumerate(shard.iter_torch_batches(**kwargs)):
            if i >= skip:
                yield batch
        return
    skip = position.batch_in_epoch
    while True:
        position.batch_in_epoch = 0
        for batch in shard.iter_torch_batches(**kwargs):
            position.batch_in_epoch += 1
            if position.batch_in_epoch > skip:
                yield batch
        skip = 0
        position.epoch += 1


def _report_with_checkpoint(metrics, state, step, epoch, batch_in_epoch, raw, opt_g, disc, opt_d, ema, rank,
                            checkpoint_cls) -> None:
    import ray.train

    state.step, state.epoch, state.batch_in_epoch = step, epoch, batch_in_epoch
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:  # identical weights on every rank after DDP; one copy is enough
            state.model = raw.state_dict()
            state.opt_g = opt_g.state_dict()
            state.disc = disc.state_dict() if disc is not None else None
            state.opt_d = opt_d.state_dict() if opt_d is not None else None
            state.ema = {n: v.cpu() for n, v in ema.items()} if ema is not None else None
            save_state(tmp, state)
            checkpoint = checkpoint_cls.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)  # all ranks call report; only rank 0 attaches one
