"""Step and copy cost models for the simulator: what one `StepPlan` would take on a device.

Two step models behind one interface (`StepCost.step_s(shape)`):
- `RooflineStepCost`: a GPU profile (hardware.py) through the roofline form of gpu-notes.md §3.5:
      t = t_fix + max(W/(η_bw·B), FLOPs_lin·N_tok/(η_c·F)) + Σctx·kv_bytes/(η_kv·B) + t_prefill_attn + t_tp
  per GPU (TP ranks split weights, FLOPs and KV; each all-reduce is priced at its bandwidth and latency).
- `CalibratedStepCost`: fitted from measured steps of the real CPU engine. The step-time law is the engine's own
  (engine/step_time_model.py: t ≈ a + b_d·decodes + b_p·prefill tokens, fitted by its model), plus two terms
  fitted on what that law leaves: the decode context tokens (attention reads grow with the context) and the
  prefill (query, key) pairs (prefill attention grows with the square of the chunk: ~13% of a 230-token prefill
  step on the CPU engine, which a law fitted on 64-token prompts cannot see).

Copies (`HostLink`): each KV block is one DMA call, `t0 + bytes/B` (gpu-notes.md §4: per-call overhead dominates
small copies). Evictions (device->host) and loads (host->device) overlap when the engine overlaps them and the link
is `duplex`, each direction then at `bidir_factor` of the one-way bandwidth (both directions at once do not add up
to 2x, §1); otherwise they run one after the other (the CUDA copier's load stream waits for its evict stream:
runner/cuda_copies.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenflow_ray.engine.plan import StepPlan
from tokenflow_ray.engine.step_time_model import StepTimeFit, StepTimeModel
from tokenflow_ray.sim.hardware import Deployment


@dataclass(frozen=True)
class StepShape:
    """What a step's cost depends on, read off a plan in O(batch) (no per-token work)."""

    decodes: int
    prefill_tokens: int
    decode_context: int  # Σ context length over decodes (KV read by decode attention)
    prefill_pairs: float  # Σ over prefill chunks of c²/2 + c·prefix: (query, key) pairs of prefill attention
    sampled: int  # tokens sampled (lm_head rows)

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill_tokens

    @classmethod
    def of(cls, plan: StepPlan) -> StepShape:
        ctx = 0
        for c in plan.decodes:
            ctx += c.start_pos + 1
        tokens = 0
        pairs = 0.0
        sampled = len(plan.decodes)
        for c in plan.prefills:
            n = len(c.token_ids)
            tokens += n
            pairs += n * n / 2 + n * c.start_pos
            sampled += c.sample
        return cls(len(plan.decodes), tokens, ctx, pairs, sampled)


