"""Compile the C++ extension once per torch version and source, into a per-user cache.

The cache folder is ``$XDG_CACHE_HOME/distrun/shm/torch-<version>-<key>`` (else under
``~/.cache``), the key a hash of the sources, the flags, torch's and Python's versions. Ranks
that start together take a file lock: one compiles (and says so on stderr, once), the others
wait and load its result. Importing this module imports no torch (``unavailable`` is the
backend's check, run by ``distrun env``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from types import ModuleType

__all__ = ["BuildError", "build_dir", "built_library", "load_extension", "unavailable"]

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("shm_group.cpp", "reduce.cpp", "shm_backend.cpp")
HEADERS = ("shm_group.hpp",)
# -O3 vectorises the reduction loops; no -march: reduce.cpp picks AVX2 at run time itself.
# No FP contraction, so a sum is computed term by term as a reference would.
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno")
ABOUT_SECONDS = 60

_ext: ModuleType | None = None


class BuildError(RuntimeError):
    """The extension did not compile (the message is one line and names the log)."""


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def _key() -> str:
    digest = hashlib.sha256()
    for part in (_torch_version(), sys.version, " ".join(CFLAGS)):
        digest.update(part.encode())
    for name in (*SOURCES, *HEADERS):
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "distrun" / "shm"


def build_dir() -> Path:
    version = _torch_version().replace("+", "_")
    return cache_root() / f"torch-{version}-{_key()}"


def _module_name() -> str:
    return f"distrun_shm_ext_{_key()}"


def built_library() -> Path | None:
    """The compiled extension of this source and torch, when it is in the cache."""
    path = build_dir() / f"{_module_name()}.so"
    return path if path.exists() else None


def _failure_file() -> Path:
    return build_dir() / "failed.txt"


def unavailable() -> str | None:
    """Why the shm backend cannot run here, or None; never compiles (``distrun env`` calls it)."""
    if not sys.platform.startswith("linux"):
        return f"the shm backend needs Linux (POSIX shared memory and futexes), not {sys.platform}"
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)):
        return "/dev/shm is missing or not writable (mount a tmpfs there, or use gloo)"
    if built_library() is not None:
        return None
    failure = _failure_file()
    if failure.exists():
        return failure.read_text().strip().splitlines()[0]
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return f"no C++ compiler found to build it ({cxx}; install g++ or set CXX)"
    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
        return "ninja is not installed, needed to build it (pip install ninja)"
    return None


def _import(path: Path, name: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise BuildError(f"cannot import the built extension {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _compile(folder: Path, name: str) -> None:
    import torch
    from torch.utils import cpp_extension

    print(f"distrun-shm: compiling the shared-memory backend for torch {torch.__version__} "
          f"(once, about {ABOUT_SECONDS} s) into {folder} ...", file=sys.stderr, flush=True)
    log = folder / "build.log"
    start = time.monotonic()
    try:
        cpp_extension.load(name=name, sources=[str(CSRC / s) for s in SOURCES],
                           extra_cflags=list(CFLAGS), build_directory=str(folder),
                           verbose=False)
    except Exception as exc:  # the compiler's output is in the message: keep it in the log
        text = str(exc)
        log.write_text(text)
        first = next((ln.strip() for ln in text.splitlines() if "error" in ln.lower()),
                     text.strip().splitlines()[0] if text.strip() else type(exc).__name__)
        reason = f"its build failed: {first[:200]} (log: {log})"
        _failure_file().write_text(reason + "\n")
        raise BuildError(reason) from None
    log.write_text(f"built in {time.monotonic() - start:.1f} s\n")


def load_extension() -> ModuleType:
    """The extension module: from the cache, else compiled now (once across ranks)."""
    global _ext
    if _ext is not None:
        return _ext
    import torch  # noqa: F401  (the extension links against the loaded libtorch)

    folder = build_dir()
    name = _module_name()
    path = folder / f"{name}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "distrun.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not path.exists():
                    _failure_file().unlink(missing_ok=True)
                    _compile(folder, name)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    _ext = sys.modules.get(name) or _import(path, name)
    return _ext
