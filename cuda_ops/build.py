"""Build, cache and load dmfx's kernel extensions.

All CPU kernels live in one extension module and all CUDA kernels in another. Each is built with
``torch.utils.cpp_extension.load``, so ninja compiles its translation units in parallel, and named by a
hash of its sources, headers, flags, the torch build and the machine, so a change to any of them builds
a new module and an old one is never loaded by mistake. The CUDA module: one unit of kernels per
family (csrc/<family>_cuda.cu, nvcc) and one unit of glue, csrc/cuda_bindings.cpp, which includes every
family's binding (<family>_cuda_bind.cpp), at -O1, for the same reason as the CPU module's. The CPU module: one unit of kernels per family
(csrc/<family>_cpu.cpp, -O3, ATen's tensor headers only) and one unit of glue, csrc/cpu_bindings.cpp,
which includes every family file for its glue part (DMFX_CPU_GLUE: the kernel functions' Python
bindings, the ops' registration and autograd formulas), compiled at -O1 (a pragma): the glue's heavy
torch headers are parsed once, not once per family, and its templates compile faster, at no cost per
call. A change to a family's kernels recompiles that family's unit and the glue unit. Builds land in
the torch extensions directory (``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``;
``DMFX_CACHE_DIR`` overrides it) and are shared across processes:

* each flavor compiles in one object directory (``dmfx_<flavor>_objects``) that outlives its builds:
  the sources are written there (only those that changed), so ninja recompiles only the families a
  change touched; the finished library is copied into the module's own directory, named by the hash;
* file locks serialise concurrent builds (the second process waits, then loads);
* a build is only trusted once ``dmfx_ok.json`` records the SHA-256 of the finished library, so a
  build that was killed half-way, or a library that was corrupted later, is detected and rebuilt;
* a warm load imports the finished library directly (no compiler, no ninja), well under a second;
* a cache directory that cannot be written falls back to a temporary one, with a warning.

Importing a module registers its kernels with the dispatcher (``TORCH_LIBRARY_IMPL`` in each family's
binding): the CPU module the ``CPU`` and ``Autograd`` keys of every ``dmfx::`` op, the CUDA module the
``CUDA`` key (so loading the CUDA module loads the CPU one first: the autograd formulas live there).
Until then Python stand-ins hold those keys (cuda_ops/_library.py); ``load`` removes them right before
the import, so the first call of an op builds or loads its kernels and then runs them.

The CPU kernels are built for this machine (``-march=native``), so an AVX-512 machine and an AVX2 one
run different code. A second CPU build, ``cpu_avx2`` (the x86-64-v3 baseline: AVX2 and FMA, no
AVX-512), lets the tests run both paths on one machine. It registers nothing: inside
``using_cpu_build("cpu_avx2")`` the native module's registered kernels call the AVX2 module's kernel
functions (through the table of kernel pointers csrc/cpu_kernels.h describes), and
``kernels_for("cpu")`` returns the AVX2 module (tests/conftest.py's ``cpu_build`` fixture runs the op
tests on each of ``CPU_BUILDS``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from filelock import FileLock

log = logging.getLogger("dmfx")

CSRC = Path(__file__).resolve().parent / "csrc"
# One translation unit per kernel family: csrc/<family>_cpu.cpp (its kernels) in the CPU module,
# <family>_cuda.cu in the CUDA module. What families share is in headers. The module's Python entry
# point (PYBIND11_MODULE) is csrc/cpu_bindings.cpp / cuda_bindings.cpp, each also the unit of every
# family's glue (see the docstring): cuda_bindings.cpp includes each <family>_cuda_bind.cpp.
FAMILIES = ("norm", "softmax", "pointwise", "attention", "cross_entropy")
# Functions of the CPU module without a CUDA twin: flash_use_blas switches the CPU flash kernels' GEMMs.
CPU_ONLY_FUNCTIONS = ("flash_use_blas", "kernel_table", "use_kernel_table")
MARKER = "dmfx_ok.json"


class KernelBuildError(RuntimeError):
    """A kernel extension could not be built or loaded (no compiler, compile error, bad cache)."""


@dataclass(frozen=True)
class Flavor:
    kind: str  # "cpu" | "cuda": the device the kernels run on
    sources: tuple[str, ...]  # csrc files, each compiled on its own (.cpp with the C++ compiler, .cu with nvcc)
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    headers: tuple[str, ...] = ("*.h",)  # globs of the csrc headers the sources include (hashed)
    registers: bool = True  # registers its kernels with the dispatcher (else -DDMFX_KERNELS_ONLY)


def _cpu_capability_flags() -> tuple[str, ...]:
    """ATen's Vectorized<T> only uses AVX2/AVX-512 when CPU_CAPABILITY_* is defined (as in ATen's own
    kernel builds). Define it for every translation unit, matching what -march=native targets."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:
        return ()
    cap = {"AVX512": "AVX512", "AVX2": "AVX2"}.get(cap)
    return (f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}") if cap else ()


