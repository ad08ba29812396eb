"""`tokenflow serve` as a person runs it, in its own process with its own Ray: what it says when it cannot start,
and how it stops on SIGTERM (the error event and [DONE] for a live stream, exit 0, no Ray process left)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serve.process_tools import (
    ROOT,
    Tokenflow,
    kill_session,
    processes_of,
    session_env,
    short_tmp,
    wait_gone,
)
from tokenflow_ray.serve.local import free_port

pytestmark = pytest.mark.timeout(420)

SMALL = {"num_device_blocks": 64, "num_host_blocks": 64, "max_num_seqs": 8, "num_cpus": 1, "images": False,
         "policy": "tokenflow"}


def _yaml(path: Path, **args) -> str:
    path.write_text(json.dumps(args))  # JSON is YAML
    return str(path)


def test_a_missing_model_dir_is_one_line_naming_it_before_ray_starts():
    ray_tmp = short_tmp()
    try:
        proc = subprocess.run([sys.executable, "-m", "tokenflow_ray.cli", "serve", "--model", "/no/such/dir"],
                              cwd=ROOT, env=session_env(ray_tmp), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "/no/such/dir" in lines[0] and "does not exist" in lines[0], proc.stderr
        assert proc.stdout == ""
        assert not (Path(ray_tmp) / "ray").exists()  # no Ray session was ever started
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_model_dir_without_a_config_and_a_bad_value_are_one_line_each(tmp_path):
    ray_tmp = short_tmp()
    try:
        for args, needle in ((["--model", str(tmp_path)], "config.json"),
                             (["--replicas", "0"], "replicas: must be >= 1")):
            proc = subprocess.run([sys.executable, "-m", "tokenflow_ray.cli", "serve", *args], cwd=ROOT,
                                  env=session_env(ray_tmp), capture_output=True, text=True, timeout=120)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
        assert not (Path(ray_tmp) / "ray").exists()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_replica_that_fails_in_its_constructor_is_one_line_with_its_reason(tmp_path):
    """A host spill store no machine has (10^8 blocks, 9.8 TB): the replica's allocation fails (out of memory),
    which only the replica can find (its node's memory); its own error line is what `tokenflow serve` prints, then
    it exits 1 and leaves no Ray process."""
    ray_tmp = short_tmp()
    config = _yaml(tmp_path / "serve.yaml", **{**SMALL, "num_host_blocks": 100_000_000})
    # Serve retries a failing constructor 3 times by default (Serve's own knob): once is enough to see the reason.
    server = Tokenflow(["serve", "--config", config, "--port", str(free_port())], ray_tmp,
                       RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT="1")
    try:
        rc = server.wait(timeout_s=360)
        errors = [ln for ln in server.lines if ln.startswith("tokenflow: error:")]
        assert rc == 1, server.output
        assert len(errors) == 1, server.output
        assert "a replica failed to start" in errors[0] and "can't allocate memory" in errors[0], errors[0]
        assert not any("Traceback" in ln for ln in server.lines), server.output
        assert wait_gone(ray_tmp, timeout_s=30) == []
    finally:
        server.kill()
        kill_session(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _sse_lines(response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_sigterm_mid_stream_ends_the_stream_with_an_error_event_and_exits_zero(tmp_path):
    ray_tmp = short_tmp()
    port = free_port()
    config = _yaml(tmp_path / "serve.yaml", **SMALL)
    server = Tokenflow(["serve", "--config", config, "--port", str(port)], ray_tmp)
    try:
        server.wait_for("serving 'embedded'", timeout_s=300)
        started = server.wait_for("replica ", timeout_s=60)
        assert "started: KV pool 64 device + 64 host blocks of 16 tokens, policy tokenflow" in started
        assert processes_of(ray_tmp)  # the marker finds the session's processes while it runs
        # A slow reader's long stream: live for minutes unless something ends it.
        body = {"model": "embedded", "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                "consumption_rate": 4.0}
        events: list[str] = []
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for payload in (line[6:] for line in resp.iter_lines() if line.startswith("data: ")):
                events.append(payload)
                if len(events) == 2:  # mid-stream: tokens came, more are due
                    server.proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]", events[-5:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable", error
        assert all("choices" in json.loads(e) for e in events[:-2])  # tokens before it, nothing after but [DONE]
        assert server.wait(timeout_s=180) == 0, server.output
        assert any(ln.startswith("SIGTERM: stopping") for ln in server.lines), server.output
        assert any(" stopped (server stopped)" in ln for ln in server.lines), server.output
        assert not any("Traceback" in ln or "clock_nanosleep" in ln for ln in server.lines), server.output
        assert wait_gone(ray_tmp, timeout_s=30) == []
    finally:
        server.kill()
        kill_session(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
