"""The kernels' self-check (cuda_ops/selfcheck.py): the real kernels pass it on both CPU builds; a
planted wrong kernel (a wrapper whose function perturbs its results, or CUDA source with an injected
bug run through tests/cuda_emu) switches its family off and only its family, with one warning naming
it; a compiled model then runs without that family's passes and matches eager; the verdict is cached
next to the build marker, and a corrupt cache is redone."""

from __future__ import annotations

import copy
import inspect
import json
import shutil
import sys
import types

import pytest
import torch
from conftest import compiled_step_matches_eager, tiny_bert_layer

import dmfx
from dmfx.cuda_ops import build, selfcheck
from dmfx.passes import ALL_PASSES

FAMILIES = build.FAMILIES


def _scaled(t, factor=1.05):
    return t * factor if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _scale_results(result, args):
    return type(result)(_scaled(t) for t in result) if isinstance(result, (list, tuple)) else _scaled(result)


def _scale_out_arg(result, args):
    args[9].mul_(1.05)  # flash_fwd(q, k, v, mask, scale, causal, seed, offset, p, out): out written in place
    return result


# family -> (function, how it is made wrong): functions a BERT layer's compiled step calls, each off by 5%
PLANTS = {
    "norm": ("norm_bwd", _scale_results),
    "softmax": ("softmax_bwd", _scale_results),
    "pointwise": ("bias_act_bwd", _scale_results),
    "attention": ("flash_fwd", _scale_out_arg),
    "cross_entropy": ("cross_entropy_bwd", _scale_results),
}

# family -> the ops whose results a planted kernel gets wrong when a compiled model runs them: the ops'
# kernels are registered in C++, so the stand-in module (what the self-check sees) is not what they
# call; a Python kernel at their AutogradCPU key (above the C++ ones) perturbs their results instead
# (softmax: also the GEMM-form attention backwards, whose C++ kernels call the softmax backward below
# autograd, where such a kernel does not run; cross_entropy: also linear_cross_entropy's backward, a
# composite that calls the family's ops below autograd too)
PLANTED_OPS = {
    "norm": ("norm_backward",),
    "softmax": ("attention_softmax_backward", "attention_backward", "qkv_attention_backward"),
    "pointwise": ("bias_act_dropout_backward",),
    "attention": ("flash_attention", "qkv_flash_attention"),
    "cross_entropy": ("cross_entropy_backward", "linear_cross_entropy_backward"),
}

# the dmfx ops that run each family's kernels (softmax: the GEMM form's, and the flash ops' unfused path)
FLASH_OPS = {"flash_attention", "flash_attention_backward", "qkv_flash_attention", "qkv_flash_attention_backward"}
VARLEN_OPS = {"varlen_attention", "varlen_attention_backward", "qkv_varlen_attention", "qkv_varlen_attention_backward"}
FAMILY_OPS = {
    "norm": {"layer_norm", "rms_norm", "bias_dropout_residual_norm", "norm_backward", "dropout"},
    "softmax": {"attention_softmax", "attention_softmax_backward", "attention", "attention_backward", "qkv_attention",
                "qkv_attention_backward", *FLASH_OPS},
    "pointwise": {"bias_act_dropout", "bias_act_dropout_backward", "glu", "glu_backward", "rope", "softcap",
                  "softcap_backward"},
    "attention": FLASH_OPS | VARLEN_OPS,
    "cross_entropy": {"cross_entropy", "cross_entropy_backward", "linear_cross_entropy", "linear_cross_entropy_backward"},
}


def stand_in(module, name: str, **replaced):
    """A module named `name` with `module`'s functions, some `replaced`."""
    fake = types.ModuleType(name)
    for f in dir(module):
        if not f.startswith("_"):
            setattr(fake, f, replaced.get(f, getattr(module, f)))
    return fake


def planted(module, family: str):
    """A stand-in for `module` whose PLANTS[family] function returns wrong results."""
    name, wrong = PLANTS[family]
    real = getattr(module, name)
    return stand_in(module, f"{module.__name__}_planted_{family}", **{name: lambda *args: wrong(real(*args), args)})


@pytest.fixture
def fresh_verdicts():
    selfcheck.forget()
    yield
    selfcheck.forget()


