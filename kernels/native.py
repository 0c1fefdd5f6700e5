"""Builds and loads the C kernels under kernels/csrc with the system C compiler (ctypes).

The kernels are plain C (no torch headers). Every .c file there is compiled into one
shared library (the fused decode step calls the others' kernels), at first use, in a few
seconds, into a cache folder keyed by the sources and headers, the compiler, the flags
and the CPU, and reused after. Where no compiler works the loader returns None and
callers keep the torch path; nothing is built at import time.

Build cache: $SARAZMQ_CACHE/native (default ~/.cache/sarazmq/native). Set
SARAZMQ_NATIVE=0 to never build or load them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SRC_DIR = Path(__file__).parent / "csrc"
_FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",  # round a*b+c twice where torch does (intrinsics still fuse)
    "-shared",
    "-fPIC",
)
LIBRARY_NAME = "cpu_kernels"
_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # [the library or None] once load_library ran


def _cache_dir() -> Path:
    root = os.environ.get("SARAZMQ_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "sarazmq"
    )
    return Path(root) / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    # -march=native code must not be reused on a different CPU (shared home folders)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def cpu_has_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (e.g. "amx_bf16") for this CPU; False elsewhere."""
    return flag in _cpu_signature().split()


def load_library() -> ctypes.CDLL | None:
    """Builds (once, cached on disk) and loads the kernel library; None when unavailable."""
    with _lock:
        if _loaded:
            return _loaded[0]
        lib = None
        if os.environ.get("SARAZMQ_NATIVE", "1") != "0":
            try:
                lib = _build_and_load()
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("native CPU kernels unavailable, using the torch path: %s", e)
        _loaded.append(lib)
        return lib


def _build_and_load() -> ctypes.CDLL | None:
    sources = sorted(_SRC_DIR.glob("*.c"))
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found; native CPU kernels not built")
        return None
    key = hashlib.sha256()
    for path in sorted(_SRC_DIR.iterdir()):
        if path.suffix in (".c", ".h"):
            key.update(path.name.encode())
            key.update(path.read_bytes())
    key.update(" ".join((cc, *_FLAGS)).encode())
    key.update(_cpu_signature().encode())
    out_dir = _cache_dir()
    target = out_dir / f"{LIBRARY_NAME}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        # build to a temporary name, then rename: concurrent processes never load a
        # half-written library
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            subprocess.run(
                [cc, *_FLAGS, "-o", tmp, *map(str, sources), "-lm"],
                check=True,
                capture_output=True,
                timeout=300,
            )
            os.replace(tmp, target)
        except subprocess.CalledProcessError as e:
            raise OSError(f"{cc} failed: {e.stderr.decode(errors='replace')[-2000:]}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))
