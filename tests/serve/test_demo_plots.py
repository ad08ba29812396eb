"""Demo plots from client records, without a server."""

from pathlib import Path


def test_demo_plots_are_written(tmp_path):
    """The demo's plots (shared TTFT CDF, per-policy buffers) from the same kind of client records."""
    from tokenflow_ray.client import LoadResult, StreamResult, StreamSpec
    from tokenflow_ray.metrics.stream_metrics import StreamRecord
    from tokenflow_ray.serve.plots import write_plots

    def run(delay: float) -> LoadResult:
        results = []
        for i in range(3):
            rec = StreamRecord(f"s{i}", 0.1 * i, 20.0, 8)
            for j in range(4):
                rec.record_token(0.1 * i + delay + 0.05 * j, float(j))
            rec.mark_finished()
            results.append(StreamResult(StreamSpec("p", max_tokens=4, rate=20.0), f"s{i}", rec, num_tokens=4,
                                        finish_reason="length"))
        return LoadResult(results, 1.0)

    paths = write_plots({"tokenflow": run(0.1), "fcfs": run(0.6)}, tmp_path / "demo")
    assert {Path(p).name for p in paths} >= {"ttft_cdf.png"}
    assert all(Path(p).stat().st_size > 1000 for p in paths)
