"""`tokenflow simulate --trace T.jsonl --prefix-cache off|device|device+host`: hits from a Mooncake trace's
hash_ids, through the engine's own block keys and LRU, per tier in the JSON; and the tiers' invariants on every
simulated step."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tokenflow_ray.cli import main
from tokenflow_ray.engine.config import prefix_cache_overrides
from tokenflow_ray.sim.experiments import simulate_policy
from tokenflow_ray.workloads.traces import TraceOptions, load_trace


def conversations_trace(path: Path, conversations: int = 16, turns: int = 3, seed: int = 0) -> Path:
    """A Mooncake-format trace: `conversations` chats behind one 2-block system prompt, turns interleaved, each
    turn's hash ids its conversation so far plus new ones (one id per 512 tokens, as Mooncake's)."""
    rng = random.Random(seed)
    next_id = 2  # ids 0, 1: the system prompt
    history = {c: [0, 1] for c in range(conversations)}
    rows, t = [], 0
    for _turn in range(turns):
        for c in range(conversations):
            new = rng.randint(2, 4)
            history[c] = history[c] + list(range(next_id, next_id + new))
            next_id += new
            ids = history[c]
            rows.append({"timestamp": t, "input_length": 512 * len(ids) - rng.randint(0, 400),
                         "output_length": rng.randint(20, 60), "hash_ids": ids})
            t += rng.randint(100, 400)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory) -> Path:
    return conversations_trace(tmp_path_factory.mktemp("mooncake") / "chats.jsonl")


def _run(trace_path: Path, mode: str, out: Path) -> dict:
    assert main(["simulate", "--trace", str(trace_path), "--gpu", "4090", "--policy", "fcfs,tokenflow",
                 "--prefix-cache", mode, "--json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())


def test_each_tier_adds_hits_and_hits_cut_ttft(trace_path, tmp_path, capsys):
    runs = {mode: _run(trace_path, mode, tmp_path / f"{mode}.json") for mode in ("off", "device", "device+host")}
    prompt = sum(r.prompt_len for r in load_trace(trace_path, TraceOptions()).requests)
    for mode, run in runs.items():
        for name in ("fcfs", "tokenflow"):
            pc = run["policies"][name]["prefix_cache"]
            assert pc["mode"] == mode and pc["prompt_tokens"] == prompt
            assert run["policies"][name]["num_finished"] == 48
    off, dev, both = (runs[m]["policies"]["fcfs"] for m in ("off", "device", "device+host"))
    assert off["prefix_cache"]["hit_tokens_device"] == off["prefix_cache"]["hit_tokens_host"] == 0
    assert dev["prefix_cache"]["hit_tokens_device"] > 0 and dev["prefix_cache"]["hit_tokens_host"] == 0
    assert both["prefix_cache"]["hit_tokens_host"] > 0  # the 4090's pool cannot hold every conversation
    hits = [r["prefix_cache"]["hit_tokens_device"] + r["prefix_cache"]["hit_tokens_host"] for r in (dev, both)]
    assert hits[1] > hits[0]
    assert both["ttft_mean_s"] < dev["ttft_mean_s"] < off["ttft_mean_s"]
    assert "prompt tokens hit" in capsys.readouterr().out


def test_tiers_stay_consistent_on_every_step(trace_path):
    """The engine's integrity walk (ref counts, the free and evictable sets, both key maps, device and host) after
    every simulated step, under each policy, with both tiers on."""
    requests = load_trace(trace_path, TraceOptions(speed=4)).requests
    for policy in ("fcfs", "tokenflow", "andes"):
        summary = simulate_policy("4090", "llama3-8b", policy, requests, integrity=True,
                                  cache_overrides=prefix_cache_overrides("device+host"))
        assert summary["num_finished"] == len(requests) and summary["prefix_cache"]["hit_tokens_device"] > 0


def test_prefix_cache_modes_and_errors(capsys):
    assert prefix_cache_overrides("device") == {"enable_prefix_caching": True, "host_prefix_caching": False}
    with pytest.raises(ValueError, match="--prefix-cache"):
        prefix_cache_overrides("host")
    assert main(["simulate", "--table", "--prefix-cache", "device", "--no-progress"]) == 2
    assert "--prefix-cache: only with --trace or a single setup run" in capsys.readouterr().err


def test_a_setup_run_takes_the_mode_too(tmp_path):
    """The paper's setups share no prompt, but a paused stream's own blocks are hits: `--prefix-cache off` is how
    the figures from before caching was on are made again."""
    runs = {}
    for mode in ("off", "device+host"):
        out = tmp_path / f"{mode}.json"
        assert main(["simulate", "--gpu", "4090", "--setup", "a", "--policy", "fcfs", "--requests", "40",
                     "--prefix-cache", mode, "--json", str(out), "--no-progress"]) == 0
        runs[mode] = json.loads(out.read_text())["policies"]["fcfs"]["prefix_cache"]
    assert runs["off"]["mode"] == "off" and runs["off"]["hit_tokens_device"] == 0
    assert runs["device+host"]["mode"] == "device+host" and runs["off"]["prompt_tokens"] > 0
