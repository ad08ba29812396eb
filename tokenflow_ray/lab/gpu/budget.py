"""The bench's parts, their tasks and time limits: the whole bench fits 8 minutes on one H200 (`--quick`: 3).

Each task is one process under its limit, which covers the interpreter's start, torch's import, CUDA's start and
the model's load (a Llama-3-8B dummy load took 7-17 s a process on the H200). A task past its limit is killed and
recorded with what it had saved; the next runs. The limits are caps, so their sum is the worst case:

| part | what | full (s) | quick (s) | dry-run cap (s) |
|---|---|---|---|---|
| attention | every backend vs SDPA and a float64 CPU reference, fp32 and bf16 | 30 | 18 | 240 |
| parity | the embedded model: engine vs HF generate, fp32 (+ bf16 agreement) | 35 | 22 | 240 |
| graphs | 8B-shape decode, CUDA graphs vs eager (two 8B dummy loads) | 55 | dropped | 240 |
| step_grid | 8B-shape step grid (7 points) + the roofline point | 70 | 42 (3 points) | 240 |
| copies | host<->device bandwidth, overlap, KVTransfer blocks out/in | 25 | 14 | 240 |
| serving | setup (a) at 1/8, one process per policy: fcfs, tokenflow, andes | 3 x 85 | 2 x 35 (no andes) | 3 x 240 |
| **sum** | | **470** | **166** | |

The orchestrator itself (machine facts, writing the JSON) takes a few seconds: 470 + ~5 s < 480 s, 166 + ~5 s <
180 s. A serving run stops itself ~4 s before its limit (`stopped_early`, the partial summary written), so today's
engine, whose full fcfs run took 114 s on the H200, is cut at ~70 s of serving; at the issue's goals it fits.
Besides the caps, the whole bench has a budget (480 s, quick 180 s): a task gets at most what is left of it.
A dry run's work is small (10-40 s a part on two cores); its caps are wide because a shared CPU box can be slow.
"""

from __future__ import annotations

from dataclasses import dataclass

PART_NAMES = ("attention", "parity", "graphs", "step_grid", "copies", "serving")
MODES = ("full", "quick", "dry")
SERVING_POLICIES = ("fcfs", "tokenflow", "andes")
QUICK_POLICIES = ("fcfs", "tokenflow")
BUDGET_S = {"full": 480.0, "quick": 180.0, "dry": None}  # the whole bench; None: no cap beyond the tasks'
MIN_TASK_S = 10.0  # a task with less than this left of the budget is skipped, not started


@dataclass(frozen=True)
class PartBudget:
    name: str
    full_s: float
    quick_s: float | None  # None: the part is dropped from --quick
    dry_s: float

    def limit_s(self, mode: str) -> float | None:
        return {"full": self.full_s, "quick": self.quick_s, "dry": self.dry_s}[mode]


PARTS = {
    "attention": PartBudget("attention", 30, 18, 240),
    "parity": PartBudget("parity", 35, 22, 240),
    "graphs": PartBudget("graphs", 55, None, 240),
    "step_grid": PartBudget("step_grid", 70, 42, 240),
    "copies": PartBudget("copies", 25, 14, 240),
    "serving": PartBudget("serving", 85, 35, 240),  # per policy
}
assert tuple(PARTS) == PART_NAMES


def tasks(part: str, mode: str) -> tuple[str | None, ...]:
    """The processes a part runs as: one per serving policy, else one."""
    if part == "serving":
        return QUICK_POLICIES if mode == "quick" else SERVING_POLICIES
    return (None,)


def worst_case_s(mode: str) -> float:
    """The sum of the caps of every task a mode runs (what the docstring's table adds up)."""
    total = 0.0
    for name, part in PARTS.items():
        limit = part.limit_s(mode)
        if limit is not None:
            total += limit * len(tasks(name, mode))
    return total