# -ffp-contract=off: the compiler never fuses a multiply and an add on its own. With contraction on,
# gcc vectorizes a loop and keeps a scalar copy for when it cannot rule out that an output overlaps an
# input (a run-time address check), and the two copies fused differently: the same kernel on the same
# values gave results 1 ulp apart depending on where the heap had put a scratch buffer (the float64
# attention gradcheck's "backward is not reentrant", 1 run in 50). Kernels that want an FMA write
# std::fma, which every copy of a loop keeps.
_CPU_COMMON_FLAGS = ("-fopenmp", "-ffp-contract=off")

# The glue translation unit first: it is the longest, and ninja starts the compiles in this order.
_CPU_SOURCES = ("cpu_bindings.cpp", *(f"{f}_cpu.cpp" for f in FAMILIES))

FLAVORS = {
    "cpu": Flavor(
        kind="cpu",
        sources=_CPU_SOURCES,
        cflags=("-O3", "-march=native", *_CPU_COMMON_FLAGS, *_cpu_capability_flags()),
        ldflags=("-fopenmp",),
    ),
    # The baseline x86-64 target without AVX-512 (what an AVX2-only machine runs), for the tests: its
    # kernels run through the native module's registrations (using_cpu_build).
    "cpu_avx2": Flavor(
        kind="cpu",
        sources=_CPU_SOURCES,
        cflags=("-O3", "-march=x86-64-v3", *_CPU_COMMON_FLAGS, "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2",
                "-DDMFX_KERNELS_ONLY"),
        ldflags=("-fopenmp",),
        registers=False,
    ),
    "cuda": Flavor(
        kind="cuda",
        # the longest units first, attention's kernels and the glue (ninja starts them in this order)
        sources=("attention_cuda.cu", "cuda_bindings.cpp", *(f"{f}_cuda.cu" for f in FAMILIES if f != "attention")),
        cflags=("-O3",),
        cuda_cflags=("-O3", "-lineinfo"),
        headers=("*.h", "*.cuh", "*_cuda_bind.cpp"),  # (the bindings: included by cuda_bindings.cpp)
    ),
}
# The CPU builds the tests run the op tests against (see using_cpu_build).
CPU_BUILDS = ("cpu", "cpu_avx2")
# What -march=x86-64-v3 requires of the CPU, as /proc/cpuinfo names it (abm: lzcnt).
_X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")

