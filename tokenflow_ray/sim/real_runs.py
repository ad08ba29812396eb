"""A serving run of the real engine, read from its JSON, for the simulator to replay and to calibrate on.

The format is the one of ../shared/data/h200/setup_a_eighth_{fcfs,tokenflow}.json (and of `jobs/gpu_bench.py`'s
serving runs). Keys the reader needs; any other key is ignored:

- `request_list` with `request_list_columns` naming at least `index`, `arrival_s`, `prompt_len`, `output_len`,
  `rate` (one row per request: the exact requests the engine ran).
- `engine`: `block_size`, `num_device_blocks`, `num_host_blocks`, `max_num_seqs`, `max_num_batched_tokens`,
  `kv_bytes_per_token`, and `policy` (or a top-level `policy`). Optional: `write_through`, `overlap_copies`,
  `write_budget_fraction`, `resume_mode`, `fcfs_reserve_ratio`, `vocab_size`, `max_model_len`, and `tokenflow` /
  `andes`: the policy config the run used, as a dict of its fields. A TokenFlowConfig field the dict does not name
  did not exist when the run was made: it takes the value that behaves as before it existed
  (`TokenFlowConfig.as_run`), so an old run replays the code that made it.
- `samples` with `samples_columns` naming at least `decodes`, `prefill_tokens`, `decode_context`, `step_s` (every
  step of the run, in order, timed whole on the wall clock); `prefill_pairs` and `sampled` are read when present.
- `summary`: `ttft_p50_s`, `ttft_p99_s`, `raw_tput`, `effective_tput`, `stall_s` (metrics.summarize of the run).
- Optional: `copy_bytes_s_median` (the run's measured copy bandwidth), `warmup_samples` (steps the engine ran
  before the recorded run, in the samples' columns: what its cost model had learnt at the start; absent, the
  project's standard warm-up request is assumed, `STANDARD_WARMUP`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow_ray.engine.policies import AndesConfig, TokenFlowConfig
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.sim.cost import StepShape
from tokenflow_ray.workloads.generators import RequestSpec

SUMMARY_KEYS = ("ttft_p50_s", "ttft_p99_s", "raw_tput", "effective_tput", "stall_s")
# The warm-up every driver of this project runs before it records (validate.run_real, lab/policy_bench.py): an
# 8-token prompt, 4 tokens out. Its steps are what the engine's cost model had learnt when the run began.
STANDARD_WARMUP = (8, 4)

Sample = tuple[StepShape, float]


@dataclass(frozen=True)
class RealRun:
    path: str
    policy: str
    requests: tuple[RequestSpec, ...]
    engine: EngineConfig
    info: ModelInfo
    samples: tuple[Sample, ...]
    summary: dict
    copy_bytes_s: float | None
    warmup: tuple[Sample, ...] | None  # None: the standard warm-up request ran first (STANDARD_WARMUP)


class RunFormatError(ValueError):
    pass


def read_real_run(path: str | Path) -> RealRun:
    """Read one run (module docstring); a missing or malformed key raises RunFormatError naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunFormatError(f"{path}: cannot read a run: {e}") from None
    if not isinstance(data, dict):
        raise RunFormatError(f"{path}: a run is a JSON object")
    return parse_real_run(data, str(path))


