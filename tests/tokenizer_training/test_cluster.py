import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_workers_run_on_both_raylets_and_corrupt_files_are_counted():
    """Own subprocess: a Cluster of two raylets cannot share the process with the session's Ray instance."""
    script = Path(__file__).with_name("cluster_script.py")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["step"] == 8
    assert len(out["cluster_nodes"]) == 2
    assert sorted(set(out["worker_node_ids"])) == out["cluster_nodes"]  # one worker on each raylet
    assert out["skipped_images"] >= 1  # corrupt files in the input folder counted; training went on
