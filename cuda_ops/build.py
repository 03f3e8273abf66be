"""Build, cache and load dmfx's kernel extensions.

All CPU kernels live in one extension module and all CUDA kernels in another. Each is compiled once
with ``torch.utils.cpp_extension.load_inline`` and named by a hash of its sources, flags, the torch
build and the machine, so a change to any of them builds a new module and an old one is never loaded
by mistake. Builds land in the torch extensions directory (``TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``; ``DMFX_CACHE_DIR`` overrides it) and are shared across processes:

* a file lock serialises concurrent builds of the same module (the second process waits, then loads);
* a build is only trusted once ``dmfx_ok.json`` records the SHA-256 of the finished library, so a
  build that was killed half-way, or a library that was corrupted later, is detected and rebuilt;
* a warm load imports the finished library directly (no compiler, no ninja), well under a second;
* a cache directory that cannot be written falls back to a temporary one, with a warning.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock

log = logging.getLogger("dmfx")

CSRC = Path(__file__).resolve().parent / "csrc"
# One group of kernels per file (csrc/<family>_cpu.cpp, <family>_cuda.cu + <family>_cuda_bind.cpp); see
# csrc/cpu_bindings.cpp. Order matters: each file may use the helpers of the files before it
# (attention_cpu.cpp / attention_cuda.cu use the softmax family's).
FAMILIES = ("norm", "softmax", "pointwise", "attention")
# Functions of the CPU module without a CUDA twin: flash_use_blas switches the CPU flash kernels' GEMMs.
CPU_ONLY_FUNCTIONS = ("flash_use_blas",)
MARKER = "dmfx_ok.json"


class KernelBuildError(RuntimeError):
    """A kernel extension could not be built or loaded (no compiler, compile error, bad cache)."""


@dataclass(frozen=True)
class Flavor:
    kind: str  # "cpu" | "cuda"
    cpp_sources: tuple[str, ...]  # concatenated, in order, into one C++ translation unit
    cuda_sources: tuple[str, ...]  # concatenated into one CUDA translation unit
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()


def _cpu_capability_flags() -> tuple[str, ...]:
    """ATen's Vectorized<T> only uses AVX2/AVX-512 when CPU_CAPABILITY_* is defined (as in ATen's own
    kernel builds). Define it for the whole translation unit, matching what -march=native targets, so
    no family file depends on the order of the concatenated sources."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:
        return ()
    cap = {"AVX512": "AVX512", "AVX2": "AVX2"}.get(cap)
    return (f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}") if cap else ()


FLAVORS = {
    "cpu": Flavor(
        kind="cpu",
        cpp_sources=(*(f"{f}_cpu.cpp" for f in FAMILIES), "cpu_bindings.cpp"),
        cuda_sources=(),
        cflags=("-O3", "-march=native", "-fopenmp", *_cpu_capability_flags()),
        ldflags=("-fopenmp",),
    ),
    "cuda": Flavor(
        kind="cuda",
        cpp_sources=(*(f"{f}_cuda_bind.cpp" for f in FAMILIES), "cuda_bindings.cpp"),
        cuda_sources=tuple(f"{f}_cuda.cu" for f in FAMILIES),
        cflags=("-O3",),
        cuda_cflags=("-O3", "-lineinfo"),
    ),
}

_loaded: dict[str, ModuleType] = {}
_failed: dict[str, KernelBuildError] = {}


def warn(msg: str, *args: object) -> None:
    """A warning on the dmfx logger that the user sees even without configuring logging: dmfx/__init__
    gives the logger a NullHandler (library convention), which would swallow it, so when no real
    handler is reachable the same text goes through ``warnings.warn`` too."""
    log.warning(msg, *args)
    logger: logging.Logger | None = log
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return
        logger = logger.parent if logger.propagate else None
    warnings.warn(msg % args if args else msg, RuntimeWarning, stacklevel=3)


def _check_compiler(kind: str) -> None:
    """Fail fast, with a message that says what is missing, when there is no C++ compiler (torch would
    otherwise start ninja and fail with a long build log)."""
    cxx = os.environ.get("CXX") or "c++"
    exe = shlex.split(cxx)[0] if cxx.strip() else "c++"
    if shutil.which(exe) is None:
        raise KernelBuildError(
            f"dmfx could not build its {kind.upper()} kernels: no C++ compiler ({exe!r} is not on PATH; "
            "install g++ or set CXX)"
        )


def _read(name: str) -> str:
    return (CSRC / name).read_text()


def _machine_tag() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return os.uname().machine + "|" + "|".join(keep)


def source_hash(flavor: Flavor) -> str:
    h = hashlib.sha256()
    headers = sorted(p.name for p in CSRC.glob("*.h"))
    for name in (*flavor.cpp_sources, *flavor.cuda_sources, *headers):
        h.update(name.encode())
        h.update(_read(name).encode())
    for part in (flavor.cflags, flavor.cuda_cflags, flavor.ldflags):
        h.update(repr(part).encode())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.cuda).encode())
    h.update(sys.version.encode())
    if flavor.kind == "cpu":
        h.update(_machine_tag().encode())
    else:
        h.update(os.environ.get("TORCH_CUDA_ARCH_LIST", "").encode())
    return h.hexdigest()[:16]


def module_name(kind: str) -> str:
    return f"dmfx_{kind}_{source_hash(FLAVORS[kind])}"