def _planted_ops(family: str) -> torch.library.Library:
    """PLANTED_OPS[family] with their results off by 5% (until the library returned is destroyed)."""
    lib = torch.library.Library("dmfx", "IMPL")  # noqa: TOR901

    def perturb(op):
        overload = getattr(torch.ops.dmfx, op).default

        def wrong(keyset, *args):
            return _scale_results(overload.redispatch(keyset & torch._C._after_autograd_keyset, *args), args)

        return wrong

    for op in PLANTED_OPS[family]:
        lib.impl(op, perturb(op), "AutogradCPU", with_keyset=True)
    return lib


@pytest.fixture
def planted_cpu(monkeypatch, fresh_verdicts, request):
    """kernels_for("cpu") returns the native module with `request.param`'s family planted wrong, and
    the family's ops give wrong results."""
    family = request.param
    monkeypatch.setitem(build._loaded, "cpu", planted(build.load("cpu"), family))
    lib = _planted_ops(family)
    yield family
    lib._destroy()


def _dmfx_ops(gm) -> set[str]:
    return {n.target._overloadpacket.__name__ for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "dmfx"}


# ----------------------------------------------------------------------------------------- verdicts


@pytest.mark.usefixtures("cpu_build")
def test_the_real_kernels_pass_and_leave_the_random_state_alone():
    state = torch.get_rng_state()
    assert selfcheck.check_module(build.kernels_for("cpu"), "cpu", "cpu") == dict.fromkeys(FAMILIES)
    assert torch.equal(torch.get_rng_state(), state)  # (torch.manual_seed still reproduces a run)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_planted_wrong_kernel_switches_off_its_family_only(family):
    verdict = selfcheck.check_module(planted(build.load("cpu"), family), "cpu", "cpu")
    assert {f for f, why in verdict.items() if why} == {family}
    assert PLANTS[family][0] in verdict[family] and "relative error" in verdict[family]


@pytest.mark.parametrize("planted_cpu", ["softmax"], indirect=True)
def test_one_warning_per_family_and_device(planted_cpu, caplog):
    with caplog.at_level("WARNING", logger="dmfx"):
        assert selfcheck.disabled_families("cpu") == {"softmax"}
        assert selfcheck.disabled_families(torch.device("cpu")) == {"softmax"}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    text = warnings[0]
    assert "softmax kernels" in text and "the CPU" in text and "softmax_bwd" in text and "float32" in text
    assert "max abs error" in text and "patterns to PyTorch" in text
    assert selfcheck.passes_to_skip(["cpu"]) == set(selfcheck.FAMILY_PASSES["softmax"])


def test_a_wrong_varlen_kernel_switches_off_the_attention_family():
    """The attention family's check covers the varlen kernels: a backward whose dq is off by 5%
    switches the family off (and only it)."""
    real = build.load("cpu").varlen_bwd

    def wrong(*args):
        real(*args)
        args[12].mul_(1.05)  # varlen_bwd(grad_out, q, k, v, out, stats, cu_seqlens, scale, causal, seed, offset, p, dq, dk, dv)

    verdict = selfcheck.check_module(stand_in(build.load("cpu"), "varlen_planted", varlen_bwd=wrong), "cpu", "cpu")
    assert {f for f, why in verdict.items() if why} == {"attention"}
    assert "varlen_bwd" in verdict["attention"] and "relative error" in verdict["attention"]


def test_a_kernel_that_raises_is_switched_off():
    def boom(*args):
        raise RuntimeError("an illegal memory access was encountered")

    verdict = selfcheck.check_module(stand_in(build.load("cpu"), "raises", glu_fwd=boom), "cpu", "cpu")
    assert "illegal memory access" in verdict["pointwise"]
    assert verdict["norm"] is None and verdict["attention"] is None


def test_a_check_that_cannot_run_switches_every_family_off(monkeypatch, fresh_verdicts, caplog):
    def broken(*args):
        raise OSError("no space left on device")

    monkeypatch.setitem(build._loaded, "cpu", stand_in(build.load("cpu"), "dmfx_cpu_uncached"))  # (no disk verdict)
    monkeypatch.setattr(selfcheck, "check_module", broken)
    with caplog.at_level("WARNING", logger="dmfx"):
        assert selfcheck.disabled_families("cpu") == set(FAMILIES)
    assert "could not run (OSError: no space left on device)" in caplog.text


def test_family_passes_name_real_passes():
    assert set(selfcheck.FAMILY_PASSES) == set(FAMILIES)
    for passes in selfcheck.FAMILY_PASSES.values():
        assert set(passes) <= set(ALL_PASSES)


