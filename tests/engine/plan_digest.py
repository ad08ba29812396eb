"""Digests of every decision the engine makes on seeded workloads, to hold speed work to "same decisions".

Each case runs the real engine (scheduler, policy, KV manager, readers, records) and hashes, step by step, the
whole plan (chunks, block ids, preemptions, copies, new streams), every output, and at the end every stream's
record (token times and buffers, preemptions, recompute, stall) and the scheduler's counters. A change that only
makes the host work faster leaves every digest as it was; one that changes a decision, a block id or a float
does not.

The golden digests in data/plan_digests.json were captured from the engine as it stood before the host-time work
(main at 5e9bf8e plus this file). When a policy's decisions change on purpose, write them again:
    PYTHONPATH=$PWD python -m tests.engine.plan_digest --write
and say so in the commit; then re-run the test on the speed-ups to check they keep the new decisions too.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path

from tokenflow_ray.engine.clock import VirtualClock
from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow_ray.engine.fake_runner import FakeRunner
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.policies import AndesConfig, TokenFlowConfig
from tokenflow_ray.engine.sampling import SamplingParams

GOLDEN = Path(__file__).parent / "data" / "plan_digests.json"
POLICIES = ("fcfs", "tokenflow", "andes")


class _Digest:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        # Plans on their own: with overlapped scheduling the runner thread sees them, in step order but at times
        # that interleave with the outputs the caller sees.
        self.plans = hashlib.sha256()
        self.steps = self.tokens = 0
        self.stats: dict = {}

    def digest(self) -> str:
        return hashlib.sha256((self.plans.hexdigest() + self.h.hexdigest()).encode()).hexdigest()

    def add(self, obj: object) -> None:
        self.h.update(repr(obj).encode())
        self.h.update(b"\n")


def _fake_engine(policy: str, overlap: bool) -> LLMEngine:
    block = 8
    config = EngineConfig(
        cache=CacheConfig(block_size=block, num_device_blocks=48, num_host_blocks=160),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, policy=policy,
                                  tokenflow=TokenFlowConfig(delta_t=0.2), andes=AndesConfig(delta_t=0.2)),
        overlap_scheduling=overlap)
    runner = FakeRunner(48, block, eos_token_id=3, num_host_blocks=160, step_cost_s=0.02, copy_cost_s=0.0005)
    return LLMEngine(config, runner, tokenizer=None, clock=VirtualClock())


def _fake_requests(engine: LLMEngine, seed: int) -> None:
    """Arrivals over 3 s (a burst at 0), mixed rates, some stop tokens and eos: every path of the scheduler."""
    rng = random.Random(seed)
    for i in range(34):
        arrival = 0.0 if i < 14 else rng.uniform(0.0, 3.0)
        prompt = [rng.randrange(4, 250) for _ in range(rng.randint(3, 40))]
        sampling = SamplingParams(max_tokens=rng.randint(8, 70), ignore_eos=rng.random() < 0.7,
                                  stop_token_ids=(rng.randrange(4, 250),) if rng.random() < 0.2 else ())
        engine.add_request(prompt, sampling, stream_id=f"f{i:02d}", arrival_time=arrival,
                           rate=rng.choice([0.0, 8.0, 20.0, 20.0, 40.0]))


def _events(engine: LLMEngine, step: int) -> None:
    """Aborts and client reports at fixed steps (when the stream is live)."""
    live = engine.scheduler.streams
    if step == 30 and "f03" in live:
        engine.abort("f03")
    if step == 45 and "f05" in live:
        engine.report_consumption("f05", paused=True)
    if step == 80 and "f05" in live:
        engine.report_consumption("f05", paused=False, rate=30.0)
    if step == 60 and "f07" in live and live["f07"].reader.generated:
        engine.report_consumption("f07", consumed_tokens=live["f07"].reader.generated)


def _run(engine: LLMEngine, d: _Digest, max_steps: int, step_s: float, events: bool) -> None:
    execute = engine.runner.execute

    def traced(plan):
        d.plans.update(repr(plan).encode() + b"\n")
        return execute(plan)

    engine.runner.execute = traced
    for step in range(max_steps):
        if not engine.has_unfinished():
            break
        if events:
            _events(engine, step)
        outs = engine.step()
        d.add(outs)
        d.steps += 1
        d.tokens += sum(len(o.token_ids) for o in outs)
        engine.clock.advance(step_s)
    _finish(engine, d)


def _finish(engine: LLMEngine, d: _Digest) -> None:
    s = engine.scheduler
    records = sorted(list(engine.finished_records) + [x.record for x in s.streams.values()],
                     key=lambda r: r.stream_id)
    for r in records:
        d.add(asdict(r))
    stats = engine.stats()
    d.add((s.bytes_to_host, s.bytes_from_host, s.preempt_costs_s, s.preempt_tail_s, stats))
    # Shown beside the digest, so a case can be seen to reach preemption, swaps and loads.
    block = s.cost.block_bytes
    d.stats = {"preemptions": stats.preemptions, "swaps": len(s.preempt_tail_s),
               "recomputed": stats.tokens_recomputed, "blocks_out": s.bytes_to_host // block,
               "blocks_in": s.bytes_from_host // block}


def fake_case(policy: str, overlap: bool = False) -> dict:
    engine = _fake_engine(policy, overlap)
    _fake_requests(engine, seed=7)
    d = _Digest()
    _run(engine, d, max_steps=3000, step_s=0.02, events=True)
    return {"sha256": d.digest(), "steps": d.steps, "tokens": d.tokens, **d.stats}


def null_case(policy: str, streams: int = 160, steps: int = 650) -> dict:
    """The host bench's regime (the H200 pool, setup (a) at 1/8, 20 ms steps) on the NullRunner."""
    from tokenflow_ray.lab.host_bench import HostBenchConfig, build_engine

    engine = build_engine(HostBenchConfig(), policy, streams)
    clock, runner = engine.clock, engine.runner
    d = _Digest()
    for _ in range(steps):  # as the bench steps it: the clock moves between begin_step and finish_step
        begun = engine.begin_step()
        if begun.plan is None:
            clock.advance(0.02)
            continue
        d.add(begun.plan)
        result = runner.execute(begun.plan)
        clock.advance(0.02)
        outs = engine.finish_step(begun, result)
        d.add(outs)
        d.steps += 1
        d.tokens += len(outs)
    _finish(engine, d)
    return {"sha256": d.digest(), "steps": d.steps, "tokens": d.tokens, **d.stats}


