"""vLLM's OpenAI server as a context manager that leaves no process behind.

The server runs in its own session (so its own process group: API server, engine core, worker, resource tracker).
Leaving the context, normally, on an exception or on Ctrl-C, sends SIGTERM to the whole group, waits, then SIGKILLs
what is left; an atexit hook and a SIGTERM handler cover the driver exiting or being terminated mid-run, and the
server gets SIGTERM from the kernel if the driver dies outright (PR_SET_PDEATHSIG). The generic part (ProcessGroup,
ManagedServer) is what the unit test drives with a fake server; vllm_server() adds vLLM's command line and env.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenflow_ray.lab.peer.vllm_env import PeerError

_LIVE: set[ProcessGroup] = set()  # what the atexit hook stops
_HOOKS_INSTALLED = False


def _stop_all() -> None:
    for group in list(_LIVE):
        group.stop()


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds the `with` blocks, so each group is stopped by its own __exit__


def _install_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    atexit.register(_stop_all)
    # Only from the main thread and only over the default action: never replace a handler someone else set. An
    # inherited SIG_IGN (a nohup-style parent) is kept too: SIGTERM then does not end this process, so there is
    # nothing to clean up on it; the server itself always starts with SIGTERM at its default (_child_setup).
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    _HOOKS_INSTALLED = True


def _load_prctl():
    with contextlib.suppress(Exception):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


_PRCTL = _load_prctl() if sys.platform == "linux" else None  # looked up here: the child only makes the call


def _child_setup() -> None:  # runs in the child between fork and exec: keep it to a few plain calls
    # An ignored or blocked SIGTERM survives exec, so a driver started that way (some runners start commands so)
    # would pass it on, and both our stop() and the kernel's parent-death signal would be no-ops: the server would
    # outlive a killed driver. Restore the default before the server runs.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM,))
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group pgid."""
    if not os.path.isdir("/proc"):  # not Linux: ask the kernel whether anyone is left
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


class ProcessGroup:
    """A child process in a new session, its output in log_path; stop() ends the whole group. Idempotent."""

    def __init__(self, argv: Sequence[str], *, log_path: str | Path, env: Mapping[str, str] | None = None,
                 term_timeout_s: float = 20.0) -> None:
        if not argv:
            raise ValueError("argv: must not be empty")
        if term_timeout_s <= 0:
            raise ValueError("term_timeout_s: must be positive")
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.term_timeout_s = term_timeout_s
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError("already started")
        _install_hooks()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:  # one run per log file
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True, preexec_fn=_child_setup)
        self.pgid = self.proc.pid  # a new session's leader leads its own process group
        _LIVE.add(self)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(ln.strip() for ln in text[-lines:] if ln.strip())

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def _wait_empty(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.05)  # reap the leader so it does not linger as a zombie
            if not group_members(self.pgid):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None or self not in _LIVE:
            return
        try:
            self._signal(signal.SIGTERM)
            if not self._wait_empty(self.term_timeout_s):
                self._signal(signal.SIGKILL)
                self._wait_empty(10.0)
        except BaseException:  # a second Ctrl-C while stopping: no more patience, but still no orphans
            self._signal(signal.SIGKILL)
            raise
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            _LIVE.discard(self)

    def __enter__(self) -> ProcessGroup:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ManagedServer(ProcessGroup):
    """A ProcessGroup that serves HTTP: entering waits until GET ready_path answers 200 and yields the base URL."""

    def __init__(self, argv: Sequence[str], *, base_url: str, log_path: str | Path,
                 env: Mapping[str, str] | None = None, ready_path: str = "/v1/models", ready_timeout_s: float = 180.0,
                 term_timeout_s: float = 20.0, name: str = "server") -> None:
        super().__init__(argv, log_path=log_path, env=env, term_timeout_s=term_timeout_s)
        if ready_timeout_s <= 0:
            raise ValueError("ready_timeout_s: must be positive")
        self.base_url = base_url.rstrip("/")
        self.ready_path = ready_path
        self.ready_timeout_s = ready_timeout_s
        self.name = name

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + self.ready_path, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> float:
        start = time.monotonic()
        while not self._ready():
            rc = self.poll()
            if rc is not None:
                raise PeerError(f"{self.name} exited with code {rc} before it was ready (log: {self.log_path}): "
                                f"{self.log_tail()}")
            if time.monotonic() - start > self.ready_timeout_s:
                raise PeerError(f"{self.name} not ready after {self.ready_timeout_s:.0f} s (log: {self.log_path})")
            time.sleep(0.5)
        return time.monotonic() - start

    def __enter__(self) -> str:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.base_url