def parse_real_run(data: dict, name: str = "<run>") -> RealRun:
    engine = _need(data, "engine", name)
    policy = engine.get("policy", data.get("policy"))
    if policy not in ("fcfs", "andes", "tokenflow"):
        raise RunFormatError(f"{name}: engine.policy: expected fcfs, andes or tokenflow, got {policy!r}")
    requests = tuple(RequestSpec(int(r["index"]), float(r["arrival_s"]), int(r["prompt_len"]), int(r["output_len"]),
                                 float(r["rate"]))
                     for r in _rows(data, "request_list", ("index", "arrival_s", "prompt_len", "output_len", "rate"),
                                    name))
    if not requests:
        raise RunFormatError(f"{name}: request_list is empty")
    summary = _need(data, "summary", name)
    for k in SUMMARY_KEYS:
        if not isinstance(summary.get(k), (int, float)):
            raise RunFormatError(f"{name}: summary.{k}: a number is needed")
    need = ("block_size", "num_device_blocks", "num_host_blocks", "max_num_seqs", "max_num_batched_tokens",
            "kv_bytes_per_token")
    for k in need:
        if not isinstance(engine.get(k), int):
            raise RunFormatError(f"{name}: engine.{k}: an integer is needed")
    longest = max(r.prompt_len + r.output_len for r in requests) + 1
    info = ModelInfo(name=str(engine.get("model", "real run")), vocab_size=int(engine.get("vocab_size", 128_256)),
                     max_model_len=int(engine.get("max_model_len", longest)), eos_token_ids=frozenset(),
                     kv_bytes_per_token=engine["kv_bytes_per_token"])
    copy_bw = data.get("copy_bytes_s_median")
    warmup = _samples(data, "warmup_samples", name, data.get("samples_columns")) if "warmup_samples" in data else None
    return RealRun(path=name, policy=policy, requests=requests, engine=engine_config(engine, policy, len(requests)),
                   info=info, samples=_samples(data, "samples", name), summary=dict(summary),
                   copy_bytes_s=float(copy_bw) if isinstance(copy_bw, (int, float)) and copy_bw > 0 else None,
                   warmup=warmup)


def engine_config(engine: dict, policy: str, num_requests: int) -> EngineConfig:
    cache = CacheConfig(block_size=engine["block_size"], num_device_blocks=engine["num_device_blocks"],
                        num_host_blocks=engine["num_host_blocks"],
                        write_through=bool(engine.get("write_through", True)),
                        overlap_copies=bool(engine.get("overlap_copies", True)),
                        write_budget_fraction=float(engine.get("write_budget_fraction", 0.8)),
                        resume_mode=str(engine.get("resume_mode", "auto")))
    tokenflow = TokenFlowConfig.as_run(engine.get("tokenflow") or {})
    andes = engine.get("andes") or {}
    known = {f.name for f in fields(AndesConfig)}
    sched = SchedulerConfig(max_num_seqs=engine["max_num_seqs"], max_num_batched_tokens=engine["max_num_batched_tokens"],
                            policy=policy, tokenflow=tokenflow,
                            andes=AndesConfig(**{k: v for k, v in andes.items() if k in known}),
                            fcfs_reserve_ratio=float(engine.get("fcfs_reserve_ratio", 0.3)))
    return EngineConfig(cache=cache, scheduler=sched, record_history=num_requests + 8)


def _need(data: dict, key: str, name: str) -> dict:
    value = data.get(key)
    if not isinstance(value, dict):
        raise RunFormatError(f"{name}: {key!r}: an object is needed")
    return value


def _rows(data: dict, key: str, columns: Sequence[str], name: str,
          given_columns: Sequence[str] | None = None) -> list[dict]:
    cols = given_columns if given_columns is not None else data.get(f"{key}_columns")
    rows = data.get(key)
    if not isinstance(cols, list) or not isinstance(rows, list):
        raise RunFormatError(f"{name}: {key!r} and {key + '_columns'!r}: lists are needed")
    if missing := [c for c in columns if c not in cols]:
        raise RunFormatError(f"{name}: {key}_columns lacks {missing}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(cols):
            raise RunFormatError(f"{name}: {key}[{i}]: a row of {len(cols)} values is needed")
        out.append(dict(zip(cols, row)))
    return out


def _samples(data: dict, key: str, name: str, columns: Sequence[str] | None = None) -> tuple[Sample, ...]:
    out = []
    for r in _rows(data, key, ("decodes", "prefill_tokens", "decode_context", "step_s"), name,
                   columns if key != "samples" else None):
        d, p = int(r["decodes"]), int(r["prefill_tokens"])
        shape = StepShape(d, p, int(r["decode_context"]), float(r.get("prefill_pairs", 0.0)),
                          int(r.get("sampled", d)))
        out.append((shape, float(r["step_s"])))
    if key == "samples" and not out:
        raise RunFormatError(f"{name}: samples is empty")
    return tuple(out)
