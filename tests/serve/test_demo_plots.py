"""Demo plots from client records, without a server."""

from pathlib import Path

from tests.client_results import fake_load_result


def test_demo_plots_are_written(tmp_path):
    """The demo's plots (shared TTFT CDF, per-policy buffers) from the same kind of client records."""
    from tokenflow_ray.serve.plots import write_plots

    runs = {"tokenflow": fake_load_result(0.1, streams=3, tokens=4, finished=True),
            "fcfs": fake_load_result(0.6, streams=3, tokens=4, finished=True)}
    paths = write_plots(runs, tmp_path / "demo")
    assert {Path(p).name for p in paths} >= {"ttft_cdf.png"}
    assert all(Path(p).stat().st_size > 1000 for p in paths)