class StepCost(Protocol):
    def step_s(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class RooflineStepCost:
    deployment: Deployment
    eta_attn: float = 0.5  # achieved share of peak on prefill attention [est.: flash-attn fwd reaches ~50-70%]

    def step_s(self, shape: StepShape) -> float:
        if shape.tokens == 0:
            return 0.0
        d = self.deployment
        g, m, tp = d.gpu, d.model, d.tp
        weights = m.weight_bytes / tp / (g.eta_bw * g.hbm_bytes_s)
        flops = (m.linear_flops_per_token * shape.tokens + m.lm_head_flops_per_token * shape.sampled) / tp
        linear = max(weights, flops / (g.eta_compute * g.flops))
        kv = shape.decode_context * m.kv_bytes_per_token / tp / (g.eta_kv * g.hbm_bytes_s)
        attn = m.attn_flops_per_pair * shape.prefill_pairs / tp / (self.eta_attn * g.flops)
        return g.fixed_s + linear + kv + attn + self._tp_s(shape.tokens)

    def _tp_s(self, tokens: int) -> float:
        """Two all-reduces of the hidden state per layer (attention out, MLP out); ring: 2(n-1)/n of the bytes."""
        d = self.deployment
        if d.tp == 1:
            return 0.0
        g, m = d.gpu, d.model
        size = tokens * m.hidden * 2  # bf16 activations
        per_call = g.allreduce_latency_s + 2 * (d.tp - 1) / d.tp * size / g.allreduce_bytes_s
        return 2 * m.layers * per_call


@dataclass(frozen=True)
class CalibratedStepCost:
    fit: StepTimeFit  # the engine's step-time law, fitted on the real engine's steps
    context_s: float = 0.0  # per decode context token
    pair_s: float = 0.0  # per prefill (query, key) pair

    def step_s(self, shape: StepShape) -> float:
        if shape.tokens == 0:
            return 0.0
        return (self.fit.predict(shape.decodes, shape.prefill_tokens) + self.context_s * shape.decode_context
                + self.pair_s * shape.prefill_pairs)

    @classmethod
    def from_samples(cls, samples: Sequence[tuple[StepShape, float]], rounds: int = 60) -> CalibratedStepCost:
        """Least squares on (shape, measured step seconds) pairs, by alternating two exact steps until they agree:
        the engine's own StepTimeModel (no decay: every step weighs the same) fits a, b_d, b_p to the time less
        the attention terms; then the context and pair coefficients (>= 0) are refitted to what that law leaves.
        Each step lowers the squared error, so it converges to the joint fit (the decode count and the context
        are correlated, and so are the prefill tokens and pairs, which a single residual pass would get wrong)."""
        if not samples:
            raise ValueError("calibration: no measured steps")
        first = samples[0][1]
        xs = [(float(s.decode_context), s.prefill_pairs) for s, _ in samples]
        terms = (0.0, 0.0)
        fit = StepTimeFit(first, 0.0, first / 64)
        for _ in range(rounds):
            model = StepTimeModel(step_s=first, prefill_s_per_token=first / 64, decay=1.0)
            for (shape, t), (x, p) in zip(samples, xs):
                model.observe(shape.decodes, shape.prefill_tokens, t - terms[0] * x - terms[1] * p)
            fit = model.fit
            new = _nonnegative_2d(xs, [t - fit.predict(s.decodes, s.prefill_tokens) for s, t in samples])
            done = all(abs(n - o) <= 1e-12 + 1e-6 * o for n, o in zip(new, terms))
            terms = new
            if done:
                break
        return cls(fit, *terms)

    def for_policy(self, samples: Sequence[tuple[StepShape, float]]) -> CalibratedStepCost:
        """This law refitted on another policy's steps in what the policy changes: the model's costs per prefill
        token and per context token stay (they do not depend on the policy), while the per-step and per-decode
        terms are refitted (a policy's planning time is a constant plus work per running stream: tokenflow ranks
        every stream every step and rebalances every Δt). Least squares (means, not medians: the periodic
        rebalance steps are part of what the policy costs), by the engine's StepTimeModel."""
        if not samples:
            raise ValueError("calibration: no measured steps")
        first = samples[0][1]
        model = StepTimeModel(step_s=first, prefill_s_per_token=self.fit.prefill_s, decay=1.0)
        for shape, t in samples:
            rest = (t - self.fit.prefill_s * shape.prefill_tokens - self.context_s * shape.decode_context
                    - self.pair_s * shape.prefill_pairs)
            if shape.decodes:
                model.observe(shape.decodes, 0, rest)
        fit = model.fit
        return CalibratedStepCost(StepTimeFit(fit.fixed_s, fit.decode_s, self.fit.prefill_s), self.context_s,
                                  self.pair_s)


def _nonnegative_2d(xs: Sequence[tuple[float, float]], ys: Sequence[float]) -> tuple[float, float]:
    """min Σ (y − c·x − q·p)² over c, q >= 0 (no intercept): the unconstrained solution when it is feasible,
    else the better of the two one-term fits."""
    sxx = sum(x * x for x, _ in xs)
    spp = sum(p * p for _, p in xs)
    sxp = sum(x * p for x, p in xs)
    sxy = sum(x * y for (x, _), y in zip(xs, ys))
    spy = sum(p * y for (_, p), y in zip(xs, ys))
    det = sxx * spp - sxp * sxp
    if det > 1e-12 * max(sxx * spp, 1e-300):
        c, q = (spp * sxy - sxp * spy) / det, (sxx * spy - sxp * sxy) / det
        if c >= 0 and q >= 0:
            return c, q
    only_c = (max(0.0, sxy / sxx), 0.0) if sxx > 0 else (0.0, 0.0)
    only_q = (0.0, max(0.0, spy / spp)) if spp > 0 else (0.0, 0.0)

    def sse(t: tuple[float, float]) -> float:
        return sum((y - t[0] * x - t[1] * p) ** 2 for (x, p), y in zip(xs, ys))

    return min(only_c, only_q, key=sse)


@dataclass(frozen=True)
class HostLink:
    """The device<->host copy path of one replica (all TP ranks together)."""

    bytes_s: float  # one direction, alone
    bidir_factor: float = 1.0  # per-direction share when both directions copy at once
    call_overhead_s: float = 0.0  # per block copy call (t0)
    duplex: bool = True  # evictions and loads at once (False: loads after the step's evictions)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bytes_s) and self.bytes_s > 0):
            raise ValueError(f"bytes_s: must be a finite number > 0, got {self.bytes_s!r}")
        if not 0 < self.bidir_factor <= 1 or self.call_overhead_s < 0:
            raise ValueError("bidir_factor must be in (0, 1], call_overhead_s >= 0")

    @classmethod
    def of(cls, deployment: Deployment) -> HostLink:
        # Each TP rank moves its share of every block over its own link; 2.3 µs per cudaMemcpyAsync call
        # (taco-project/FlexKV#193, gpu-notes.md §4), one call per block and rank in parallel.
        g = deployment.gpu
        return cls(g.host_link_bytes_s * deployment.tp, g.bidir_factor, 2.3e-6)

    def block_s(self, block_bytes: int, both_directions: bool) -> float:
        bw = self.bytes_s * (self.bidir_factor if both_directions else 1.0)
        return self.call_overhead_s + block_bytes / bw