def cache_root() -> Path:
    """The directory that holds one sub-directory per built module; writable, or a temp fallback."""
    env = os.environ.get("DMFX_CACHE_DIR")
    if env:
        root = Path(env)
    else:
        # what torch.utils.cpp_extension.get_default_build_root() returns, without importing that
        # module on the warm path (its import guesses CUDA_HOME and logs a warning without a GPU)
        from torch._appdirs import user_cache_dir

        default = os.path.realpath(user_cache_dir(appname="torch_extensions"))
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or default)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".dmfx_write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return root
    except OSError as e:
        fallback = Path(tempfile.gettempdir()) / f"dmfx_extensions_{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        warn("dmfx: kernel cache %s is not writable (%s); using %s instead", root, e, fallback)
        return fallback


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _library_path(build_dir: Path, name: str) -> Path:
    return build_dir / f"{name}.so"


def _is_valid(build_dir: Path, name: str) -> bool:
    lib, marker = _library_path(build_dir, name), build_dir / MARKER
    if not (lib.is_file() and marker.is_file()):
        return False
    try:
        return json.loads(marker.read_text()).get("sha256") == _sha256(lib)
    except (OSError, ValueError):
        return False


def _import(name: str, lib: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, lib)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"cannot import {lib}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(flavor: Flavor, name: str, build_dir: Path) -> None:
    from torch.utils.cpp_extension import load_inline

    if flavor.kind == "cuda" and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # No GPU to detect the architecture from (e.g. a compile-only check): build for Hopper.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    if flavor.kind == "cuda":
        _ensure_cuda_home()
    load_inline(
        name=name,
        cpp_sources=[_read(n) for n in flavor.cpp_sources],
        cuda_sources=[_read(n) for n in flavor.cuda_sources] or None,
        extra_cflags=list(flavor.cflags),
        extra_cuda_cflags=list(flavor.cuda_cflags) or None,
        extra_ldflags=list(flavor.ldflags),
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        with_cuda=bool(flavor.cuda_sources),
        is_python_module=True,
        verbose=False,
    )


def _ensure_cuda_home() -> None:
    """Point torch at a CUDA toolkit that has libcudart when it would guess wrong.

    torch derives CUDA_HOME from the `nvcc` on PATH; where that is a wrapper script (e.g. in
    /usr/local/bin) the guess has no lib64/ and linking fails with "cannot find -lcudart". Prefer the
    toolkit `nvcc` really lives in, then the usual install locations.
    """
    import torch.utils.cpp_extension as ext

    def has_cudart(root: Path) -> bool:
        return any((root / d / "libcudart.so").exists() for d in ("lib64", "lib", "targets/x86_64-linux/lib"))

    current = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ext.CUDA_HOME
    if current and has_cudart(Path(current)):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates += sorted(Path("/usr/local").glob("cuda*"), reverse=True)
    for root in candidates:
        if (root / "bin" / "nvcc").exists() and has_cudart(root):
            os.environ["CUDA_HOME"] = str(root)
            ext.CUDA_HOME = str(root)
            log.info("dmfx: using CUDA toolkit %s (CUDA_HOME was %r)", root, current)
            return


def load(kind: str) -> ModuleType:
    """The extension module of `kind` ("cpu" or "cuda"), built on first use and cached on disk.

    Raises KernelBuildError (once per process and kind; later calls re-raise it quickly).
    """
    if kind in _loaded:
        return _loaded[kind]
    if kind in _failed:
        raise _failed[kind]
    try:
        module = _build_or_load(kind)
    except KernelBuildError as e:
        _failed[kind] = e
        raise
    except Exception as e:  # compiler missing, compile error, import error, ...
        err = KernelBuildError(f"dmfx could not build its {kind.upper()} kernels: {_summarize(e)}")
        _failed[kind] = err
        raise err from e
    _loaded[kind] = module
    return module


def _summarize(e: BaseException, limit: int = 1500) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:300] + " ... " + text[-(limit - 300):]


def _build_or_load(kind: str) -> ModuleType:
    flavor = FLAVORS[kind]
    name = module_name(kind)
    root = cache_root()
    build_dir = root / name
    start = time.perf_counter()
    if _is_valid(build_dir, name):
        module = _import(name, _library_path(build_dir, name))
        log.info("dmfx: loaded %s kernels %s from cache in %.2fs", kind.upper(), name, time.perf_counter() - start)
        return module
    _check_compiler(kind)
    with FileLock(str(root / f"{name}.lock")):
        if not _is_valid(build_dir, name):  # nobody built it while we waited
            if build_dir.exists():
                warn("dmfx: discarding incomplete or corrupted kernel build in %s", build_dir)
                shutil.rmtree(build_dir, ignore_errors=True)
            build_dir.mkdir(parents=True)
            print(
                f"dmfx: building {kind.upper()} kernels {name} (happens once per machine and version; "
                f"cached in {build_dir})",
                file=sys.stderr,
                flush=True,
            )
            _compile(flavor, name, build_dir)
            lib = _library_path(build_dir, name)
            if not lib.is_file():
                raise KernelBuildError(f"the build of {name} produced no library at {lib}")
            (build_dir / MARKER).write_text(json.dumps({"sha256": _sha256(lib), "torch": torch.__version__}))
            module = sys.modules.get(name) or _import(name, lib)
            log.info("dmfx: built %s kernels %s in %.1fs", kind.upper(), name, time.perf_counter() - start)
            return module
    module = _import(name, _library_path(build_dir, name))
    log.info("dmfx: loaded %s kernels %s (built by another process) in %.2fs", kind.upper(), name, time.perf_counter() - start)
    return module


def kernels_for(device: torch.device | str) -> ModuleType:
    """The extension holding the kernels for tensors on `device`."""
    dev = torch.device(device)
    if dev.type not in FLAVORS:
        raise KernelBuildError(f"dmfx has no kernels for device type {dev.type!r} (only cpu and cuda)")
    return load(dev.type)
