"""The kernel cache: warm loads, concurrent builds, killed builds, corruption, read-only directories."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from dmfx.cuda_ops import build

LOAD = ("import sys, time; from dmfx.cuda_ops import build; t = time.perf_counter(); m = build.load('cpu'); "
        "print('LOADED', time.perf_counter() - t, m.__name__)")


def _python(code, env=None, **kw):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})}, **kw)


def test_warm_load_is_fast_and_does_not_compile():
    build.load("cpu")  # make sure the default cache is warm
    p = _python(LOAD)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    seconds = float(out.split()[1])
    assert seconds < 1.0, out
    assert "building" not in err


def test_the_build_command_builds_checks_and_says_so():
    """``python -m dmfx build`` (README): the CPU kernels built or found, self-checked, and one line saying
    where they are and what the check switched off."""
    build.load("cpu")  # (the default cache warm: the command then only loads and checks)
    p = subprocess.run([sys.executable, "-m", "dmfx", "build"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"dmfx: CPU kernels dmfx_cpu_\w+ ready in .+; (every family passed|switched off)", p.stdout), p.stdout


FIRST_USE = {
    # the first call of an op loads the kernels (its stand-in at the CPU key, or at the Autograd key
    # when an input requires grad), then runs them
    "op call": "out = torch.ops.dmfx.layer_norm(x, w, None, 1e-5)[0]",
    "op call with grad": "out = torch.ops.dmfx.layer_norm(x.requires_grad_(), w, None, 1e-5)[0]; out.sum().backward()",
    "build.load": "build.load('cpu'); out = torch.ops.dmfx.layer_norm(x, w, None, 1e-5)[0]",
}


@pytest.mark.parametrize("first", FIRST_USE)
def test_ops_work_before_and_after_the_kernels_load(first):
    """In a fresh process the ops run whichever comes first, an op call or build.load; the C++
    kernels then hold the keys (the stand-ins are gone, nothing was overridden)."""
    build.load("cpu")  # (warm cache: the subprocess only imports)
    p = _python(
        f"""
        import torch
        import torch.nn.functional as F
        from dmfx.cuda_ops import build, _library
        x, w = torch.randn(3, 16), torch.randn(16)
        {FIRST_USE[first]}
        assert torch.allclose(out, F.layer_norm(x.detach(), (16,), w), atol=1e-5)
        assert "cpu" in build._loaded and "cpu" not in _library._stand_ins and "cuda" in _library._stand_ins
        print("OK")
        """
    )
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and "OK" in out, err[-3000:]
    assert "Overriding" not in err and "previously registered" not in err, err[-3000:]


def test_two_processes_building_at_once_over_a_killed_build(tmp_path):
    """Fresh cache with the debris of a killed build (half-written library, torch's stale lock file):
    both processes succeed, exactly one of them compiles."""
    name = build.module_name("cpu")
    debris = tmp_path / name
    debris.mkdir()
    (debris / f"{name}.so").write_bytes(b"\x7fELF half written")
    (debris / "lock").write_text("")  # torch's FileBaton lock left behind by the killed build
    env = {"DMFX_CACHE_DIR": str(tmp_path)}
    procs = [_python(LOAD, env) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
        assert "LOADED" in out
    assert sum("dmfx: building CPU kernels" in err for _, err in results) == 1
    # a CPU build says so in dmfx's one line, and nothing from torch about CUDA (its cpp_extension
    # logs "No CUDA runtime is found" on import where a toolkit is installed and no GPU is)
    assert not any("CUDA" in err for _, err in results), [err[-2000:] for _, err in results]
    assert build._is_valid(debris, name)


def test_corrupted_library_is_detected(tmp_path):
    name = build.module_name("cpu")
    src = build.cache_root() / name
    build.load("cpu")
    dst = tmp_path / name
    dst.mkdir()
    for f in (f"{name}.so", build.MARKER):
        (dst / f).write_bytes((src / f).read_bytes())
    assert build._is_valid(dst, name)
    with open(dst / f"{name}.so", "r+b") as fh:
        fh.seek(200)
        fh.write(b"garbage")
    assert not build._is_valid(dst, name)  # load() would discard and rebuild it


def test_write_atomic_never_shows_half_a_file_nor_leaves_temp_files(tmp_path, monkeypatch):
    """The one way dmfx writes its cache files (build marker, compile cache, tuning, self-check): threads
    of one process writing one file at once each leave a whole payload (the pid alone named their temp
    files before, so two threads could interleave), and a failed write raises, keeps the old file and
    removes its temp file."""
    import threading

    path = tmp_path / "new" / "f.json"
    payloads = [str(i) * 100_000 for i in range(4)]
    errors = []

    def writer(p):
        try:
            for _ in range(25):
                build.write_atomic(path, p)
        except Exception as e:  # (a thread's exception would not fail the test by itself)
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert path.read_text() in payloads
    assert [f.name for f in path.parent.iterdir()] == ["f.json"]

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(build.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        build.write_atomic(path, b"new")
    assert path.read_text() in payloads
    assert [f.name for f in path.parent.iterdir()] == ["f.json"]


def test_unwritable_cache_falls_back_to_a_temp_dir(monkeypatch, caplog):
    monkeypatch.setenv("DMFX_CACHE_DIR", "/proc/dmfx-cannot-write-here")
    with caplog.at_level("WARNING", logger="dmfx"):
        root = build.cache_root()
    assert "not writable" in caplog.text
    assert str(root).startswith(os.path.realpath(__import__("tempfile").gettempdir()))


def test_missing_compiler_is_a_clear_build_error(tmp_path, monkeypatch):
    p = _python(
        """
        from dmfx.cuda_ops import build
        try:
            build.load("cpu")
        except build.KernelBuildError as e:
            print("CLEAR", str(e)[:200])
        """,
        {"DMFX_CACHE_DIR": str(tmp_path), "CXX": "/nonexistent/c++", "PATH": os.path.dirname(sys.executable)},
    )
    out, err = p.communicate(timeout=300)
    assert "CLEAR dmfx could not build its CPU kernels" in out, err[-2000:]


# ------------------------------------------------------------------ the second CPU build (AVX2 baseline)


def test_each_cpu_build_has_its_own_module_and_target():
    native, avx2 = build.FLAVORS["cpu"], build.FLAVORS["cpu_avx2"]
    assert build.module_name("cpu") != build.module_name("cpu_avx2")
    assert build.module_name("cpu_avx2").startswith("dmfx_cpu_avx2_")
    assert "-march=native" in native.cflags
    assert "-march=x86-64-v3" in avx2.cflags and "-DCPU_CAPABILITY=AVX2" in avx2.cflags
    assert avx2.sources == native.sources and avx2.kind == native.kind == "cpu"
    assert native.registers and not avx2.registers and "-DDMFX_KERNELS_ONLY" in avx2.cflags


def test_using_cpu_build_switches_the_cpu_kernels_for_the_block_only():
    reason = build.cpu_build_unavailable("cpu_avx2")
    if reason:
        pytest.skip(reason)
    native = build.kernels_for("cpu")
    with pytest.raises(ZeroDivisionError):
        with build.using_cpu_build("cpu_avx2") as module:
            assert build.kernels_for("cpu") is module is build.load("cpu_avx2") is not native
            assert build.kernels_for(torch.device("cpu")) is module
            raise ZeroDivisionError  # leaves the block by an exception
    assert build.kernels_for("cpu") is native


def test_the_avx2_build_has_no_avx512_code():
    """The AVX2 build's library uses no AVX-512 register (zmm), so it is the code an AVX2-only machine
    runs; on an AVX-512 machine the native one does use them (the two paths differ)."""
    objdump = shutil.which("objdump")
    reason = build.cpu_build_unavailable("cpu_avx2")
    if objdump is None or reason:
        pytest.skip(reason or "needs objdump")

    def uses_zmm(flavor):
        lib = build.load(flavor).__file__
        out = subprocess.run([objdump, "-d", "--no-show-raw-insn", lib], capture_output=True, text=True, check=True).stdout
        return "%zmm" in out

    assert not uses_zmm("cpu_avx2")
    assert uses_zmm("cpu")


@pytest.mark.parametrize("machine, flags, expected", [
    ("aarch64", set(), "targets x86-64 and this machine is aarch64"),
    ("x86_64", {"avx", "avx2", "fma"}, "lacks bmi1, bmi2, f16c, abm, movbe, xsave"),
    ("x86_64", set(build._X86_64_V3), "no AVX-512"),
    ("x86_64", {*build._X86_64_V3, "avx512f"}, None),
])
def test_where_the_avx2_build_skips(monkeypatch, machine, flags, expected):
    monkeypatch.setattr(build.platform, "machine", lambda: machine)
    monkeypatch.setattr(build, "_cpu_flags", lambda: flags)
    reason = build.cpu_build_unavailable("cpu_avx2")
    assert (reason is None) if expected is None else (expected in reason), reason
    assert build.cpu_build_unavailable("cpu") is None
    if expected is not None:
        with pytest.raises(build.KernelBuildError, match="cannot run here"):
            with build.using_cpu_build("cpu_avx2"):
                pass


# ------------------------------------------------------------------ the CPU build's translation units

# What the glue needs and a kernel unit must not parse: ~15 s a unit together (build.py's docstring)
GLUE_HEADERS = ("torch/library.h", "torch/csrc/autograd/custom_function.h", "torch/csrc/utils/pybind.h",
                "torch/extension.h", "torch/python.h", "ATen/ATen.h")
GLUE_PART = "#else  // DMFX_CPU_GLUE"


def _includes(text: str, seen: set[str]) -> set[str]:
    """The <...> headers `text` includes, directly or through the csrc headers it includes ("...")."""
    found = set()
    for kind, name in re.findall(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', text, re.M):
        if kind == "<":
            found.add(name)
        elif name not in seen and (build.CSRC / name).is_file():
            seen.add(name)
            found |= _includes((build.CSRC / name).read_text(), seen)
    return found


@pytest.mark.parametrize("family", build.FAMILIES)
def test_a_family_kernel_unit_parses_no_glue_header(family):
    """<family>_cpu.cpp's kernel part (its own unit, -O3) includes none of the heavy headers the glue
    needs, not even through a csrc header; its glue part comes after the marker cpu_bindings.cpp's
    DMFX_CPU_GLUE selects."""
    text = (build.CSRC / f"{family}_cpu.cpp").read_text()
    assert text.count("#ifndef DMFX_CPU_GLUE") == 1 and text.count(GLUE_PART) == 1, family
    kernels = text[: text.index(GLUE_PART)]
    assert f"void bind_{family}(" not in kernels and "TORCH_LIBRARY_IMPL" not in kernels
    heavy = _includes(kernels, set()) & set(GLUE_HEADERS)
    assert not heavy, f"{family}_cpu.cpp's kernels include {sorted(heavy)}: put what needs them in its glue part"


def test_the_glue_unit_holds_every_family_glue_at_O1():
    text = (build.CSRC / "cpu_bindings.cpp").read_text()
    first_include = text.index("#include")
    assert text.index('#pragma GCC optimize("O1")') < first_include  # (covers the templates it instantiates)
    assert text.index("#define DMFX_CPU_GLUE") < first_include
    for family in build.FAMILIES:
        assert f'#include "{family}_cpu.cpp"' in text and f"dmfx::bind_{family}(m);" in text, family
    sources = build.FLAVORS["cpu"].sources
    assert sources[0] == "cpu_bindings.cpp"  # the longest unit starts first
    assert sorted(sources[1:]) == sorted(f"{f}_cpu.cpp" for f in build.FAMILIES)


@pytest.mark.parametrize("gcc", [True, False])
def test_the_cpu_build_tunes_gccs_garbage_collection_outside_the_hash(monkeypatch, tmp_path, gcc):
    """With gcc the CPU units compile with a larger garbage-collection floor (faster, same objects); it
    is not part of the module's name, and no other compiler gets gcc's --param."""
    import torch.utils.cpp_extension as ext

    seen = {}
    monkeypatch.setattr(ext, "load", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(build, "_compiler_is_gcc", lambda: gcc)
    name = build.module_name("cpu")
    build._compile("cpu", build.FLAVORS["cpu"], tmp_path)
    params = [f for f in seen["extra_cflags"] if f.startswith("--param")]
    assert seen["extra_cflags"][: len(build.FLAVORS["cpu"].cflags)] == list(build.FLAVORS["cpu"].cflags)
    assert bool(params) == (gcc and bool(build._gcc_gc_params())), params
    assert build.module_name("cpu") == name


# ------------------------------------------------------------------ the CUDA build's architectures


def _gpus(monkeypatch, *caps, arch_list=("sm_80", "sm_86", "sm_90")):
    """Pretend these GPUs (compute capabilities) are visible, under a torch built for `arch_list`."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[i])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))


def test_the_cuda_hash_names_the_architectures_the_build_targets(monkeypatch):
    names = {}
    for gpus in [(), ((8, 0),), ((9, 0),), ((9, 0), (8, 0))]:
        _gpus(monkeypatch, *gpus)
        names[gpus] = (build.cuda_arch_list(), build.module_name("cuda"))
    assert [arch for arch, _ in names.values()] == ["9.0", "8.0+PTX", "9.0+PTX", "8.0;9.0+PTX"]
    assert len({name for _, name in names.values()}) == 4
    _gpus(monkeypatch, (12, 0))  # a GPU newer than this torch: capped at its newest, as torch does
    assert build.cuda_arch_list() == "9.0+PTX"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")  # the user's choice wins
    assert build.cuda_arch_list() == "8.6" and build.module_name("cuda") not in {n for _, n in names.values()}


@pytest.mark.parametrize("user_value", [None, "8.6"])
@pytest.mark.parametrize("fails", [False, True])
def test_the_cuda_build_sets_the_arch_list_only_while_it_runs(monkeypatch, tmp_path, user_value, fails):
    import torch.utils.cpp_extension as ext

    _gpus(monkeypatch)
    if user_value:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", user_value)
    seen = []

    def fake_load(**kwargs):
        seen.append(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        if fails:
            raise RuntimeError("nvcc failed")

    monkeypatch.setattr(ext, "load", fake_load)
    monkeypatch.setattr(build, "_ensure_cuda_home", lambda: None)
    try:
        build._compile("cuda", build.FLAVORS["cuda"], tmp_path)
    except RuntimeError:
        assert fails
    assert seen == [user_value or "9.0"]
    assert os.environ.get("TORCH_CUDA_ARCH_LIST") == user_value


def _static_cxx(tmp_path):
    """A C++ compiler command that links libstdc++ statically (as the H200 image's CXX=/opt/gcc/bin/g++
    did), made from this machine's c++."""
    cxx = tmp_path / "static-g++"
    cxx.write_text('#!/bin/sh\nexec c++ "$@" -static-libstdc++\n')
    cxx.chmod(0o755)
    if build.links_libstdcxx_statically(str(cxx)) is not True:
        pytest.skip("this machine's c++ cannot link libstdc++ statically (no libstdc++.a, or no readelf/objdump)")
    return str(cxx)


def test_the_stdcxx_probe_tells_a_static_libstdcxx_from_a_shared_one(tmp_path):
    assert build.links_libstdcxx_statically("c++") is False  # this machine's compiler, as torch links with it
    assert build.links_libstdcxx_statically(_static_cxx(tmp_path)) is True
    assert build.links_libstdcxx_statically(str(tmp_path / "no-such-compiler")) is None


def test_a_cxx_that_links_libstdcxx_statically_is_replaced_for_the_build(monkeypatch, tmp_path, caplog):
    """On the H200 image every TORCH_CHECK message with a number in it crashed the process inside the
    kernel module's own copy of libstdc++ (bench/RESULTS.md): the build swaps such a compiler for one
    that links libstdc++.so, says so, and sets it only while the build runs."""
    import torch.utils.cpp_extension as ext

    static = _static_cxx(tmp_path)
    monkeypatch.setenv("CXX", static)
    monkeypatch.setenv("CC", "/the/users/cc")
    build._compilers_for.cache_clear()
    chosen = build._build_compilers()
    assert any("links libstdc++ statically" in r.getMessage() and chosen["CXX"] in r.getMessage() for r in caplog.records)
    assert chosen["CXX"] != static and build.links_libstdcxx_statically(chosen["CXX"]) is False
    assert os.path.basename(chosen["CC"]) in ("gcc", "cc") and os.path.dirname(chosen["CC"]) == os.path.dirname(chosen["CXX"])
    seen = []
    monkeypatch.setattr(ext, "load", lambda **kw: seen.append((os.environ["CXX"], os.environ["CC"])))
    build._compile("cpu", build.FLAVORS["cpu"], tmp_path)
    assert seen == [(chosen["CXX"], chosen["CC"])]
    assert (os.environ["CXX"], os.environ["CC"]) == (static, "/the/users/cc")
    # a compiler that links libstdc++.so is left alone, and the environment's compilers name the module
    build._compilers_for.cache_clear()
    monkeypatch.setenv("CXX", "c++")
    assert build._build_compilers() == {}
    names = {build.module_name("cpu")}
    monkeypatch.setenv("CXX", static)
    assert build.module_name("cpu") not in names
