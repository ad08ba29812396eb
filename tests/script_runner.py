"""Run a test script in its own Python process and read the JSON line it prints last.

For tests that need their own Ray (a `ray.cluster_utils.Cluster` of several raylets cannot share the process with
the session's Ray instance). `subprocess.run` kills the child when the timeout passes, and the script shuts its
cluster down in a `finally`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_json_script(script: Path, timeout_s: float = 280) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # its own cluster, never the session's
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout_s, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])
