"""The bench's parts on their own: the graphs part end to end on the CPU."""

from __future__ import annotations

import dataclasses
import json


def test_graphs_part_compares_eager_and_graph_runs_end_to_end(tmp_path, monkeypatch):
    """The part with `ModelConfig.enforce_eager` present (a subclass stands in until the CUDA graphs change is
    merged): both engines run every batch, and on the CPU (eager either way) the tokens are identical."""
    from tokenflow_ray.bench.gpu import graphs, steps
    from tokenflow_ray.bench.gpu.context import PartContext
    from tokenflow_ray.engine.config import ModelConfig

    @dataclasses.dataclass(frozen=True)
    class WithEnforceEager(ModelConfig):
        enforce_eager: bool = False

    monkeypatch.setattr(graphs, "ModelConfig", WithEnforceEager)
    monkeypatch.setattr(steps, "ModelConfig", WithEnforceEager)
    ctx = PartContext("graphs", "dry", None, tmp_path, tmp_path / "graphs.json", limit_s=300)
    graphs.run(ctx)
    saved = json.loads((tmp_path / "graphs.json").read_text())
    assert saved["graphs"]["graphs_active"] is False  # no CUDA graphs on the CPU
    assert saved["graphs_vs_eager"] == {"1": {"identical": 1, "of": 1, "first_diff": [None]},
                                        "2": {"identical": 2, "of": 2, "first_diff": [None, None]}}
    for label in ("graphs", "eager"):
        assert all(b["decode_step_ms_median"] > 0 and not b["stopped_early"] for b in saved[label]["batches"].values())
