"""Step time as a function of what a step runs: t ≈ a + b_d·decodes + b_p·prefill_tokens.

The scheduler needs step times for batches it has *not* run: the decode capacity Γ at the largest batch the device
can hold (the overload test, Eq. 6, and the working-set cap), and the time to recompute a paused stream's prefix.
Extrapolating from the batch a policy happened to run is circular: a policy that runs few streams would measure a
small capacity and keep running few streams (issue 13: 40 streams collapsed to 1.8 running). A linear model in the
step's decode and prefill token counts separates the fixed per-step cost (weights streamed once per step) from the
per-token costs, so it predicts any batch from the mixed steps every policy runs anyway.

Fit: exponentially weighted least squares (recent steps count more, so the model follows contention on a shared
machine) with a ridge prior towards the constructor's defaults, so the estimate is defined before the features
have varied (a prior worth `prior_weight` steps, so real data outweighs it from the first step), every cost >= its
floor (the exact solution of that bound-constrained problem: see `_solve`). Pure Python: a 3x3 solve per estimate,
cached until the next observation.

`clip` bounds what one step can teach: a step that took more than `clip` x the fit's prediction (the fit last
solved: observing never solves one itself, so a model nobody reads costs its owner nothing a step) enters as
`clip` x it. A step that pays a one-off (a new attention shape on the GPU runs: 56-61 ms on a ~20 ms step; the process's
first step, 0.5 s) then moves the estimate as a slow step does, not as several of them (docs/results/simulator.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Feature scales of the prior: a typical decode batch and prefill chunk. The ridge penalty is set per feature so a
# prior of one pseudo-step weighs the same in every direction.
_DECODE_SCALE = 8.0
_PREFILL_SCALE = 64.0


@dataclass(frozen=True)
class StepTimeFit:
    fixed_s: float  # a: per-step cost independent of tokens (>= 0)
    decode_s: float  # b_d: per decode token (>= 0)
    prefill_s: float  # b_p: per prefill token (> 0)

    def predict(self, decodes: float, prefill_tokens: float = 0.0) -> float:
        return self.fixed_s + self.decode_s * decodes + self.prefill_s * prefill_tokens


class StepTimeModel:
    def __init__(self, step_s: float = 0.02, prefill_s_per_token: float = 5e-4, decay: float = 0.99,
                 prior_weight: float = 0.1, clip: float | None = None) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay: must be in (0, 1], got {decay!r}")
        if not (math.isfinite(prior_weight) and prior_weight > 0):
            raise ValueError(f"prior_weight: must be > 0, got {prior_weight!r}")
        if clip is not None and not (math.isfinite(clip) and clip > 1):
            raise ValueError(f"clip: must be > 1, got {clip!r}")
        self.decay = decay
        self.clip = clip
        self._prior = (step_s, 0.0, prefill_s_per_token)  # decode cost 0 a priori: decode is weight-bound
        self._ridge = (prior_weight, prior_weight * _DECODE_SCALE ** 2, prior_weight * _PREFILL_SCALE ** 2)
        self._floor_prefill = prefill_s_per_token * 1e-3  # recompute is never free
        self._xx = [[0.0] * 3 for _ in range(3)]  # Σ w·x·xᵀ
        self._xy = [0.0] * 3  # Σ w·x·y
        self.samples = 0
        self.prefill_samples = 0  # steps with prefill tokens: until one, the prefill cost is the prior's alone
        self._fit: StepTimeFit | None = None
        self._last_fit = StepTimeFit(*self._prior)  # the fit last solved: what `clip` measures a step against

    def observe(self, decodes: int, prefill_tokens: int, compute_s: float) -> None:
        if compute_s <= 0 or (decodes == 0 and prefill_tokens == 0):
            return
        x = (1.0, float(decodes), float(prefill_tokens))
        if self.clip is not None and self.samples:
            compute_s = min(compute_s, self.clip * self._last_fit.predict(x[1], x[2]))
        d = self.decay
        for i in range(3):
            self._xy[i] = d * self._xy[i] + x[i] * compute_s
            for j in range(3):
                self._xx[i][j] = d * self._xx[i][j] + x[i] * x[j]
        self.samples += 1
        self.prefill_samples += prefill_tokens > 0
        self._fit = None

    @property
    def fit(self) -> StepTimeFit:
        if self._fit is None:
            self._fit = self._last_fit = self._solve()
        return self._fit

    def _solve(self) -> StepTimeFit:
        """The ridge least squares with every cost at or above its floor. Its optimum has some costs at their
        floors and the others at the unconstrained optimum given those: the unconstrained solution when it is
        feasible (nearly always), else the feasible candidate of least objective among the pinned subsets (three
        costs: at most seven more 3x3 solves). Pinning greedily instead, one cost after another and never
        releasing one, can stop at a worse corner than the best one (never on the data seen so far, but nothing
        rules it out)."""
        lower = (0.0, 0.0, self._floor_prefill)
        theta = self._solve_with({})
        if all(t >= lo for t, lo in zip(theta, lower)):
            return StepTimeFit(*theta)
        best: tuple[float, list[float]] | None = None
        for mask in range(1, 8):
            pinned = {i: lower[i] for i in range(3) if mask >> i & 1}
            cand = self._solve_with(pinned) if len(pinned) < 3 else list(lower)
            if all(t >= lo - 1e-15 for t, lo in zip(cand, lower)):
                cost = self._objective(cand)
                if best is None or cost < best[0]:
                    best = (cost, cand)
        return StepTimeFit(*(max(t, lo) for t, lo in zip(best[1], lower)))

    def _objective(self, theta: list[float]) -> float:
        """θᵀAθ − 2bᵀθ of the ridge normal equations (the squared error up to a constant)."""
        quad = sum(theta[i] * (self._xx[i][j] + (self._ridge[i] if i == j else 0.0)) * theta[j]
                   for i in range(3) for j in range(3))
        return quad - 2 * sum(theta[i] * (self._xy[i] + self._ridge[i] * self._prior[i]) for i in range(3))

    def _solve_with(self, pinned: dict[int, float]) -> list[float]:
        xx, ridge = self._xx, self._ridge
        free = [i for i in range(3) if i not in pinned]
        a, b = [], []
        for i in free:
            row, r = xx[i], ridge[i]
            a.append([row[j] + (r if i == j else 0.0) for j in free])
            b.append(self._xy[i] + r * self._prior[i] - sum(row[k] * v for k, v in pinned.items()))
        theta = dict(pinned)
        theta.update(zip(free, _solve(a, b)))
        return [theta[0], theta[1], theta[2]]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; the ridge keeps the matrix positive definite. Run once a step
    under a policy that asks for Γ: loops written out (no lambda, rows held in locals), same arithmetic in the
    same order."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        pivot, best = col, abs(m[col][col])  # the first row with the largest magnitude, as max() picks it
        for r in range(col + 1, n):
            v = abs(m[r][col])
            if v > best:
                pivot, best = r, v
        m[col], m[pivot] = m[pivot], m[col]
        top = m[col]
        for r in range(col + 1, n):
            row = m[r]
            f = row[col] / top[col]
            for c in range(col, n + 1):
                row[c] -= f * top[c]
    x = [0.0] * n
    for r in reversed(range(n)):
        row = m[r]
        x[r] = (row[n] - sum(row[c] * x[c] for c in range(r + 1, n))) / row[r]
    return x