# ---- vLLM -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmServerSettings:
    python: Path  # the vLLM venv's python
    model_dir: Path
    served_model_name: str
    num_blocks: int  # vLLM KV blocks (--num-gpu-blocks-override)
    block_size: int = 128  # vLLM's CPU default, passed explicitly so the byte arithmetic cannot drift
    max_model_len: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    threads: int = 2
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    prefix_caching: bool | None = None  # None: vLLM's default (on in V1); True/False: said explicitly

    def __post_init__(self) -> None:
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"host: loopback only, got {self.host!r}")
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"num_blocks: vLLM needs room for one max_model_len={self.max_model_len} request, "
                             f"got {self.num_blocks} x {self.block_size} tokens")


def vllm_server_argv(s: VllmServerSettings, port: int) -> list[str]:
    # `python -m ...api_server`, not the `vllm` console script (which fails to start in this venv).
    return [str(s.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model_dir),
            "--served-model-name", s.served_model_name, "--dtype", s.dtype, "--max-model-len", str(s.max_model_len),
            "--host", s.host, "--port", str(port), "--block-size", str(s.block_size),
            "--num-gpu-blocks-override", str(s.num_blocks), "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--disable-uvicorn-access-log",
            # usage.prompt_tokens_details.cached_tokens, as ours reports it
            "--enable-prompt-tokens-details"] + (
        [] if s.prefix_caching is None else ["--enable-prefix-caching" if s.prefix_caching else "--no-enable-prefix-caching"])


def vllm_cpu_env(threads: int) -> dict[str, str]:
    """vLLM CPU settings for `threads` OpenMP threads, as env additions (also used by the offline script's run).

    VLLM_CPU_OMP_THREADS_BIND: an explicit core list; the default "auto" reserves a core for the engine-core process,
    which on a 2-core box would leave the model one thread where our replica gets two. VLLM_CPU_KVCACHE_SPACE (GiB):
    the default 4 GiB is only profiled, since --num-gpu-blocks-override sets the pool; 1 GiB keeps RSS modest.
    OMP_NUM_THREADS is deliberately not set: vLLM sets it for the worker from the core list, and set globally it
    would also give the engine-core (scheduler) process two spinning torch threads competing with the worker.
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads > len(cores):
        raise ValueError(f"threads: {threads} > the {len(cores)} cores this process may use")
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores[:threads]), "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def clean_env(threads: int) -> dict[str, str]:
    """Our environment minus what belongs to our side (Ray, our venv/paths, thread caps), plus vllm_cpu_env()."""
    drop = ("RAY_", "VIRTUAL_ENV", "PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(vllm_cpu_env(threads))
    return env


@contextlib.contextmanager
def vllm_server(s: VllmServerSettings, log_path: str | Path, ready_timeout_s: float = 300.0) -> Iterator[str]:
    """Start vLLM on loopback, yield its base URL once /v1/models answers; the whole group is gone afterwards."""
    from tokenflow_ray.serve.local import free_port

    port = s.port or free_port(s.host)
    env = clean_env(s.threads)
    server = ManagedServer(vllm_server_argv(s, port), base_url=f"http://{s.host}:{port}", log_path=log_path, env=env,
                           ready_timeout_s=ready_timeout_s, name="vLLM server")
    with server as url:
        yield url
