"""Builds and loads the C kernels under kernels/csrc with the system C compiler (ctypes).

The kernels are plain C (no torch headers). Every .c file there is compiled (one
compiler per core) and linked into one shared library (the fused decode step calls the
others' kernels), at first use, in a few seconds, into a cache folder keyed by the
sources and headers, the compiler, the flags and the CPU, and reused after. Where no
compiler works the loader returns None and callers keep the torch path; nothing is built
at import time.

Build cache: $SARAZMQ_CACHE/native (default ~/.cache/sarazmq/native). Set
SARAZMQ_NATIVE=0 to never build or load them.

SARAZMQ_CPU_ISA caps the instruction set the kernels are built for and the engine's CPU
feature checks see: "native" (default, everything this CPU has), "avx512" (no AMX) or
"avx2" (x86-64-v3: AVX2 + FMA, no AVX-512, no VNNI). A capped build runs the AVX2 (or
AVX-512 without AMX) kernels on a bigger CPU, so they are tested and measured on any
machine; scripts/cpu_isa.sh also caps torch's own kernels to match.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

_SRC_DIR = Path(__file__).parent / "csrc"
_FLAGS = (
    "-O3",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",  # round a*b+c twice where torch does (intrinsics still fuse)
    "-shared",
    "-fPIC",
)
CPU_ISA_ENV = "SARAZMQ_CPU_ISA"
#: The instruction-set caps: the -march flags each builds with.
CPU_ISA_MARCH: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    "avx512": ("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"),
    "avx2": ("-march=x86-64-v3",),
}
# /proc/cpuinfo flags a cap hides (by prefix), and the ones it needs the CPU to have
_HIDDEN_FLAG_PREFIXES: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx512": ("amx",),
    "avx2": ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert"),
}
_REQUIRED_FLAGS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx512": ("avx512f",),
    "avx2": ("avx2", "fma", "bmi2", "f16c", "movbe"),
}
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


@functools.cache
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


class CpuIsaError(ValueError):
    """SARAZMQ_CPU_ISA names no cap, or one this CPU cannot run."""


def check_cpu_isa_cap(cap: str, cpu_flags: Iterable[str]) -> str:
    """`cap` normalized ("" is "native"); CpuIsaError for an unknown cap or one above what
    a CPU with `cpu_flags` has (code built for it would fault there)."""
    cap = cap.strip().lower() or "native"
    if cap not in CPU_ISA_MARCH:
        raise CpuIsaError(
            f"{CPU_ISA_ENV}={cap!r} is not an instruction-set cap; expected one of "
            + ", ".join(CPU_ISA_MARCH)
        )
    have = set(cpu_flags)
    missing = [f for f in _REQUIRED_FLAGS[cap] if f not in have]
    if missing:
        raise CpuIsaError(
            f"{CPU_ISA_ENV}={cap} needs a CPU with {', '.join(missing)}, which this one lacks"
        )
    return cap


def visible_cpu_flags(cpu_flags: Iterable[str], cap: str) -> frozenset[str]:
    """The flags among `cpu_flags` that code built under `cap` may use."""
    hidden = _HIDDEN_FLAG_PREFIXES[cap]
    return frozenset(f for f in cpu_flags if not f.startswith(hidden))


def cpu_isa_cap() -> str:
    """The instruction-set cap SARAZMQ_CPU_ISA asks for ("native" when unset); CpuIsaError
    for an unknown value or a cap above what this CPU has."""
    return check_cpu_isa_cap(os.environ.get(CPU_ISA_ENV, ""), _cpu_signature().split())


def cpu_has_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (e.g. "amx_bf16") for this CPU and the
    SARAZMQ_CPU_ISA cap leaves it visible; False elsewhere."""
    return flag in visible_cpu_flags(_cpu_signature().split(), cpu_isa_cap())


def compile_flags(cap: str) -> tuple[str, ...]:
    """The compiler flags the library is built with under instruction-set cap `cap` (a key
    of `CPU_ISA_MARCH`), for tools that compile the sources the same way (the tests that
    read the generated code). KeyError for an unknown cap."""
    return (*CPU_ISA_MARCH[cap], *_FLAGS)


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
    flags = compile_flags(cpu_isa_cap())
    key.update(" ".join((cc, *flags)).encode())
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
            _compile(cc, flags, sources, Path(tmp))
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def _compile(cc: str, flags: tuple[str, ...], sources: list[Path], target: Path) -> None:
    """Compiles each source to an object file, as many at once as this process may use
    cores (one compiler run over all of them used one core for the whole build), then
    links them into `target`. OSError naming the source (or the link) that failed."""
    object_flags = [f for f in flags if f != "-shared"]
    jobs = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    with tempfile.TemporaryDirectory(dir=target.parent) as objdir:
        objects = [Path(objdir) / f"{src.stem}.o" for src in sources]

        def run(src: Path, obj: Path) -> subprocess.CompletedProcess[bytes]:
            cmd = [cc, *object_flags, "-c", "-o", str(obj), str(src)]
            return subprocess.run(cmd, capture_output=True, timeout=300)

        # the biggest sources first, so that no long compile starts last
        pairs = sorted(zip(sources, objects), key=lambda p: -p[0].stat().st_size)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            done = list(pool.map(run, *zip(*pairs)))
        for (src, _), proc in zip(pairs, done):
            if proc.returncode != 0:
                err = proc.stderr.decode(errors="replace")[-2000:]
                raise OSError(f"{cc} failed on {src.name}: {err}")
        link = [cc, *flags, "-o", str(target), *map(str, objects), "-lm"]
        proc = subprocess.run(link, capture_output=True, timeout=300)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed to link: {proc.stderr.decode(errors='replace')[-2000:]}")
