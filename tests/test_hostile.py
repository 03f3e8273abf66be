"""Hostile and odd input: empty batches, length-1 sequences, odd hidden sizes, strided and
channels-last inputs, NaN/Inf, float64, devices without kernels, and a kernel cache that is
corrupted, read-only or cannot be built (no compiler). dmfx must give eager's answer or fall back
with a visible warning; never crash, hang or silently change dtypes."""

import copy
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

import dmfx
from dmfx import backend
from dmfx.cuda_ops import build


class Layer(torch.nn.Module):
    """Attention (softmax with an additive mask) + bias/residual/LayerNorm twice + GELU MLP."""

    def __init__(self, H=32, heads=2, p=0.0):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(H, 3 * H)
        self.proj = torch.nn.Linear(H, H)
        self.ln1 = torch.nn.LayerNorm(H)
        self.up = torch.nn.Linear(H, 2 * H)
        self.down = torch.nn.Linear(2 * H, H)
        self.ln2 = torch.nn.LayerNorm(H)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        B, L, H = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2) / (H // self.heads) ** 0.5).softmax(-1) @ v
        x = self.ln1(self.drop(self.proj(a.transpose(1, 2).reshape(B, L, H))) + x)
        return self.ln2(self.drop(self.down(F.gelu(self.up(x)))) + x)


def ln_residual(x, r, w, b):
    """LayerNorm + residual chain as a plain function (any input layout)."""
    return F.layer_norm(x * 2.0 + r, (x.shape[-1],), w, b)


def _fired_any() -> bool:
    return any(r.fired for r in dmfx.records())


def _check_layer(m, x, tol=1e-5, backward=True):
    ref = copy.deepcopy(m)
    x1, x2 = x.clone().requires_grad_(backward), x.clone().requires_grad_(backward)
    out = torch.compile(m, backend="dmfx", options={"fallback": False})(x1)
    exp = ref(x2)
    assert out.shape == exp.shape and out.dtype == exp.dtype
    if exp.numel():
        assert rel_err(out, exp) < tol
    if backward:
        R = torch.randn_like(exp)
        (out * R).sum().backward()
        (exp * R).sum().backward()
        if exp.numel():
            assert rel_err(x1.grad, x2.grad) < tol
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            if exp.numel() == 0:
                assert torch.equal(p.grad, q.grad), name  # zeros, as eager
            else:
                scale = torch.cat([t.grad.flatten() for t in ref.parameters()])
                assert rel_err(p.grad, q.grad, scale) < tol, name
    assert _fired_any(), [r.summary() for r in dmfx.records()]


# ----------------------------------------------------------------------------------------- odd shapes


def test_empty_batch():
    _check_layer(Layer(), torch.randn(0, 5, 32))


def test_sequence_length_one():
    _check_layer(Layer(), torch.randn(3, 1, 32))


@pytest.mark.parametrize("H,heads", [(37, 1), (20, 5), (7, 7), (1, 1)])
def test_hidden_size_not_a_multiple_of_the_vector_width(H, heads):
    _check_layer(Layer(H, heads), torch.randn(2, 5, H))


@pytest.mark.parametrize(
    "layout",
    ["transposed", "sliced", "expanded_residual", "channels_last_over_c", "channels_last_over_w", "channels_last_3d"],
)
def test_strided_and_channels_last_inputs(layout):
    H = 24
    w, b = torch.randn(H, requires_grad=True), torch.randn(H, requires_grad=True)
    if layout == "transposed":  # [L, B, H] seen as [B, L, H]
        x, r = torch.randn(7, 3, H).transpose(0, 1), torch.randn(3, 7, H)
    elif layout == "sliced":  # every other row, and a slice of a wider hidden dim
        x, r = torch.randn(3, 14, 2 * H)[:, ::2, 5:5 + H], torch.randn(3, 7, H)
    elif layout == "expanded_residual":  # a broadcast (stride-0) residual
        x, r = torch.randn(3, 7, H), torch.randn(1, 7, H).expand(3, 7, H)
    elif layout == "channels_last_over_c":  # NCHW in channels-last memory, normalized over channels
        x = torch.randn(2, H, 5, 3).to(memory_format=torch.channels_last)
        x, r = x.permute(0, 2, 3, 1), torch.randn(2, 5, 3, H).to(memory_format=torch.channels_last)
    elif layout == "channels_last_over_w":  # NCHW in channels-last memory, normalized over W (strided)
        x, r = torch.randn(2, 5, 3, H).to(memory_format=torch.channels_last), torch.randn(2, 5, 3, H)
    else:  # NCDHW in channels_last_3d memory, normalized over W (a strided last dim)
        x, r = torch.randn(2, 3, 4, 5, H).to(memory_format=torch.channels_last_3d), torch.randn(2, 3, 4, 5, H)
    assert not (x.is_contiguous() and r.is_contiguous())
    x.requires_grad_()
    out = torch.compile(ln_residual, backend="dmfx", options={"fallback": False})(x, r, w, b)
    exp = ln_residual(x, r, w, b)
    assert rel_err(out, exp) < 1e-5
    R = torch.randn_like(exp)
    for g, e in zip(torch.autograd.grad(out, (x, w, b), R), torch.autograd.grad(exp, (x, w, b), R)):
        assert rel_err(g, e) < 1e-5
    assert _fired_any(), [r.summary() for r in dmfx.records()]


# ----------------------------------------------------------------------------------------- NaN / Inf


def _with_timeout(fn, seconds=120):
    """Run fn in a thread; a hang fails the test instead of blocking the suite."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"no result after {seconds}s: hang"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_propagate_like_eager(bad):
    m = Layer()
    ref = copy.deepcopy(m)
    x = torch.randn(4, 6, 32)
    x[0, 2, 5] = bad  # one element of one sequence
    x[1, :, 7] = bad  # one feature of a whole sequence

    def step(model, compiled):
        xi = x.clone().requires_grad_()
        f = torch.compile(model, backend="dmfx", options={"fallback": False}) if compiled else model
        out = f(xi)
        out.sum().backward()
        return out.detach(), xi.grad

    out, gx = _with_timeout(lambda: step(m, True))
    exp, ex = step(ref, False)
    assert torch.equal(out.isnan(), exp.isnan()) and torch.equal(out.isinf(), exp.isinf())
    assert torch.equal(gx.isnan(), ex.isnan()) and torch.equal(gx.isinf(), ex.isinf())
    assert out.isnan().any()  # the test is not vacuous
    finite = exp.isfinite().all(-1).all(-1)  # sequences untouched by the bad values
    assert finite.any() and rel_err(out[finite], exp[finite]) < 1e-5
    assert _fired_any()


# ----------------------------------------------------------------------------------------- float64


def test_float64_runs_in_float64():
    m = Layer().double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    _check_layer(m, x, tol=1e-12)
    fwd = "\n".join(r.forward_graph.code for r in dmfx.records() if r.forward_graph is not None)
    assert "dmfx.bias_dropout_residual_norm" in fwd and "float32" not in fwd and "bfloat16" not in fwd


# ----------------------------------------------------------------------------------------- no kernels for the device


def test_meta_device_warns_once_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(backend, "_warned", set())
    m = Layer().to("meta")
    with caplog.at_level(logging.WARNING, logger="dmfx"):
        out = torch.compile(m, backend="dmfx")(torch.randn(2, 5, 32, device="meta"))
        out2 = torch.compile(ln_residual, backend="dmfx")(*(torch.randn(s, device="meta") for s in ((3, 8), (3, 8), (8,), (8,))))
    assert out.device.type == "meta" and out.shape == (2, 5, 32)
    assert out2.device.type == "meta" and out2.shape == (3, 8)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "dmfx"]
    assert len(warnings) == 1 and "no kernels for device ['meta']" in warnings[0].getMessage()
    assert all("no dmfx kernels for ['meta']" in r.fallback for r in dmfx.records())
    assert len(dmfx.records()) >= 2


# ----------------------------------------------------------------------------------------- kernel cache

# A subprocess that compiles a block with dmfx and checks it against eager; logging NOT configured,
# as in a user's script, so warnings must still reach stderr.
USE = """
import sys, torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.LayerNorm(24))
x = torch.randn(3, 5, 24, requires_grad=True)
out = torch.compile(m, backend="dmfx")(x)
out.sum().backward()
err = ((out - m(x)).norm() / m(x).norm()).item()
import dmfx
rec = dmfx.records()[-1]
print("RESULT", err, "FIRED" if rec.fired else "NOTHING", rec.fallback)
assert err < 1e-5
"""


def _python(code, env, timeout=900):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _copy_warm_build(dst_root):
    """The already-built CPU module copied into another cache root (no cold build)."""
    build.load("cpu")
    name = build.module_name("cpu")
    src = build.cache_root() / name
    dst = dst_root / name
    dst.mkdir(parents=True)
    for f in (f"{name}.so", build.MARKER):
        shutil.copy2(src / f, dst / f)
    assert build._is_valid(dst, name)
    return name, dst


def test_truncated_library_with_stale_marker_is_rebuilt_by_one_of_two_processes(tmp_path):
    """A library cut short after its marker was written (disk full, a copy interrupted): the marker's
    hash no longer matches, so two processes starting at once discard it, one rebuilds (one cold
    build), the other waits and loads; both run the kernels correctly."""
    name, dst = _copy_warm_build(tmp_path)
    lib = dst / f"{name}.so"
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 3])
    assert not build._is_valid(dst, name)
    env = {**os.environ, "DMFX_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    code = textwrap.dedent(USE)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
        assert "RESULT" in out and "FIRED" in out, out + err[-2000:]
    errs = [err for _, err in results]
    assert sum("dmfx: building CPU kernels" in e for e in errs) == 1, errs
    assert sum("discarding incomplete or corrupted kernel build" in e for e in errs) == 1, errs
    assert build._is_valid(dst, name)


def _make_read_only(path):
    """chmod 555; as root that does not stop writes, so also the immutable attribute where possible."""
    os.chmod(path, 0o555)
    if os.access(path, os.W_OK) and os.geteuid() == 0 and shutil.which("chattr"):
        subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    probe = path / "probe"
    try:
        probe.write_text("")
    except OSError:
        return True
    probe.unlink()
    return False


def _undo_read_only(path):
    if shutil.which("chattr"):
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    os.chmod(path, 0o755)


def test_read_only_cache_directory_falls_back_to_a_temp_dir_with_a_visible_warning(tmp_path):
    ro = tmp_path / "readonly_cache"
    ro.mkdir()
    tmp = tmp_path / "tmp"
    fallback = tmp / f"dmfx_extensions_{os.getuid()}"
    _copy_warm_build(fallback)  # the fallback already holds the build: no cold build
    try:
        if not _make_read_only(ro):
            pytest.skip("cannot make a directory read-only here (root without chattr)")
        env = {**os.environ, "DMFX_CACHE_DIR": str(ro), "TMPDIR": str(tmp)}
        r = _python(USE, env)
    finally:
        _undo_read_only(ro)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FIRED" in r.stdout, r.stdout + r.stderr[-2000:]
    assert f"kernel cache {ro} is not writable" in r.stderr and str(fallback) in r.stderr, r.stderr[-3000:]
    assert "building" not in r.stderr
    assert list(ro.iterdir()) == []


def test_no_compiler_on_path_warns_and_runs_eagerly(tmp_path):
    """PATH without c++/g++/ninja, CXX unset, fresh cache: one clear warning, eager results."""
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env.update(PATH=str(empty_bin), DMFX_CACHE_DIR=str(tmp_path / "cache"))
    r = _python(USE, env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NOTHING kernel build failed" in r.stdout, r.stdout
    assert "no C++ compiler ('c++' is not on PATH; install g++ or set CXX)" in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("no C++ compiler") == 1, r.stderr[-3000:]  # one warning, not one per graph
    assert "Traceback" not in r.stderr


def test_no_compiler_but_ninja_on_path(tmp_path):
    """ninja present, no compiler: the check before the build says so (no build started)."""
    ninja = shutil.which("ninja")
    if ninja is None:
        pytest.skip("ninja not installed")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "ninja").symlink_to(ninja)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(bin_), DMFX_CACHE_DIR=str(tmp_path / "cache"))
    r = _python(USE, env, timeout=300)
    assert r.returncode == 0 and "NOTHING kernel build failed" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "no C++ compiler" in r.stderr and "dmfx: building" not in r.stderr
    assert not any((tmp_path / "cache").glob("dmfx_cpu_*/build.ninja"))  # no half-started build left
