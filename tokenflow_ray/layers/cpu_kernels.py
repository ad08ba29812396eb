"""The CPU kernels (csrc/: paged decode attention, fused small ops, the packed GEMM), each built once per machine and
cached.

torch's C++ extension loader compiles it on first use (20-30 s each here; the engine builds them two at a time)
into its extensions folder ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), and later processes (Serve
replicas, tests) load the cached build. Without a C++ compiler the engine falls back to gather + SDPA, the reference
small ops and oneDNN's linear, and says so once in the log.

$TOKENFLOW_KERNEL_MARCH sets the compiler's target (default `native`): `x86-64-v3`, say, builds an AVX2 kernel that
runs on every node of a cluster mixing AVX2 and AVX-512 CPUs, or measures the AVX2 path on an AVX-512 box.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "paged_decode_attention.cpp"
FUSED_SOURCE = CSRC / "fused_ops.cpp"
GEMM_SOURCE = CSRC / "packed_gemm.cpp"
# A build takes 20-30 s here. torch's loader waits with no time limit on the lock file a build holds, and a
# process killed by a signal (SIGTERM from `timeout`, SIGKILL) leaves that file behind: every later process, the
# Serve replicas included, then hangs at its first engine. A lock this old has no live build behind it.
STALE_BUILD_LOCK_S = 600.0
MARCH_ENV = "TOKENFLOW_KERNEL_MARCH"


def kernel_march() -> str:
    """The builds' -march target: $TOKENFLOW_KERNEL_MARCH, default `native`."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", march):
        raise ValueError(f"{MARCH_ENV}: a compiler -march name such as native or x86-64-v3, got {march!r}")
    return march


def _cpu_tag() -> str:
    """Short hash of the CPU's feature flags: a -march=native build in a cache folder shared between different
    machines must not be handed from one CPU to another. A named target's build runs wherever that target does."""
    march = kernel_march()
    if march != "native":
        return march.replace(".", "_").replace("+", "_").replace("-", "_")
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _source_tag() -> str:
    """Hash of every file in csrc/: the loader rebuilds when a source changes, but not when a header it includes
    does, so the sources are part of the name."""
    h = hashlib.sha1()
    for f in sorted(CSRC.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:8]


def compiler_available() -> bool:
    return shutil.which("c++") is not None or shutil.which("g++") is not None


def _build(name: str, source: Path, what: str, extra_cflags: tuple[str, ...] = ()) -> ModuleType | None:
    if not compiler_available():
        log.warning("no C++ compiler: %s falls back to torch ops (slower)", what)
        return None
    from torch.utils.cpp_extension import _get_build_directory, load

    full_name = f"{name}_{_cpu_tag()}_{_source_tag()}"
    try:
        drop_stale_build_lock(Path(_get_build_directory(full_name, verbose=False)))
        return load(name=full_name, sources=[str(source)],
                    extra_cflags=["-O3", f"-march={kernel_march()}", "-fopenmp", *extra_cflags], extra_ldflags=["-fopenmp"],
                    verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # a failed build must not take the engine down
        log.warning("building the CPU kernel for %s failed (%s); falling back to torch ops", what, exc)
        return None


def drop_stale_build_lock(build_dir: Path, max_age_s: float = STALE_BUILD_LOCK_S) -> bool:
    """Remove `build_dir`'s lock file if it is older than `max_age_s` (left by a killed build); True if removed."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False  # a build may be running in another process: wait for it, as the loader does
    log.warning("removing a build lock %.0f s old with no build behind it (a killed build left it): %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


@functools.cache  # one build per process; the extension loader itself caches across processes
def load_paged_decode_attention(lanes: int | None = None) -> ModuleType | None:
    """`lanes`: None builds for this CPU's vector width (16 floats with AVX-512, 8 otherwise); 8 or 16 forces one,
    so the tests run both kernels on any x86 CPU (a 16-lane build runs on AVX2 too, as pairs of halves)."""
    return _build_for_lanes("tokenflow_paged_decode_attention", SOURCE, "decode attention (gather + SDPA)", lanes)


def _build_for_lanes(name: str, source: Path, what: str, lanes: int | None) -> ModuleType | None:
    if lanes is None:
        return _build(name, source, what)
    if lanes not in (8, 16):
        raise ValueError(f"lanes: 8 or 16, got {lanes!r}")
    return _build(f"{name}_l{lanes}", source, what, (f"-DTOKENFLOW_LANES={lanes}",))


@functools.cache
def load_fused_ops() -> ModuleType | None:
    """RMSNorm + residual, SiLU·mul, RoPE + KV write (csrc/fused_ops.cpp). -ffp-contract=off: products and sums
    round as the reference's separate kernels do."""
    return _build("tokenflow_fused_ops", FUSED_SOURCE, "the fused small ops", ("-ffp-contract=off",))


@functools.cache
def load_packed_gemm(lanes: int | None = None) -> ModuleType | None:
    """The linear layers' GEMM over packed column panels (csrc/packed_gemm.cpp). `lanes` as for the attention kernel:
    None builds for this CPU's vector width, 8 or 16 forces one (the tests run both)."""
    return _build_for_lanes("tokenflow_packed_gemm", GEMM_SOURCE, "the packed GEMM (oneDNN's linear)", lanes)


def build_cpu_kernels() -> None:
    """Build (or load) the kernels two at a time: each build is one compiler process, so on two cores a pair takes
    about as long as one. Each loader caches its module, so the later calls that use them find it built."""
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenflow-kernel-build") as pool:
        for future in [pool.submit(load_paged_decode_attention), pool.submit(load_fused_ops),
                       pool.submit(load_packed_gemm)]:
            future.result()