def test_disabled_by_the_environment(monkeypatch, fresh_verdicts):
    monkeypatch.setitem(build._loaded, "cpu", planted(build.load("cpu"), "norm"))
    monkeypatch.setenv("DMFX_SELFCHECK", "0")
    assert selfcheck.disabled_families("cpu") == set() and selfcheck.passes_to_skip(["cpu"]) == set()
    monkeypatch.setenv("DMFX_SELFCHECK", "1")
    assert selfcheck.disabled_families("cpu") == {"norm"}


def test_devices_without_kernels_add_nothing(fresh_verdicts):
    assert selfcheck.passes_to_skip(["meta"]) == set()


# ----------------------------------------------------------------------------------------- the cache


@pytest.fixture
def built_cpu(tmp_path, monkeypatch, fresh_verdicts):
    """kernels_for("cpu") returns a stand-in for the native module that lives in a build directory of
    its own under tmp_path (its library path and build marker there): where its verdict is cached."""
    build_dir = tmp_path / "dmfx_cpu_standin"
    build_dir.mkdir()
    (build_dir / build.MARKER).write_text("{}")
    module = stand_in(build.load("cpu"), build_dir.name)
    module.__file__ = str(build_dir / f"{build_dir.name}.so")
    monkeypatch.setitem(build._loaded, "cpu", module)
    return build_dir / selfcheck.VERDICT_FILE


def _off_in_a_new_process() -> set[str]:
    selfcheck.forget()  # (what a new process holds: the disk cache only)
    return selfcheck.disabled_families("cpu")


def test_the_verdict_is_cached_next_to_the_build_marker(built_cpu, monkeypatch):
    assert _off_in_a_new_process() == set()
    data = json.loads(built_cpu.read_text())
    (key, entry), = data.items()
    assert key == selfcheck.device_key(torch.device("cpu")) and key.startswith("cpu|")
    assert entry["families"] == dict.fromkeys(FAMILIES) and entry["seconds"] >= 0
    # a cached verdict is used as it is, without a check: one saying "off" switches the family off
    entry["families"]["pointwise"] = "planted in the cache"
    built_cpu.write_text(json.dumps(data))
    with monkeypatch.context() as m:
        m.setattr(selfcheck, "check_module", None)  # (a check would raise)
        assert _off_in_a_new_process() == {"pointwise"}


def test_the_verdict_is_known_without_loading_the_kernels_once_stored(built_cpu, monkeypatch):
    """known_passes_to_skip (what the backend asks first) reads a verdict stored next to the build
    marker without loading the module; with no verdict stored, or no build, it does not know (None)."""
    root = built_cpu.parent.parent
    monkeypatch.setattr(build, "cache_root", lambda: root)
    monkeypatch.setattr(build, "module_name", lambda flavor: built_cpu.parent.name)
    assert selfcheck.known_passes_to_skip(["cpu"]) == set()  # (loaded in this process: its verdict)
    monkeypatch.delitem(build._loaded, "cpu")  # (a new process, the module built on disk)
    assert selfcheck.known_passes_to_skip(["cpu"]) is not None  # (the check above stored its verdict)
    data = json.loads(built_cpu.read_text())
    next(iter(data.values()))["families"]["norm"] = "planted in the cache"
    built_cpu.write_text(json.dumps(data))
    assert selfcheck.known_passes_to_skip(["cpu"]) == set(selfcheck.FAMILY_PASSES["norm"])
    built_cpu.unlink()
    assert selfcheck.known_passes_to_skip(["cpu"]) is None
    assert selfcheck.known_passes_to_skip(["meta"]) == set()


@pytest.mark.parametrize("damage", ["corrupt", "other checks", "another device"])
def test_a_corrupt_or_stale_verdict_is_redone(built_cpu, damage):
    _off_in_a_new_process()
    data = json.loads(built_cpu.read_text())
    key = next(iter(data))
    if damage == "corrupt":
        built_cpu.write_text('{"cpu|')
    elif damage == "other checks":
        data[key].update(check="older checks", families={**data[key]["families"], "norm": "stale"})
        built_cpu.write_text(json.dumps(data))
    else:  # another machine's verdict is kept next to this one's
        built_cpu.write_text(json.dumps({"cpu|elsewhere": {**data[key], "families": {f: "no" for f in FAMILIES}}}))
    assert _off_in_a_new_process() == set()
    redone = json.loads(built_cpu.read_text())
    assert redone[key]["families"] == dict.fromkeys(FAMILIES)
    assert ("cpu|elsewhere" in redone) == (damage == "another device")