_loaded: dict[str, ModuleType] = {}
_failed: dict[str, KernelBuildError] = {}
_cpu_build = "cpu"  # the CPU build kernels_for("cpu") returns (using_cpu_build); process-wide, as
# the autograd engine runs backward kernels on threads of its own


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


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _machine_tag() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    keep = [ln for ln in _cpuinfo() if ln.startswith(("model name", "flags"))][:2]
    return os.uname().machine + ("|" + "|".join(keep) if keep else "")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where that cannot be read)."""
    line = next((ln for ln in _cpuinfo() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_build_unavailable(name: str) -> str | None:
    """Why the CPU build `name` (one of CPU_BUILDS) cannot run here, or adds nothing to the native
    build; None when it can run. The AVX2 build needs an x86-64-v3 CPU, and on one without AVX-512
    the native build already runs the AVX2 code path."""
    if name not in CPU_BUILDS:
        raise ValueError(f"dmfx: unknown CPU build {name!r} (one of {CPU_BUILDS})")
    if name == "cpu":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the {name} build targets x86-64 and this machine is {platform.machine()}"
    flags = _cpu_flags()
    missing = [f for f in _X86_64_V3 if f not in flags]
    if missing:
        return f"the {name} build targets x86-64-v3 and this CPU lacks {', '.join(missing)} (/proc/cpuinfo)"
    if "avx512f" not in flags:
        return f"this CPU has no AVX-512, so the native build already runs the AVX2 code path {name} would test"
    return None


@contextlib.contextmanager
def using_cpu_build(name: str):
    """Inside the block every CPU dmfx op runs the kernels of the CPU build `name` (one of CPU_BUILDS),
    built on first use, and ``kernels_for("cpu")`` returns its module (yielded). For the tests: a
    machine then runs both the AVX-512 and the AVX2 code paths. The native module's registered kernels
    call the other build's kernel functions through its table of kernel pointers (csrc/cpu_kernels.h).
    Raises KernelBuildError where the build cannot run here (cpu_build_unavailable)."""
    global _cpu_build
    reason = cpu_build_unavailable(name)
    if reason is not None:
        raise KernelBuildError(f"dmfx: the {name} kernels cannot run here: {reason}")
    native, module = load("cpu"), load(name)
    before, _cpu_build = _cpu_build, name
    table = native.use_kernel_table(module.kernel_table())
    try:
        yield module
    finally:
        native.use_kernel_table(table)
        _cpu_build = before


def _visible_gpu_archs() -> list[str]:
    """The CUDA architectures torch.utils.cpp_extension builds for when TORCH_CUDA_ARCH_LIST is unset:
    those of the visible GPUs, capped at the newest this torch supports, the newest also as PTX."""
    newest = max(
        ((int(a[3:]) // 10, int(a[3:]) % 10) for a in torch.cuda.get_arch_list() if a.startswith("sm_") and a[3:].isdigit()),
        default=None,
    )
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    archs = [f"{major}.{minor}" for major, minor in sorted(min(c, newest) if newest else c for c in caps)]
    if archs:
        archs[-1] += "+PTX"
    return archs


def cuda_arch_list() -> str:
    """The architectures the CUDA build targets, as a TORCH_CUDA_ARCH_LIST value: the environment's
    (unless unset or "native"), else the visible GPUs' (as torch detects them), else, with no GPU to
    detect (a compile-only check), Hopper (9.0). Part of the CUDA module's hash, and what the build
    sets TORCH_CUDA_ARCH_LIST to while it runs."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        return env
    archs = _visible_gpu_archs() if torch.cuda.is_available() else []
    return ";".join(archs) or "9.0"


