"""The CPU decode-attention kernel (csrc/paged_decode_attention.cpp), built once per machine and cached.

torch's C++ extension loader compiles it on first use (about a minute on 2 cores) into its extensions folder
($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), and later processes (Serve replicas, tests) load the
cached build. Without a C++ compiler the engine falls back to gather + SDPA and says so once in the log.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import shutil
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


def _cpu_tag() -> str:
    """Short hash of the CPU's feature flags: the build uses -march=native, so a cache folder shared between
    different machines must not hand one CPU's build to another."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def compiler_available() -> bool:
    return shutil.which("c++") is not None or shutil.which("g++") is not None


@functools.cache  # one build per process; the extension loader itself caches across processes
def load_paged_decode_attention() -> ModuleType | None:
    if not compiler_available():
        log.warning("no C++ compiler: CPU decode attention uses gather + SDPA (slower)")
        return None
    from torch.utils.cpp_extension import load

    try:
        return load(name=f"tokenflow_paged_decode_attention_{_cpu_tag()}", sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # a failed build must not take the engine down
        log.warning("building the CPU decode-attention kernel failed (%s); using gather + SDPA", exc)
        return None
