"""SimRunner: the runner interface (engine/runner_api.py) priced by a cost model instead of run.

No KV is stored and no context is hashed (engine/fake_runner.py is O(L²) per stream): a step's cost is read off
the plan's shape in O(batch), and every sampled token is `token_id`. Copies are priced on the replica's host link
(cost.py): the tails of streams preempted this step first, in plan order (their `swap_out_s` is when each landed),
then write-through; loads run beside evictions when the engine overlaps copies and the link is duplex, each
direction then slowed by sharing the link (else after them). With `cold` (cold_start.py), a step also pays for
what this replica's engine has not warmed (new attention shapes, its first step) and at the pace the run kept, as
the measured H200 engine did. Copies that outlast the model step stretch it (they are joined at step end), so write-through,
chunked loads and load/evict overlap cost what they would; the scheduler's copy budget keeps them within the
step, and when it misjudges, the queueing shows up here as longer steps.

Migration (`export_kv` / `import_kv`, what LLMEngine.try_export / import_stream call) is accounting only: there is
no KV, so a stream's exported "data" is its block count, checked on import. The network transfer is priced by
the simulator (migration.py's MigrationLink), the later load on the target's host link here like any load.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenflow_ray.engine.clock import VirtualClock
from tokenflow_ray.engine.plan import StepPlan, StepResult
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.sim.cold_start import ColdStart, ColdState, shape_keys
from tokenflow_ray.sim.cost import HostLink, StepCost, StepShape


@dataclass
class RunnerTotals:
    steps: int = 0
    busy_s: float = 0.0  # Σ step time
    compute_s: float = 0.0
    copy_s: float = 0.0
    tokens_scheduled: int = 0  # prefill + decode tokens fed
    tokens_sampled: int = 0
    blocks_out: int = 0
    blocks_in: int = 0
    blocks_exported: int = 0  # host blocks handed to a migrated stream's export
    blocks_imported: int = 0
    cold_steps: int = 0  # steps that paid for attention shapes not run before (cold_start.py)
    cold_s: float = 0.0
    speed_s: float = 0.0  # what the pace over time added (cold_start.ColdStart.speed)


@dataclass(frozen=True)
class LoggedStep:
    shape: StepShape
    keys: list[tuple[int, ...]]  # attention shapes (cold_start.shape_keys)
    step_s: float


class SimRunner:
    def __init__(self, info: ModelInfo, cost: StepCost, block_size: int, link: HostLink,
                 overlap_copies: bool = True, cpu_overhead_s: float = 0.0, token_id: int = 0,
                 cold: ColdStart | None = None, clock: VirtualClock | None = None,
                 overlap_scheduling: bool = False) -> None:
        if not 0 <= token_id < info.vocab_size or token_id in info.eos_token_ids:
            raise ValueError(f"token_id: must be a non-eos id in [0, {info.vocab_size})")
        if cpu_overhead_s < 0:
            raise ValueError("cpu_overhead_s: must be >= 0")
        self.info = info
        self.cost = cost
        self.link = link
        self.block_size = block_size
        self.block_bytes = info.kv_bytes_per_token * block_size
        self.overlap_copies = overlap_copies
        self.cpu_overhead_s = cpu_overhead_s  # the scheduler's own time per step (host CPU)
        self.overlap_scheduling = overlap_scheduling  # planned beside the device step: only its excess counts
        self.token_id = token_id
        self.totals = RunnerTotals()
        self.cold = ColdState(cold, block_size) if cold is not None and cold.active else None
        self.clock = clock  # the simulation's clock: a run's pace over time (cold_start.py) reads it
        # Set to a list to keep each step's shape, attention-shape keys and time (calibration replays read them).
        self.step_log: list[LoggedStep] | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        shape = StepShape.of(plan)
        compute = self.cost.step_s(shape)
        if self.cold is not None:
            compute = self.cold.step_s(plan, compute, self.clock.now() if self.clock is not None else None)
        n_out = len(plan.swap_out) + len(plan.write_through)
        n_in = len(plan.swap_in)
        both = self.overlap_copies and self.link.duplex and n_out > 0 and n_in > 0
        out_block = self.link.block_s(self.block_bytes, both)
        swap_out_s: dict[str, float] = {}
        elapsed = 0.0
        for c in plan.swap_out:
            elapsed += out_block
            swap_out_s[c.stream_id] = elapsed
        out_s = n_out * out_block
        in_s = n_in * self.link.block_s(self.block_bytes, both)
        if self.overlap_copies:
            copy_s = max(out_s, in_s) if self.link.duplex else out_s + in_s
            step = max(compute, copy_s)
        else:  # copies before the model step, evictions then loads
            copy_s = out_s + in_s
            step = compute + copy_s
        step = max(step, self.cpu_overhead_s) if self.overlap_scheduling else step + self.cpu_overhead_s
        if self.step_log is not None:
            self.step_log.append(LoggedStep(shape, shape_keys(plan, self.block_size), step))
        sampled = {c.stream_id: self.token_id for c in plan.decodes if c.sample}
        sampled.update((c.stream_id, self.token_id) for c in plan.prefills if c.sample)
        t = self.totals
        t.steps += 1
        t.busy_s += step
        t.compute_s += compute
        t.copy_s += copy_s
        t.tokens_scheduled += shape.tokens
        t.tokens_sampled += len(sampled)
        t.blocks_out += n_out
        t.blocks_in += n_in
        if self.cold is not None:
            t.cold_steps, t.cold_s, t.speed_s = self.cold.cold_steps, self.cold.cold_s, self.cold.speed_extra_s
        return StepResult(step_id=plan.step_id, sampled=sampled, compute_s=compute, copy_s=copy_s,
                          copy_bytes=(n_out + n_in) * self.block_bytes, swap_out_s=swap_out_s, step_s=step)

    # ---- migration: nothing to copy, only counted --------------------------------------------------------------
    def export_kv(self, host_block_ids: list[int]) -> int:
        self.totals.blocks_exported += len(host_block_ids)
        return len(host_block_ids)

    def import_kv(self, host_block_ids: list[int], data: int) -> None:
        if data != len(host_block_ids):
            raise ValueError(f"KV blocks: {data} exported, {len(host_block_ids)} host blocks given")
        self.totals.blocks_imported += len(host_block_ids)