@contextlib.contextmanager
def _env(name: str, value: str):
    """os.environ[name] = value inside the block; the previous value (or its absence) after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _files(flavor: Flavor) -> list[str]:
    """The csrc files a build of `flavor` reads: its sources, then every header its globs match."""
    headers = sorted({p.name for pattern in flavor.headers for p in CSRC.glob(pattern)})
    return [*flavor.sources, *headers]


def source_hash(flavor: Flavor) -> str:
    h = hashlib.sha256()
    for name in _files(flavor):
        h.update(name.encode())
        h.update(_read(name).encode())
    for part in (flavor.cflags, flavor.cuda_cflags, flavor.ldflags):
        h.update(repr(part).encode())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.cuda).encode())
    h.update(sys.version.encode())
    # the compilers the environment names (a module built by another compiler is another module; a
    # build from before _build_compilers by a CXX that links libstdc++ statically is not reused)
    h.update(f"CXX={os.environ.get('CXX')} CC={os.environ.get('CC')} stdcxx-shared".encode())
    if flavor.kind == "cpu":
        h.update(_machine_tag().encode())
    else:
        h.update(cuda_arch_list().encode())
    return h.hexdigest()[:16]


def module_name(flavor: str) -> str:
    """The module (and build directory) name of FLAVORS[flavor]: its name and source hash."""
    return f"dmfx_{flavor}_{source_hash(FLAVORS[flavor])}"


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


def write_atomic(path: Path, data: bytes | str) -> None:
    """`data` into `path` through a temp file in the same directory and a rename, so a reader (another
    process, another thread) never sees half a file. The temp file's name is unique (mkstemp), and it
    is removed if the write fails; the error is the caller's to handle (a read-only or full disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    """Import the cached library `lib` of module `name`: under the name it was built with (its
    PyInit_ symbol, recorded in the marker), then named `name`."""
    try:
        built_as = json.loads((lib.parent / MARKER).read_text()).get("module") or name
    except (OSError, ValueError):
        built_as = name
    spec = importlib.util.spec_from_file_location(built_as, lib)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"cannot import {lib}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__name__ = name
    return module


def _compile(key: str, flavor: Flavor, objects: Path) -> ModuleType:
    """Build `flavor` in its object directory `objects` and import it (torch's loader does both)."""
    with contextlib.ExitStack() as stack:
        # a compiler that would put its own copy of libstdc++ into the module is swapped for one that
        # links the shared library torch uses, for this build only (_build_compilers)
        for name, value in _build_compilers().items():
            stack.enter_context(_env(name, value))
        if flavor.kind == "cuda":
            _ensure_cuda_home()
            # the architectures the module's hash names, for this build only (the user's other extension
            # builds in this process see TORCH_CUDA_ARCH_LIST as it was)
            stack.enter_context(_env("TORCH_CUDA_ARCH_LIST", cuda_arch_list()))
        return _load(key, flavor, objects)


_STDCXX_PROBE = "#include <sstream>\n#include <string>\nstd::string f(long n) { std::ostringstream s; s << n; return s.str(); }\n"


def _needed_libraries(lib: Path) -> list[str] | None:
    """The NEEDED entries of the shared library `lib` (readelf, else objdump); None where neither runs."""
    for cmd in (["readelf", "-d", str(lib)], ["objdump", "-p", str(lib)]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0:
            return [line.split()[-1].strip("[]") for line in out.stdout.splitlines() if "NEEDED" in line]
    return None


def links_libstdcxx_statically(cxx: str) -> bool | None:
    """Whether the C++ compiler `cxx` (a command line) puts a copy of libstdc++ into a shared library
    that uses iostreams instead of linking libstdc++.so; None where that cannot be told (no compiler, no
    readelf or objdump).

    Such a copy beside the shared libstdc++ torch loads crashes the process (SIGSEGV in its
    ``std::ostream::_M_insert<long>``) as soon as a TORCH_CHECK message formats a number: seen on a GPU
    image whose CXX was a gcc that links libstdc++ statically (bench/RESULTS.md, 2026-12-04)."""
    with tempfile.TemporaryDirectory(prefix="dmfx_cxx_probe_") as d:
        src, lib = Path(d) / "probe.cpp", Path(d) / "probe.so"
        src.write_text(_STDCXX_PROBE)
        try:
            r = subprocess.run([*shlex.split(cxx), "-shared", "-fPIC", str(src), "-o", str(lib)], capture_output=True,
                               timeout=120)
        except (OSError, subprocess.SubprocessError, ValueError):
            return None
        needed = _needed_libraries(lib) if r.returncode == 0 else None
    # (a clang that links libc++.so links a shared C++ runtime too)
    return None if needed is None else not any(n.startswith(("libstdc++", "libc++")) for n in needed)


def _build_compilers() -> dict[str, str]:
    """The CXX and CC to build the kernels with, where the configured ones must be replaced: empty (the
    environment's compilers, torch's choice) unless CXX (else c++) links libstdc++ statically
    (links_libstdcxx_statically), in which case the first g++ / c++ on PATH or in /usr/bin that links
    it dynamically, with the C compiler beside it (nvcc's host compiler: the CUDA objects then use the
    same libstdc++ headers), with a warning. Where no such compiler exists the build goes on with a
    warning: the kernels work, but an error message that formats a number may crash the process.
    Probed once per process and CXX, on the first build (a warm load compiles nothing)."""
    return _compilers_for(os.environ.get("CXX") or "c++")


@functools.lru_cache(maxsize=None)
def _compilers_for(cxx: str) -> dict[str, str]:
    """_build_compilers for the configured C++ compiler `cxx`."""
    if links_libstdcxx_statically(cxx) is not True:
        return {}
    mine = os.path.realpath(shutil.which(shlex.split(cxx)[0]) or cxx)
    for cand in ("g++", "c++", "/usr/bin/g++", "/usr/bin/c++"):
        path = shutil.which(cand)
        if not path or os.path.realpath(path) == mine or links_libstdcxx_statically(path) is not False:
            continue
        cc = next((str(Path(path).parent / c) for c in ("gcc", "cc") if (Path(path).parent / c).exists()), None)
        chosen = {"CXX": path, **({"CC": cc} if cc else {})}
        warn("dmfx: CXX=%s links libstdc++ statically, and a second copy of libstdc++ beside torch's crashes the "
             "process on an error message with a number in it; building dmfx's kernels with %s instead", cxx,
             " and ".join(f"{k}={v}" for k, v in chosen.items()))
        return chosen
    warn("dmfx: CXX=%s links libstdc++ statically and no compiler on PATH links it dynamically: dmfx's kernels "
         "are built with it, but an error message that formats a number may crash the process (set CXX to a "
         "compiler that links libstdc++.so)", cxx)
    return {}


def _write_sources(flavor: Flavor, src: Path) -> None:
    """The csrc files of `flavor` in `src`, rewriting only those whose text changed: ninja then
    recompiles the translation units a change touched (their own source or a header they include)."""
    src.mkdir(parents=True, exist_ok=True)
    for name in _files(flavor):
        text = _read(name)
        path = src / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)


class _NoCudaRuntimeNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def cpp_extension() -> ModuleType:
    """``torch.utils.cpp_extension``, imported without the "No CUDA runtime is found, using
    CUDA_HOME=..." warning its import logs on a machine with a CUDA toolkit and no GPU: a CPU build
    does not use CUDA, and dmfx's own build line says what is built."""
    if "torch.utils.cpp_extension" not in sys.modules:
        note = _NoCudaRuntimeNote()
        logger = logging.getLogger("torch.utils.cpp_extension")
        logger.addFilter(note)
        try:
            import torch.utils.cpp_extension  # noqa: F401
        finally:
            logger.removeFilter(note)
    return sys.modules["torch.utils.cpp_extension"]


def _gcc_gc_params() -> tuple[str, ...]:
    """gcc collects its garbage whenever its heap grew 30-100% past a floor of min(RAM / 8, 128 MB); a
    unit here allocates 0.8-2.4 GB, and the collections cost 5-8% of its compile time (-ftime-report).
    With a floor of min(RAM / 8, 2 GB) the glue unit peaks at 2.3 GB instead of 1.8 GB and a kernel
    unit collects at most once. The object files are the same byte for byte (these flags are not part
    of the module's hash)."""
    try:
        ram_kb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, ValueError, AttributeError):
        return ()
    floor_kb = min(ram_kb // 8, 2 * 1024 * 1024)
    return ("--param=ggc-min-expand=400", f"--param=ggc-min-heapsize={floor_kb}") if floor_kb > 131072 else ()


def _compiler_is_gcc() -> bool:
    """Whether the C++ compiler torch builds with (CXX, else c++) is gcc (--param is gcc's)."""
    try:
        out = subprocess.run([*shlex.split(os.environ.get("CXX") or "c++"), "--version"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    return "clang" not in out.lower() and ("gcc" in out.lower() or "free software foundation" in out.lower())


def _load(key: str, flavor: Flavor, objects: Path) -> ModuleType:
    load = cpp_extension().load

    src = objects / "src"
    _write_sources(flavor, src)
    (objects / "lock").unlink(missing_ok=True)  # (older torch's lock file, left by a killed build)
    build_params = _gcc_gc_params() if flavor.kind == "cpu" and _compiler_is_gcc() else ()
    return load(
        name=f"dmfx_{key}",  # fixed per flavor: a changed name would change every compile command
        sources=[str(src / n) for n in flavor.sources],
        extra_cflags=[*flavor.cflags, *build_params],
        extra_cuda_cflags=list(flavor.cuda_cflags) or None,
        extra_ldflags=list(flavor.ldflags),
        extra_include_paths=[str(src)],
        build_directory=str(objects),
        with_cuda=flavor.kind == "cuda",
        is_python_module=True,
        verbose=False,
    )


def _ensure_cuda_home() -> None:
    """Point torch at a CUDA toolkit that has libcudart when it would guess wrong.

    torch derives CUDA_HOME from the `nvcc` on PATH; where that is a wrapper script (e.g. in
    /usr/local/bin) the guess has no lib64/ and linking fails with "cannot find -lcudart". Prefer the
    toolkit `nvcc` really lives in, then the usual install locations.
    """
    ext = cpp_extension()

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


# What load() runs around the import of a module that registers kernels (cuda_ops/_library.py sets
# them): "remove" the Python stand-ins at the keys the module's C++ kernels take, "restore" them
# when the build or import failed (so the next op call raises the build error again).
stand_ins: dict[str, Callable[[str], None]] = {}


def load(flavor: str) -> ModuleType:
    """The extension module of `flavor` (a FLAVORS key: "cpu", "cuda", "cpu_avx2"), built on first use
    and cached on disk; importing it registers its kernels (the CUDA module loads the CPU one first).

    Raises KernelBuildError (once per process and flavor; later calls re-raise it quickly).
    """
    if flavor in _loaded:
        return _loaded[flavor]
    if flavor in _failed:
        raise _failed[flavor]
    if flavor not in FLAVORS:
        raise KernelBuildError(f"dmfx has no kernel build {flavor!r} (builds: {', '.join(FLAVORS)})")
    with _load_lock:
        if flavor in _loaded:  # (another thread loaded it while this one waited)
            return _loaded[flavor]
        if flavor == "cuda":
            load("cpu")  # the autograd kernels of every op, CUDA's too, are registered by the CPU module
        registers = FLAVORS[flavor].registers
        try:
            if registers and "remove" in stand_ins:
                stand_ins["remove"](flavor)
            module = _build_or_load(flavor)
        except Exception as e:  # compiler missing, compile error, import error, ...
            if registers and "restore" in stand_ins:
                stand_ins["restore"](flavor)
            err = e if isinstance(e, KernelBuildError) else KernelBuildError(
                f"dmfx could not build its {flavor.upper()} kernels: {_summarize(e)}")
            _failed[flavor] = err
            raise err from e
        _loaded[flavor] = module
    return module


_load_lock = threading.RLock()


def _summarize(e: BaseException, limit: int = 1500) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:300] + " ... " + text[-(limit - 300):]


def _build_or_load(key: str) -> ModuleType:
    flavor = FLAVORS[key]
    name = module_name(key)
    root = cache_root()
    build_dir = root / name
    start = time.perf_counter()
    if _is_valid(build_dir, name):
        module = _import(name, _library_path(build_dir, name))
        log.info("dmfx: loaded %s kernels %s from cache in %.2fs", key.upper(), name, time.perf_counter() - start)
        return module
    _check_compiler(flavor.kind)
    with FileLock(str(root / f"{name}.lock")):
        if not _is_valid(build_dir, name):  # nobody built it while we waited
            if build_dir.exists():
                warn("dmfx: discarding incomplete or corrupted kernel build in %s", build_dir)
                shutil.rmtree(build_dir, ignore_errors=True)
            build_dir.mkdir(parents=True)
            print(
                f"dmfx: building {key.upper()} kernels {name} (happens once per machine and version; "
                f"cached in {build_dir})",
                file=sys.stderr,
                flush=True,
            )
            with FileLock(str(root / f"dmfx_{key}_objects.lock")):  # (builds of other versions share it)
                module = _compile(key, flavor, root / f"dmfx_{key}_objects")
                lib = _library_path(build_dir, name)
                shutil.copyfile(module.__file__, lib)
            marker = {"sha256": _sha256(lib), "torch": torch.__version__, "module": module.__name__}
            write_atomic(build_dir / MARKER, json.dumps(marker))
            # the module as its cached copy names it (the object directory's library is rebuilt by
            # later versions; this process keeps the one it imported)
            module.__name__, module.__file__ = name, str(lib)
            log.info("dmfx: built %s kernels %s in %.1fs", key.upper(), name, time.perf_counter() - start)
            return module
    module = _import(name, _library_path(build_dir, name))
    log.info("dmfx: loaded %s kernels %s (built by another process) in %.2fs", key.upper(), name, time.perf_counter() - start)
    return module


def kernels_for(device: torch.device | str) -> ModuleType:
    """The extension holding the kernels for tensors on `device` (for the CPU: the build
    using_cpu_build selected, the native one by default)."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise KernelBuildError(f"dmfx has no kernels for device type {dev.type!r} (only cpu and cuda)")
    return load(_cpu_build if dev.type == "cpu" else dev.type)
