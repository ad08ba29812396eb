"""A model runner without a model, for CPU tests and the simulator.

It keeps a fake paged KV store (one token id per slot) and writes every scheduled chunk into the slots its block
table names. The next token is a hash of the context read *back from those blocks*, so a wrong block table, a block
shared by two streams or a stale block changes the output, exactly as it would corrupt a real model's attention.

Copies land before the step's KV writes by default. With `late_copies` they land as a GPU's do: after the step's
writes (its side streams run beside the step's kernels), before the next step's (the join orders them), and before
the host store is read or written here (`settle`, as the torch runner settles before migration touches it). A block
freed, reused and written while its copy is still to land then corrupts the output instead of passing unseen.
"""

from __future__ import annotations

from tokenflow_ray.engine.block_tables import BlockTables
from tokenflow_ray.engine.plan import PENDING_TOKEN, ScheduledChunk, StepPlan, StepResult
from tokenflow_ray.engine.runner_api import ModelInfo


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 256, max_model_len: int = 4096,
                 eos_token_id: int | None = None, num_host_blocks: int = 0, step_cost_s: float = 0.01,
                 copy_cost_s: float = 0.001, late_copies: bool = False) -> None:
        self.block_size = block_size
        self.late_copies = late_copies
        self._unlanded: StepPlan | None = None  # late_copies: the last step's copies, still to land
        self.vocab_size = vocab_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.host_slots: list[int | None] = [None] * (num_host_blocks * block_size)
        self.step_cost_s = step_cost_s  # reported compute time per step (virtual)
        self.copy_cost_s = copy_cost_s  # reported copy time per block (virtual)
        self.info = ModelInfo(name="fake", vocab_size=vocab_size, max_model_len=max_model_len,
                              eos_token_ids=frozenset() if eos_token_id is None else frozenset({eos_token_id}),
                              kv_bytes_per_token=64)
        self.steps = 0
        self.block_tables = BlockTables()  # rebuilt from the plans' diffs: every slot below goes through it
        self._last_sampled: dict[str, int] = {}  # for decodes planned before their input token was sampled

    def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        self.settle()  # the previous step's copies land before this step's writes
        if self.late_copies and plan.has_copies:
            self._unlanded = plan
        else:
            self._land(plan)
        sampled: dict[str, int] = {}
        for sid in plan.finished:
            self._last_sampled.pop(sid, None)
        self.block_tables.apply(plan)
        for chunk in (*plan.decodes, *plan.prefills):
            self._write(chunk)
            if chunk.sample:
                sampled[chunk.stream_id] = self.next_token(self._read(chunk, chunk.start_pos + len(chunk.token_ids)))
        self._last_sampled.update(sampled)
        copies, bs = len(plan.swap_out) + len(plan.write_through) + len(plan.swap_in), self.block_size
        return StepResult(step_id=plan.step_id, sampled=sampled, compute_s=self.step_cost_s if not plan.is_empty else 0,
                          copy_s=copies * self.copy_cost_s, copy_bytes=copies * self.info.kv_bytes_per_token * bs,
                          swap_out_s=self._swap_out_times(plan))

    def settle(self) -> None:
        """Land the copies still in flight (late_copies)."""
        if self._unlanded is not None:
            plan, self._unlanded = self._unlanded, None
            self._land(plan)

    def _land(self, plan: StepPlan) -> None:
        bs = self.block_size
        for c in (*plan.swap_out, *plan.write_through):  # device -> host, whole blocks
            self.host_slots[c.host_block * bs:(c.host_block + 1) * bs] = \
                self.slots[c.device_block * bs:(c.device_block + 1) * bs]
        for c in plan.swap_in:
            self.slots[c.device_block * bs:(c.device_block + 1) * bs] = \
                self.host_slots[c.host_block * bs:(c.host_block + 1) * bs]

    # ---- migration: the host slots of some blocks out, and into another runner's host store -----------------
    def export_kv(self, host_blocks: list[int]) -> list[list[int | None]]:
        self.settle()
        bs = self.block_size
        return [self.host_slots[b * bs:(b + 1) * bs] for b in host_blocks]

    def import_kv(self, host_blocks: list[int], data: list[list[int | None]]) -> None:
        if len(data) != len(host_blocks) or any(len(d) != self.block_size for d in data):
            raise ValueError("KV blocks: shape does not match this store")
        self.settle()  # a copy still in flight to these blocks (their previous owner's) must not land afterwards
        bs = self.block_size
        for b, d in zip(host_blocks, data):
            self.host_slots[b * bs:(b + 1) * bs] = d

    def _swap_out_times(self, plan: StepPlan) -> dict[str, float]:
        """Tails copied one stream after another, in plan order, at copy_cost_s a block."""
        done: dict[str, float] = {}
        elapsed = 0.0
        for c in plan.swap_out:
            elapsed += self.copy_cost_s
            done[c.stream_id] = elapsed
        return done

    def next_token(self, context: list[int]) -> int:
        """The reference 'model': a deterministic function of the whole context."""
        h = len(context)
        for i, t in enumerate(context):
            h = (h * 1_000_003 + (i + 1) * (t + 7)) % 2_147_483_647
        return h % self.vocab_size

    def _slot(self, chunk: ScheduledChunk, pos: int) -> int:
        return self.block_tables.tables[chunk.stream_id][pos // self.block_size] * self.block_size + \
            pos % self.block_size

    def _write(self, chunk: ScheduledChunk) -> None:
        for i, t in enumerate(chunk.token_ids):
            if t == PENDING_TOKEN:
                t = self._last_sampled[chunk.stream_id]
            self.slots[self._slot(chunk, chunk.start_pos + i)] = t

    def _read(self, chunk: ScheduledChunk, length: int) -> list[int]:
        context = [self.slots[self._slot(chunk, p)] for p in range(length)]
        if any(t is None for t in context):
            raise AssertionError(f"{chunk.stream_id}: reads a KV slot that was never written")
        return context  # type: ignore[return-value]

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        """What an uninterrupted, unbatched run produces."""
        ctx = list(prompt)
        out: list[int] = []
        for _ in range(max_tokens):
            t = self.next_token(ctx)
            out.append(t)
            ctx.append(t)
            if t in self.info.eos_token_ids:
                break
        return out
