"""Token sampling: greedy rows in one argmax; temperature / top-k / top-p rows with per-stream generators.

`sample` returns host ints (the CPU path). `sample_on_device` leaves the tokens on the device with no host sync of
its own (no `.item()`, no boolean indexing): the CUDA runner reads them back once a step, and keeps them on the
device for the next step's PENDING inputs. Both draw the same tokens from the same generators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tokenflow_ray.engine.sampling import SamplingParams

RandomRows = Sequence[tuple[int, SamplingParams, "torch.Generator | None"]]


def sample(logits_SV: torch.Tensor, random_rows: RandomRows = (),
           argmax_rows: Callable[[torch.Tensor], list[int]] | None = None) -> list[int]:
    """One token per row: every row's argmax (greedy), then the rows that sample (temperature > 0), given as
    (row, params, generator), drawn with their own generators. All-greedy steps (the common case) pass none.
    `argmax_rows`: the compiled CPU kernel (fused_ops.argmax_rows), the same tokens as torch.argmax."""
    out = argmax_rows(logits_SV) if argmax_rows is not None else logits_SV.argmax(dim=-1).tolist()
    for row, p, gen in random_rows:
        out[row] = int(_sample_row(logits_SV[row], p, gen).item())
    return out


def sample_on_device(logits_SV: torch.Tensor, random_rows: RandomRows = ()) -> torch.Tensor:
    """[S] long on the logits' device: the argmax, with the sampling rows' draws written in."""
    out = logits_SV.argmax(dim=-1)
    for row, p, gen in random_rows:
        out[row] = _sample_row(logits_SV[row], p, gen)[0]
    return out


def _sample_row(logits_V: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """A [1] long tensor: one draw. Masks rather than indexes, so no step waits on the device."""
    logits_V = logits_V.float() / p.temperature
    if p.top_k and p.top_k < logits_V.shape[-1]:
        kth = torch.topk(logits_V, p.top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    probs_V = torch.softmax(logits_V, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs_V.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(0) - sorted_p > p.top_p
        probs_V = probs_V.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        probs_V = probs_V / probs_V.sum()
    return torch.multinomial(probs_V, 1, generator=generator)
