"""Run `tokenflow` as its own process (its own Ray, in its own temp dir), read its output, find what it left.

A Ray session's processes (raylet, GCS, workers, replicas) all inherit the driver's environment, so the RAY_TMPDIR
given to the driver marks every process of that session, whatever Ray renames it to (`ray::ServeReplica...`).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def session_env(ray_tmp: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, **extra, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RAY_ADDRESS", None)  # its own Ray, never the test session's
    return env


def short_tmp() -> str:
    """Ray's socket paths must stay under 108 bytes: a short dir in /tmp, not pytest's deep tmp_path."""
    return tempfile.mkdtemp(prefix="tf", dir="/tmp")


def processes_of(ray_tmp: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries RAY_TMPDIR=ray_tmp."""
    marker = f"RAY_TMPDIR={ray_tmp}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if marker not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found.append(int(entry))
    return found


def wait_gone(ray_tmp: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = processes_of(ray_tmp)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = processes_of(ray_tmp)
    return left


class Tokenflow:
    """`python -m tokenflow_ray.cli ARGS` in its own process group, stdout and stderr merged into one channel the
    test owns; lines are collected by a thread."""

    def __init__(self, args: list[str], ray_tmp: str, **env: str) -> None:
        self.ray_tmp = ray_tmp
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenflow_ray.cli", *args], cwd=ROOT,
                                     env=session_env(ray_tmp, **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout_s: float) -> str:
        """The first output line containing `text` (from the start); AssertionError with the output if none comes."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if text in line:
                    return line
            seen = len(self.lines)
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and self._queue.empty():
                raise AssertionError(f"no line with {text!r}; output:\n" + "\n".join(self.lines[-60:]))
            try:
                self._queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                pass

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        """End the process group this test started (the driver and anything it forked in the group)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def kill_session(ray_tmp: str) -> None:
    """Last resort in a test's finally: SIGKILL every process of that Ray session (only those: the marker is the
    session's own temp dir)."""
    for pid in processes_of(ray_tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
