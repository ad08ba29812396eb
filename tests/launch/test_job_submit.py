"""`ray job submit --working-dir . -- python jobs/serve_bench.py ...` against a local `ray start --head`, after
`serve deploy` of tokenflow_ray/serve/serve.yaml (its ports and sizes adjusted to this box): the job finds the
app, runs the burst and prints the demo's JSON. The head runs in its own process group and is stopped in
`finally` (never `ray stop`, which would stop every Ray on the machine)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.launch.ray_head import HEAD_ENV
from tokenflow_ray.serve.local import free_ports

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _serve_config(path: Path, port: int) -> None:
    doc = yaml.safe_load((ROOT / "tokenflow_ray/serve/serve.yaml").read_text())
    doc["http_options"]["port"] = port
    args = doc["applications"][0]["args"]
    args.update(images=False, num_cpus=1)
    args["engine"].update(num_device_blocks=256, num_host_blocks=256, max_num_seqs=16)
    args["autoscaling"]["max_replicas"] = 1  # the head has 2 CPUs
    path.write_text(yaml.safe_dump(doc))


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_ray_job_submit_runs_the_burst_bench_against_the_deployed_app():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **HEAD_ENV}  # the job's `python` is this one
    env.pop("RAY_ADDRESS", None)
    gcs, dash, serve_port, client, agent, agent_grpc, metrics, env_agent, nm, om = free_ports(10)
    temp = tempfile.mkdtemp(prefix="tfjob", dir="/tmp")  # short: Ray's socket paths are length-limited
    log = open(Path(temp) / "head.log", "w")
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=2", f"--temp-dir={temp}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={env_agent}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
         "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        _wait_http(f"{address}/api/version", timeout_s=90)
        cfg = Path(temp) / "serve.yaml"
        _serve_config(cfg, serve_port)
        subprocess.run([str(BIN / "serve"), "deploy", str(cfg), "-a", address], env=env, check=True,
                       capture_output=True, text=True, timeout=60)
        job = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".", "--",
             "python", "jobs/serve_bench.py", "--streams", "8", "--max-tokens", "24", "--rate", "16",
             "--burst-s", "0.3"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in job.stdout.splitlines() if ln.startswith("{")]
        assert job.returncode == 0 and lines, (job.stdout[-3000:], job.stderr[-3000:])
        report = json.loads(lines[-1])
        print(json.dumps(report))
        assert report["app"] == "tokenflow" and report["deployed"] is False  # found what `serve deploy` put up
        assert report["url"] == f"http://127.0.0.1:{serve_port}" and report["autoscaling"] is True
        row = report["policies"]["tokenflow"]
        assert row["streams"] == row["complete"] == 8 and row["rejected"] == 0
        assert row["raw_tput"] > 0 and 0 < row["effective_tput"] <= row["raw_tput"] + 1e-9
        assert math.isfinite(row["ttft_p99_s"]) and row["ttft_p99_s"] >= row["ttft_p50_s"] > 0
    finally:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):  # the head and everything it started
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
