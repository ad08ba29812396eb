"""The scaling ceiling for the training bench: the tiny config's training step (generator and discriminator forward,
backward and Adam, one torch thread) in N independent processes, with no Ray, no data pipeline and no gradient
sync. Its images/s with 2 processes over 1 says how far this box lets data parallelism go at all, so the bench's
2-worker figure can be read against it rather than against an ideal 2x.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time


def _steps(image_size: int, batch_size: int, steps: int, out) -> None:
    import torch

    from tokenflow_ray.tokenizer.criterion import TokenizerLoss
    from tokenflow_ray.tokenizer.discriminator import PatchDiscriminator
    from tokenflow_ray.tokenizer.losses import discriminator_loss
    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer
    from tokenflow_ray.tokenizer.training.config import TrainConfig

    torch.set_num_threads(1)
    tok_cfg = TrainConfig().replace(model={"image_size": image_size}).model
    torch.manual_seed(0)
    model = DualCodebookTokenizer(tok_cfg)
    criterion = TokenizerLoss.for_model(model)
    disc = PatchDiscriminator(tok_cfg.loss.disc_ndf, tok_cfg.loss.disc_layers)
    opt_g = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-4)
    x = torch.rand(batch_size, 3, image_size, image_size) * 2 - 1

    def step(i: int) -> None:
        disc.requires_grad_(False)
        out_g = criterion(model, x, step=i, discriminator=disc)
        opt_g.zero_grad(set_to_none=True)
        out_g.loss.backward()
        opt_g.step()
        disc.requires_grad_(True)
        d = discriminator_loss(disc, x, out_g.recon_BCHW)
        opt_d.zero_grad(set_to_none=True)
        d.loss.backward()
        opt_d.step()

    for i in range(5):  # warm-up
        step(i)
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    out.put(steps * batch_size / (time.perf_counter() - start))


def measure_ceiling(counts: tuple[int, ...] = (1, 2), image_size: int = 16, batch_size: int = 16,
                    steps: int = 40) -> dict[int, float]:
    """Total images/s of `n` independent processes, for each n in counts."""
    ctx = mp.get_context("spawn")
    result: dict[int, float] = {}
    for n in counts:
        out = ctx.Queue()
        procs = [ctx.Process(target=_steps, args=(image_size, batch_size, steps, out)) for _ in range(n)]
        try:
            for p in procs:
                p.start()
            result[n] = sum(_result(out, procs) for _ in procs)
        finally:  # a failed or hung worker must not outlive the measurement (nor block interpreter exit)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=60)
    return result


def _result(out, procs, timeout_s: float = 600.0) -> float:
    """The next worker's result; fails at once when a worker died without one instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"ceiling worker exited with {[p.exitcode for p in procs]}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"ceiling workers gave no result in {timeout_s:.0f} s") from None
