"""`tokenflow demo --quick` as a newcomer runs it: its own process and Ray, its output read whole (stdout and stderr
merged, the channel this test owns). It must end with the table and the plots' paths, with nothing of Ray's after
(Serve's controller used to be killed mid-call: "ServeController.graceful_shutdown failed ... ray.kill")."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.serve.process_tools import Tokenflow, kill_session, short_tmp, wait_gone

pytestmark = pytest.mark.timeout(600)


def test_quick_demo_ends_with_its_table_and_plot_paths(tmp_path):
    ray_tmp = short_tmp()
    plots, report = tmp_path / "plots", tmp_path / "demo.json"
    demo = Tokenflow(["demo", "--quick", "--plots", str(plots), "--json", str(report)], ray_tmp)
    try:
        assert demo.wait(timeout_s=540) == 0, demo.output
        lines = [ln for ln in demo.lines if ln.strip()]
        assert lines[-2:] == [f"wrote {plots / 'ttft_cdf.png'}", f"wrote {plots / 'buffers.png'}"], lines[-12:]
        table_end = next(i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("└"))
        assert lines[table_end + 1:-2] == [] or all(any(w in ln for w in ("TTFT", "streams", "rejected", "QoE", "stall", "tok/s"))
                                                    for ln in lines[table_end + 1:-2]), lines[table_end:]  # the caption
        assert any(ln.startswith("│ tokenflow") for ln in lines) and any(ln.startswith("│ fcfs") for ln in lines)
        assert not any("graceful_shutdown" in ln or "ray.kill" in ln or "Traceback" in ln for ln in lines), \
            demo.output
        result = json.loads(report.read_text())
        assert set(result["policies"]) == {"tokenflow", "fcfs"}
        assert all((plots / name).stat().st_size > 1000 for name in ("ttft_cdf.png", "buffers.png"))
        assert wait_gone(ray_tmp, timeout_s=30) == []
    finally:
        demo.kill()
        kill_session(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
