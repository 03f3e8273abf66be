"""The kernel cache: warm loads, concurrent builds, killed builds, corruption, read-only directories."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from dmfx.cuda_ops import build

LOAD = "import sys, time; from dmfx.cuda_ops import build; t = time.perf_counter(); m = build.load('cpu'); print('LOADED', time.perf_counter() - t, m.__name__)"


def _python(code, env=None, **kw):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, **kw)


def test_warm_load_is_fast_and_does_not_compile():
    build.load("cpu")  # make sure the default cache is warm
    p = _python(LOAD)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    seconds = float(out.split()[1])
    assert seconds < 1.0, out
    assert "building" not in err


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