def sim_case(policy: str) -> dict:
    """The simulator's summary of setup (a) on the H200 profile at 1/8 length (requests and both pools)."""
    from dataclasses import replace

    from tokenflow_ray.sim.experiments import simulate_policy
    from tokenflow_ray.sim.setups import paper_setup, setup_requests

    reqs = [replace(r, prompt_len=max(8, round(r.prompt_len / 8)), output_len=max(16, round(r.output_len / 8)))
            for r in setup_requests(paper_setup("h200", "a"), seed=3, num_requests=240)]
    pools = {"num_device_blocks": 1734, "num_host_blocks": 6936}
    summary = simulate_policy("h200", "llama3-8b", policy, reqs, cache_overrides=pools, checks=True)
    text = json.dumps(summary, sort_keys=True)
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "steps": summary["steps"],
            "preemptions": summary["preemptions"], "completion_s": round(summary["completion_s"], 3)}


CASES = {
    **{f"fake/{p}": (lambda p=p: fake_case(p)) for p in POLICIES},
    **{f"fake_overlap/{p}": (lambda p=p: fake_case(p, overlap=True)) for p in POLICIES},
    **{f"null_h200/{p}": (lambda p=p: null_case(p)) for p in POLICIES},
    **{f"sim_h200_a/{p}": (lambda p=p: sim_case(p)) for p in POLICIES},
}


def main(argv: list[str]) -> int:
    digests = {name: case() for name, case in CASES.items()}
    if "--write" in argv:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}")
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    for name, got in digests.items():
        print(f"{name:24} {'same' if golden.get(name) == got else 'DIFFERS'} {got}")
    return 0 if all(golden.get(n) == g for n, g in digests.items()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
