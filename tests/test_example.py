"""example.py at the repository root runs as a newcomer runs it: its own process, its output read whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(600)


def test_example_prints_a_completion_per_prompt():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "example.py"], cwd=ROOT, capture_output=True, text=True, timeout=580,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if " -> " in line]
    assert len(lines) == 2 and all(line.endswith("(32 tokens, length)") or "stop)" in line for line in lines), \
        proc.stdout
