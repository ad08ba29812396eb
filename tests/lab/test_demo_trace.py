"""`tokenflow demo --trace` and `jobs/serve_bench.py --trace`: a trace's requests become the paced HTTP clients."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenflow_ray.lab.demo import demo_config, trace_prompt
from tokenflow_ray.workloads.traces import TraceOptions, load_trace

SLICE = Path(__file__).parents[1] / "workloads" / "data" / "azure_conv_slice.csv"


def test_a_trace_sets_each_clients_prompt_length_output_rate_and_start():
    trace = load_trace(SLICE, TraceOptions(window=(0, 0.5), speed=2, length_scale=0.1))
    cfg = demo_config(trace=trace)
    specs = cfg.specs()
    assert len(specs) == len(trace.requests) > 5
    for spec, r in zip(specs, trace.requests):
        # The embedded model's byte-level tokenizer: one token a byte, and two its template adds.
        assert len(spec.prompt.encode()) + 2 == max(r.prompt_len, len(f"Reader {r.index:05d}: ") + 2)
        assert (spec.max_tokens, spec.rate, spec.start_s) == (r.output_len, r.rate, r.arrival_s)
    assert len({s.prompt[:14] for s in specs}) == len(specs)  # no two share a prefix by accident
    assert cfg.timeout_s >= 4 * trace.requests[-1].arrival_s
    assert cfg.stream_tokens == round(trace.describe()["mean_prompt"] + trace.describe()["mean_output"])


def test_a_trace_refuses_the_burst_options():
    trace = load_trace(SLICE, TraceOptions(window=(0, 0.5)))
    with pytest.raises(ValueError, match="--trace"):
        demo_config(streams=10, trace=trace)
    assert trace_prompt(3, 40).startswith("Reader 00003: ") and len(trace_prompt(3, 40)) == 38
