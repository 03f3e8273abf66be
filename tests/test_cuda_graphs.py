"""CUDA graphs (option cudagraphs; torch.compile's mode="reduce-overhead", HF's CompileConfig default).

On CUDA, the graphs dmfx compiles go to Inductor's CUDA-graph trees with the state Inductor's own
compile_fx would give them (dmfx/inductor.py CudaGraphs); a graph whose dmfx ops read a host value at
each call (a dropout seed) is not captured. The CPU tests check the decisions and the plumbing (forced
onto a CPU graph, which Inductor then declines); the CUDA tests, skipped without a GPU, check capture
and replay against eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx import Graph, GraphModule

import dmfx
from dmfx import backend
from dmfx.inductor import CudaGraphs, capture_blocker, dynamo_static_inputs
from tests.conftest import rel_err

aten = torch.ops.aten
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


class Block(torch.nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.norm(self.drop(self.lin(x)) + x)


def test_reduce_overhead_sets_the_option_and_a_cpu_graph_says_it_is_not_captured():
    from dmfx.backend import _apply_mode

    assert _apply_mode(dmfx.Options.from_user({}), "reduce-overhead").cudagraphs
    assert not _apply_mode(dmfx.Options.from_user({}), "max-autotune").cudagraphs
    m = Block(p=0.1).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        out = torch.compile(m, backend="dmfx", mode="reduce-overhead")(x)
    assert rel_err(out, m(x)) < 1e-5
    rec = dmfx.records()[-1]
    assert rec.cudagraphs.startswith("not applied: no CUDA tensors"), rec.cudagraphs
    assert "CUDA graphs: not applied" in rec.summary()


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="option 'cudagraphs' must be True or False"):
        dmfx.Options.from_user({"cudagraphs": "yes"})


def _graph(seed_device: str | None, out_device: str, with_meta: bool) -> GraphModule:
    """x -> dmfx::dropout(x, seed, 0.5): the seed a randint on `seed_device` (None: no seed, p = 0)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = Graph()
    x = g.placeholder("x")
    seed = None
    if seed_device is not None:
        seed = g.call_function(aten.randint.low, (0, 2**62, [2]),
                               {"dtype": torch.int64, "device": torch.device(seed_device)})
    y = g.call_function(torch.ops.dmfx.dropout.default, (x, seed, 0.5 if seed is not None else 0.0))
    g.output(y)
    if with_meta:
        with FakeTensorMode():
            x.meta["val"] = y.meta["val"] = torch.empty(4, device=out_device)
            if seed is not None:
                seed.meta["val"] = torch.empty(2, dtype=torch.int64, device=seed_device)
    return GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("with_meta", [True, False], ids=["metadata", "read-back-from-the-cache"])
def test_a_dropout_seed_drawn_on_the_host_blocks_capture(with_meta):
    why = capture_blocker(_graph("cpu", "cuda", with_meta))
    assert why is not None and "dmfx::dropout reads randint_low on the host" in why and "dropout mask" in why
    assert capture_blocker(_graph(None, "cuda", with_meta)) is None  # (no dropout: nothing read on the host)


def test_option_unpad_blocks_capture():
    g = Graph()
    mask = g.placeholder("mask")
    g.output(g.call_function(torch.ops.dmfx.unpad_index.default, (mask,)))
    assert "option unpad" in capture_blocker(GraphModule(torch.nn.Module(), g))