# ----------------------------------------------------------------------------------------- end to end


class _LossHead(torch.nn.Module):
    """A LayerNorm and a classifier head whose per-token cross-entropy loss (reduction none) is added to
    its input: a step through it runs the cross_entropy family's kernels (a BERT layer runs none: here
    through linear_cross_entropy, the logits being read by the loss alone), and the norm family's."""

    def __init__(self, H=32, V=40, shape=(2, 9)):
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.proj = torch.nn.Linear(H, V)
        self.register_buffer("target", torch.randint(0, V, shape))

    def forward(self, x):
        logits = self.proj(self.norm(x))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), self.target.view(-1), reduction="none")
        return (x + loss.view(*x.shape[:-1], 1),)


def _model(family: str):
    """(model, its eager copy) whose compiled step runs `family`'s kernels."""
    if family != "cross_entropy":
        return tiny_bert_layer()
    head = _LossHead()
    ref = _LossHead()
    ref.load_state_dict(head.state_dict())
    return head, ref


def _compile_options(family: str) -> dict:
    # the GEMM form runs the softmax kernels, the fused form the attention kernels
    return {"fallback": False, "attention": "gemm" if family == "softmax" else "flash"}


@pytest.mark.parametrize("planted_cpu", FAMILIES, indirect=True)
def test_a_compiled_model_runs_without_the_family_switched_off(planted_cpu, monkeypatch):
    family = planted_cpu
    skip = selfcheck.passes_to_skip(["cpu"])
    assert skip == set(selfcheck.FAMILY_PASSES[family])
    layer, ref = _model(family)
    compiled_step_matches_eager(layer, ref, {**_compile_options(family), "skip": sorted(skip)})
    record = dmfx.records()[-1]
    used = _dmfx_ops(record.forward_graph) | _dmfx_ops(record.backward_graph)
    assert used and not used & FAMILY_OPS[family], used
    # (the planted kernel is wrong where it runs: the same step with the family's passes, the check
    # off, is not eager's)
    torch._dynamo.reset()
    monkeypatch.setenv("DMFX_SELFCHECK", "0")
    layer, ref = _model(family)
    with pytest.raises(AssertionError):
        compiled_step_matches_eager(layer, ref, _compile_options(family))


def _backend_consults_the_selfcheck() -> bool:
    import dmfx.backend

    return "passes_to_skip" in inspect.getsource(dmfx.backend)


@pytest.mark.parametrize("planted_cpu", ["norm", "attention"], indirect=True)
def test_the_backend_skips_the_passes_of_a_family_switched_off(planted_cpu):
    if not _backend_consults_the_selfcheck():
        pytest.skip("dmfx/backend.py does not call selfcheck.passes_to_skip yet")
    layer, ref = tiny_bert_layer()
    compiled_step_matches_eager(layer, ref, _compile_options(planted_cpu))
    record = dmfx.records()[-1]
    assert not (_dmfx_ops(record.forward_graph) | _dmfx_ops(record.backward_graph)) & FAMILY_OPS[planted_cpu]


class _QuickGeluMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        h = self.fc1(x)
        return (self.fc2(h * torch.sigmoid(1.702 * h)),)  # CLIP's QuickGELU: dmfx has no ATen op to leave it as


@pytest.mark.parametrize("planted_cpu", ["pointwise"], indirect=True)
def test_an_idiom_the_pointwise_family_computes_is_left_when_it_is_off(planted_cpu):
    """activation_idioms emits a pointwise op itself (QuickGELU, the squared ReLU): with that family
    switched off it is skipped too, and the step is eager's."""
    layer = _QuickGeluMlp()
    ref = copy.deepcopy(layer)
    compiled_step_matches_eager(layer, ref, {"fuse": "all", "fallback": False})
    record = dmfx.records()[-1]
    assert not (_dmfx_ops(record.forward_graph) | _dmfx_ops(record.backward_graph)) & FAMILY_OPS["pointwise"]
    assert "quick_gelu_idiom" not in record.fired, record.summary()
    assert any("activation_idioms" in m for m in record.missed if m.startswith("kernel self-check")), record.missed


LEFT_TO_INDUCTOR = """
import torch, dmfx
from dmfx.cuda_ops import build
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU())
x = torch.randn(4, 16, requires_grad=True)
out = torch.compile(m, backend="dmfx", options={"compiler": "inductor"})(x)
out.sum().backward()
assert torch.allclose(out, m(x), atol=1e-5)
print("SUMMARY", dmfx.records()[-1].summary())
print("LOADED", sorted(build._loaded))
"""


def test_a_graph_left_to_inductor_builds_no_kernels(tmp_path):
    """On a new machine (an empty kernel cache), a CPU graph dmfx leaves to Inductor whole (no
    dropout) compiles without building dmfx's kernels for their self-check: nothing of theirs runs."""
    import os
    import subprocess

    env = {**os.environ, "DMFX_CACHE_DIR": str(tmp_path / "dmfx"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    p = subprocess.run([sys.executable, "-c", LEFT_TO_INDUCTOR], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "left to Inductor" in p.stdout and "LOADED []" in p.stdout, p.stdout
    assert "building" not in p.stderr and not list((tmp_path / "dmfx").glob("dmfx_cpu*")), p.stderr[-2000:]


def test_a_graph_rewritten_after_all_runs_the_self_check_first(monkeypatch):
    """Where the self-check's verdict is not known without building the kernels (a new machine), the
    backend defers it for a graph it may leave to Inductor whole; one it rewrites after all is compiled
    again with the check done first (its passes skip what the check switched off), one record each."""
    import dmfx.inductor

    calls = []
    real = selfcheck.passes_to_skip
    monkeypatch.setattr(selfcheck, "known_passes_to_skip", lambda devices: None)
    monkeypatch.setattr(selfcheck, "passes_to_skip", lambda devices: calls.append(1) or real(devices))
    layer, ref = tiny_bert_layer()  # (no dropout: left to Inductor whole)
    torch._dynamo.reset()
    dmfx.reset()
    compiled_step_matches_eager(layer, ref, {"compiler": "inductor"})
    assert calls == [] and "left to Inductor" in dmfx.records()[-1].summary()

    monkeypatch.setattr(dmfx.inductor, "auto_decision", lambda *a: (None, None))  # (rewritten after all)
    torch._dynamo.reset()
    dmfx.reset()
    layer, ref = tiny_bert_layer()
    compiled_step_matches_eager(layer, ref, {"compiler": "inductor", "cache": False})  # (not the decision kept above)
    (record,) = dmfx.records()
    assert calls == [1] and not record.fallback and record.fired, record.summary()


def test_a_family_the_deferred_check_switches_off_recompiles_the_graph_without_its_passes(monkeypatch):
    """Where the deferred check (run once a graph is to be rewritten) switches a family off, the graph
    is compiled again under options that skip that family's passes (one record), and its step is
    eager's; where it switches none off, the compile just goes on (the test above)."""
    import dmfx.inductor

    skip = set(selfcheck.FAMILY_PASSES["pointwise"])
    calls = []
    monkeypatch.setattr(selfcheck, "known_passes_to_skip", lambda devices: None)
    monkeypatch.setattr(selfcheck, "passes_to_skip", lambda devices: calls.append(1) or set(skip))
    monkeypatch.setattr(dmfx.inductor, "auto_decision", lambda *a: (None, None))
    torch._dynamo.reset()
    dmfx.reset()
    layer, ref = tiny_bert_layer()
    compiled_step_matches_eager(layer, ref, {"compiler": "inductor", "cache": False})
    (record,) = dmfx.records()
    assert calls == [1, 1] and record.fired and not set(record.fired) & skip, record.summary()
    assert any(m.startswith("kernel self-check") for m in record.missed), record.missed


# ----------------------------------------------------------------------------------------- CUDA emulation

# A realistic CUDA bug: the softmax backward's warp reduction stops at 16 lanes (xor 8, 4, 2, 1), so
# each half-warp subtracts its own partial sum.
EMU_BUG = ("softmax_cuda.cu", "    dot = sm_warp_sum(dot);",
           "    for (int m = 8; m > 0; m >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CUDA emulation needs Linux")
def test_the_emulated_cuda_kernels_pass_and_a_planted_bug_is_caught(tmp_path):
    from cuda_emu import CSRC, load

    clean = {family: selfcheck.check_module(load(family), "cuda", "cpu") for family in FAMILIES}
    assert clean == {family: {family: None} for family in FAMILIES}
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    file, line, bug = EMU_BUG
    text = (csrc / file).read_text()
    assert text.count(line) == 1, f"the planted bug's line moved in {file}; update EMU_BUG"
    (csrc / file).write_text(text.replace(line, bug))
    verdict = selfcheck.check_module(load("softmax", csrc=csrc), "cuda", "cpu")
    assert "softmax_bwd" in verdict["softmax"], verdict