def test_dynamo_marks_parameters_and_static_addresses_as_static():
    seen = []

    def spy(gm, example_inputs):
        seen.append(dynamo_static_inputs(gm))
        return gm.forward

    m = Block()
    x, cache = torch.randn(4, 32), torch.zeros(4, 32)
    torch._dynamo.reset()
    torch.compile(m, backend=spy)(x)
    torch._dynamo.mark_static_address(cache)
    torch.compile(lambda a, c: m(a) + c, backend=spy)(x, cache)
    (params_only, with_cache) = seen
    assert len(params_only) == 4  # (the Linear's and the LayerNorm's weight and bias; x is not)
    assert len(with_cache) == 5


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_the_capture_path_forced_onto_a_cpu_graph(monkeypatch, training):
    """Inductor gets the state compile_fx would give it (cudagraphs on, the parameters as static inputs,
    the forward's device box); it declines a CPU graph, and the record says so. The answers are eager's
    and nothing is cached."""
    import torch._inductor.compile_fx as compile_fx

    calls = []
    inner = compile_fx.compile_fx_inner

    def spy(*args, **kwargs):
        from torch._inductor import config

        calls.append({"static": list(kwargs["static_input_idxs"]), "flag": config.triton.cudagraphs,
                      "backward": kwargs.get("is_backward", False)})
        return inner(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    monkeypatch.setattr(backend, "_cudagraphs_why_not", lambda opts, devices: None)
    m = Block().train(training)
    ref = copy.deepcopy(m)
    x = torch.randn(4, 32, requires_grad=training)
    torch._dynamo.reset()
    c = torch.compile(m, backend=dmfx.with_options(compiler="inductor", fuse="all", fallback=False), mode="reduce-overhead")
    with torch.set_grad_enabled(training):
        out, want = c(x), ref(x)
    assert rel_err(out, want) < 1e-5
    if training:
        R = torch.randn_like(want)
        (out * R).sum().backward()
        g = {n: p.grad for n, p in m.named_parameters()}
        (want * R).sum().backward()
        for n, p in ref.named_parameters():
            assert rel_err(g[n], p.grad, p.grad.abs().max()) < 1e-5, n
    rec = dmfx.records()[-1]
    assert rec.cudagraphs == "not applied: Inductor declined the graph (TORCH_LOGS=perf_hints says why)"
    assert rec.cache == ""  # (a captured graph is not cached)
    first = calls[0]
    assert first["flag"] and not first["backward"]
    assert len(first["static"]) == 4 and first["static"] == sorted(first["static"])  # the parameters, not x


def test_the_static_inputs_of_each_kind_of_graph():
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.utils import BoxedBool

    cg = CudaGraphs(BoxedBool(True), BoxedDeviceIndex(None), static_inputs=(0, 2), lifted=1, inputs=3)
    fw = torch.fx.symbolic_trace(lambda a, b, c, d: a + b + c + d)
    assert cg.static_input_idxs("forward", fw, fw, [0] * 4) == [0, 1, 3]
    assert cg.static_input_idxs("forward", fw, fw, [0] * 3) == []  # (the traced inputs do not line up)
    g = Graph()
    saved, tangent = g.placeholder("getitem"), g.placeholder("tangents_1")
    g.output(g.call_function(aten.mul.Tensor, (saved, tangent)))
    bw = GraphModule(torch.nn.Module(), g)
    assert cg.static_input_idxs("backward", bw, bw, [0, 0]) == [0]  # (the saved activation, not the tangent)
    cg.forward_partitioned = True
    assert cg.static_input_idxs("backward", bw, bw, [0, 0]) == []


# ------------------------------------------------------------------------------------------ CUDA


def _bert(dropout: float):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).cuda()


@needs_cuda
def test_cuda_inference_is_captured_and_replays_eagers_answers():
    from torch._dynamo.utils import counters

    model = _bert(0.0).eval()
    counters.clear()
    c = torch.compile(model, backend=dmfx.with_options(compiler="inductor", fuse="all", fallback=False), mode="reduce-overhead")
    with torch.no_grad():
        for step in range(4):  # (recorded at the second call, replayed after)
            ids = torch.randint(0, 128, (2, 16), device="cuda")
            got = c(input_ids=ids).logits.clone()
            assert rel_err(got, model(input_ids=ids).logits) < 1e-4, step
    rec = dmfx.records()[-1]
    assert rec.cudagraphs == "captured", rec.summary()
    assert counters["inductor"]["cudagraph_skips"] == 0


@needs_cuda
def test_cuda_training_without_dropout_is_captured_with_eagers_gradients():
    model = _bert(0.0).train()
    ref = copy.deepcopy(model)
    c = torch.compile(model, backend=dmfx.with_options(compiler="inductor", fuse="all", fallback=False), mode="reduce-overhead")
    for step in range(3):
        ids = torch.randint(0, 128, (2, 16), device="cuda")
        out = c(input_ids=ids, labels=ids)
        want = ref(input_ids=ids, labels=ids)
        R = torch.randn_like(want.logits)
        (out.loss + (out.logits * R).sum()).backward()
        (want.loss + (want.logits * R).sum()).backward()
        scale = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is not None:
                assert (p.grad - q.grad).abs().max().item() / scale < 1e-3, (step, n)  # (relative to the largest)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert dmfx.records()[-1].cudagraphs == "captured", dmfx.records()[-1].summary()


@needs_cuda
def test_cuda_training_with_dropout_is_not_captured_and_draws_fresh_masks():
    model = _bert(0.3).train()
    c = torch.compile(model, backend=dmfx.with_options(compiler="inductor", fuse="all", fallback=False), mode="reduce-overhead")
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    a, b = c(input_ids=ids).logits.detach().clone(), c(input_ids=ids).logits.detach().clone()
    assert not torch.equal(a, b)
    rec = dmfx.records()[-1]
    assert rec.cudagraphs.startswith("not applied:") and "dropout seed" in rec.cudagraphs, rec.summary()


@needs_cuda
def test_cuda_static_cache_generate_with_hfs_default_compile_config():
    """HF's compiled decoding as documented, with CompileConfig's default mode ("reduce-overhead"):
    the tokens are eager's, and the decode step is captured."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).cuda().eval()
    prompt = torch.randint(0, 256, (2, 7), device="cuda")

    def generate(**kwargs):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                              cache_implementation="static", **kwargs)

    want = generate()
    got = generate(compile_config=transformers.CompileConfig(backend=dmfx.with_options(compiler="inductor", fuse="all", fallback=False)))
    assert torch.equal(got, want)
    assert any(r.cudagraphs == "captured" for r in dmfx.records()), [r.summary() for r in dmfx.records()]
