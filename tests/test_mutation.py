"""Graphs that write their inputs or return views of them (dmfx/functionalize.py): lowered to a
functional body the passes rewrite, with the writes and the aliased outputs in an epilogue.

Each case runs twice: with every pass skipped (only the lowering and the epilogue: bit for bit what
the same graph gives op by op) and with dmfx's fusions, which must fire in the body (outputs then
within the fused kernels' rounding; what no fused op computes, bit for bit). "Bit for bit" holds
where the graphs run op by op (compiler "fx", the suite's default); under DMFX_COMPILER=inductor,
Inductor's generated kernels round differently (contracted multiply-adds, other reduction orders),
and those comparisons take a tolerance (exact)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import dmfx
from dmfx.functionalize import reinplace_input_writes
from dmfx.passes import ALL_PASSES
from tests.conftest import compilers_raising, rel_err

NO_FUSIONS = {"skip": list(ALL_PASSES)}


def exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit where the rewritten graphs run op by op (compiler "fx"); within 1e-6 of each other
    where Inductor compiles them (its kernels round differently from ATen's). Integer tensors: equal."""
    if dmfx.Options.from_user({}).compiler == "fx" or not a.is_floating_point():
        return torch.equal(a, b)
    return a.shape == b.shape and rel_err(a, b) < 1e-6


def _options(fused: bool) -> dict:
    """The backend's options: fallback off, and with `fused` False every pass skipped."""
    return {"fallback": False, **({} if fused else NO_FUSIONS)}
aten = torch.ops.aten


def _record() -> dmfx.GraphRecord:
    (record,) = dmfx.records()
    assert record.fallback is None, record.fallback
    return record


def _input_writes(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(op, input) for each node of `gm` that writes one of its inputs (an argument its schema marks
    written, bound to a placeholder)."""
    found = []
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if schema is None:
            continue
        for arg, a in zip(schema.arguments, n.args):
            if arg.alias_info is not None and arg.alias_info.is_write and getattr(a, "op", None) == "placeholder":
                found.append((str(n.target), a.name))
    return found


def _only_epilogue_writes(record: dmfx.GraphRecord, allowed: tuple[str, ...] = ("aten.copy_.default",)) -> None:
    """No fused op writes an input: the graphs' only writes into inputs are the epilogue's."""
    for gm in (record.inference_graph, record.forward_graph):
        if gm is not None:
            writes = _input_writes(gm)
            assert writes and all(op in allowed for op, _ in writes), writes


class RunningStats(torch.nn.Module):
    """A running mean kept in a buffer (the way BatchNorm keeps its statistics) and a step count,
    then a LayerNorm of the input centred by the updated mean."""

    def __init__(self, n: int = 48, momentum: float = 0.1):
        super().__init__()
        self.norm = torch.nn.LayerNorm(n)
        self.momentum = momentum
        self.register_buffer("mean", torch.randn(n))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        # (not add_(..., alpha=m): torch 2.11's trace splits it into mul and add, eager's kernel does not
        # round in between, and the last bit differs from eager with any AOTAutograd backend)
        self.mean.mul_(1 - self.momentum).add_(x.detach().mean(0) * self.momentum)
        self.steps.add_(1)
        return self.norm(x - self.mean)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("fused", [False, True], ids=["lowering-only", "fused"])
def test_a_module_that_updates_its_buffers(training, fused):
    with torch.no_grad():
        for p in (ref := RunningStats()).parameters():
            p.normal_()  # (a LayerNorm's default weight and bias would hide a mistake)
    mine = copy.deepcopy(ref)
    compiled = torch.compile(mine, backend="dmfx", options=_options(fused))
    for _ in range(2):  # the second call reads the buffers the first one wrote
        x = torch.randn(16, 48, requires_grad=training)
        cot = torch.randn(16, 48)
        with torch.set_grad_enabled(training):
            want, got = ref(x), compiled(x)
        assert exact(mine.mean, ref.mean) and exact(mine.steps, ref.steps)  # no fused op computes them
        if fused:
            assert rel_err(got, want) < 1e-5
        else:
            assert exact(got, want)
        if training:
            (gx,) = torch.autograd.grad((want * cot).sum(), x)
            (mx,) = torch.autograd.grad((got * cot).sum(), x)
            assert rel_err(mx, gx) < 1e-5
    assert int(mine.steps) == 2
    record = _record()  # one graph: no recompile for the second call
    assert record.training == training
    assert any("l_self_buffers_mean_" in line for line in record.epilogue), record.epilogue
    assert any("l_self_buffers_steps_" in line for line in record.epilogue), record.epilogue
    if fused:
        assert record.fired.get("layer_norm") == 1, record.fired
    _only_epilogue_writes(record, ("aten.copy_.default", "aten.mul_.Tensor", "aten.add_.Tensor"))


class NormNet(torch.nn.Module):
    """BatchNorm (running statistics updated in training), a Linear and a residual LayerNorm."""

    def __init__(self, n: int = 32):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(n)
        self.lin = torch.nn.Linear(n, n)
        self.ln = torch.nn.LayerNorm(n)

    def forward(self, x):
        return self.ln(self.lin(self.bn(x)) + x)


def test_batch_norm_running_statistics_in_training():
    ref = NormNet().train()
    mine = copy.deepcopy(ref)
    compiled = torch.compile(mine, backend="dmfx", options={"fallback": False})
    for _ in range(2):
        x = torch.randn(24, 32) * 3 + 1
        cot = torch.randn(24, 32)
        want, got = ref(x), compiled(x)
        (want * cot).sum().backward()
        (got * cot).sum().backward()
        assert rel_err(got, want) < 1e-5
        for name in ("running_mean", "running_var", "num_batches_tracked"):  # ATen's batch norm computes them
            assert exact(getattr(mine.bn, name), getattr(ref.bn, name)), name
    grads = {n: p.grad for n, p in ref.named_parameters()}
    largest = max(g.abs().max() for g in grads.values())
    for n, p in mine.named_parameters():
        assert ((p.grad - grads[n]).abs().max() / largest).item() < 1e-5, n
    record = _record()
    assert record.fired.get("bias_dropout_residual_norm") == 1, record.fired
    assert len(record.epilogue) == 3, record.epilogue


def write_norm(x, w, out, row):
    """copy_ of a LayerNorm's output into the input `out`, a broadcasting copy_ of `w` into `row`."""
    out.copy_(F.layer_norm(x, (x.shape[-1],), w))
    row.copy_(w)
    return out * 2


@pytest.mark.parametrize("fused", [False, True], ids=["lowering-only", "fused"])
def test_copy_into_an_input(fused):
    x, w = torch.randn(8, 40), torch.randn(40)
    out, row = torch.randn(8, 40), torch.randn(4, 40)
    ref_out, ref_row = out.clone(), row.clone()
    want = write_norm(x, w, ref_out, ref_row)
    got = torch.compile(write_norm, backend="dmfx", options=_options(fused))(x, w, out, row)
    assert exact(row, ref_row)
    if fused:
        assert rel_err(out, ref_out) < 1e-6 and rel_err(got, want) < 1e-6
        assert _record().fired.get("layer_norm") == 1
    else:
        assert exact(out, ref_out) and exact(got, want)
    _only_epilogue_writes(_record())


def views(x, cache, pos, src):
    """Outputs that alias inputs: views of an input, a view of an input the graph writes, the written
    input itself; and one that does not."""
    cache.index_copy_(0, pos, F.layer_norm(src, (src.shape[-1],)))
    return x.t(), x[1:], cache[:2], cache, F.layer_norm(x, (x.shape[-1],))


@pytest.mark.parametrize("fused", [False, True], ids=["lowering-only", "fused"])
def test_outputs_that_alias_inputs_are_views_of_them(fused):
    x, src = torch.randn(6, 24), torch.randn(2, 24)
    cache, pos = torch.randn(5, 24), torch.tensor([3, 1])
    ref_x, ref_cache = x.clone(), cache.clone()
    want = views(ref_x, ref_cache, pos, src)
    got = torch.compile(views, backend="dmfx", options=_options(fused))(x, cache, pos, src)
    same = exact if not fused else (lambda a, b: rel_err(a, b) < 1e-6)
    assert all(same(g, w) for g, w in zip(got, want)) and same(cache, ref_cache)
    t, rows, head, whole, fresh = got
    assert whole is cache
    for view, base in ((t, x), (rows, x), (head, cache)):
        assert view._base is base
    assert fresh._base is None and fresh.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    head.fill_(7.0)  # writes through the view, as in eager
    want[2].fill_(7.0)
    assert same(cache, ref_cache)
    record = _record()
    if fused:
        assert record.fired.get("layer_norm") == 2, record.fired
    assert sum("is a view of input" in line for line in record.epilogue) == 3, record.epilogue


def test_an_input_that_requires_grad_written_in_place():
    """A non-leaf input written in place (h *= ...): the gradient flows through the write, as in
    eager; a buffer written from a detached value next to it."""

    def f(h, w, buf):
        buf.add_(h.detach().sum(0))
        h.mul_(w.sum(0))
        return F.layer_norm(h @ w, (w.shape[-1],))

    leaf, w = torch.randn(6, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    cot = torch.randn(6, 16)
    results = []
    for fn in (f, torch.compile(f, backend="dmfx", options={"fallback": False})):
        leaf.grad = w.grad = None
        h, buf = leaf * 1.0, torch.ones(16)
        out = fn(h, w, buf)
        (out * cot).sum().backward()
        results.append((out, h, buf, leaf.grad, w.grad))
    for got, want in zip(results[1], results[0]):
        assert rel_err(got, want) < 1e-5
    record = _record()
    assert record.training and record.fired.get("layer_norm") == 1
    assert any("l_h_" in line for line in record.epilogue), record.epilogue


def test_a_no_grad_region_in_a_training_graph_is_rewritten_with_eagers_gradients():
    """The functional body is traced under no_grad and would lose a torch.no_grad() region; dmfx makes
    it explicit (the region's reads of values that require grad are detached) and rewrites the graph:
    here the region reads the weight, and the weight's gradient must come only from outside it."""
    lin = torch.nn.Linear(16, 16)

    def f(x):
        with torch.no_grad():
            t = lin(x)
        return lin(x) * t

    x = torch.randn(4, 16)
    want = f(x)
    (want * torch.arange(16.0)).sum().backward()
    ref_grad, lin.weight.grad = lin.weight.grad.clone(), None
    got = torch.compile(f, backend="dmfx")(x)
    (got * torch.arange(16.0)).sum().backward()
    assert torch.equal(got, want) and torch.equal(lin.weight.grad, ref_grad)
    (record,) = dmfx.records()
    assert record.fallback is None and record.training, record.fallback


def test_an_in_place_op_in_a_no_grad_region_of_a_training_graph_is_left_to_pytorch():
    """A no_grad region that writes a tensor in place (an update of a parameter, say) keeps its meaning
    only under no_grad: the graph is left to PyTorch, with the reason."""
    w = torch.nn.Parameter(torch.randn(16))

    def f(x):
        with torch.no_grad():
            w.mul_(0.5)
        return x * w

    x = torch.randn(4, 16)
    w0 = w.detach().clone()
    got = torch.compile(f, backend="dmfx")(x)
    got.sum().backward()
    assert torch.equal(w.detach(), w0 * 0.5) and torch.equal(got, x * w.detach())
    assert torch.equal(w.grad, x.sum(0))
    (record,) = dmfx.records()
    assert "grad mode" in record.fallback and "in-place" in record.fallback, record.fallback


def test_a_llama_whose_rotary_embedding_runs_under_no_grad_is_rewritten():
    """transformers 4.x (and 5.x up to about 5.20) compute LLaMA's rotary cos/sin under
    ``@torch.no_grad()``: every training graph of those models has a no_grad region (found on the first
    GPU run, whose transformers is 5.17: the whole graph ran eagerly). It is rewritten, with eager's
    loss and gradients."""
    transformers, model = _tiny_llama()
    rotary = type(model.model.rotary_emb)
    model.train()
    ids = torch.randint(0, 256, (2, 12))
    plain = rotary.forward
    rotary.forward = torch.no_grad()(plain)
    try:
        ref = copy.deepcopy(model)
        want = ref(input_ids=ids, labels=ids).loss
        want.backward()
        got = torch.compile(model, backend="dmfx")(input_ids=ids, labels=ids).loss
        got.backward()
    finally:
        rotary.forward = plain
    assert rel_err(got, want) < 1e-5
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max().item() / scale < 1e-4, name
    recs = [r for r in dmfx.records() if r.training]
    assert recs and all(r.fallback is None for r in recs), [r.fallback for r in recs]


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    return transformers, transformers.LlamaForCausalLM(cfg).eval()


def prefilled_static_cache(batch: int = 2, prompt_len: int = 7, max_len: int = 16):
    """The tiny LLaMA, the prompt length, and a function giving a fresh StaticCache prefilled with one
    random prompt (the same prompt each call), for decode-step tests."""
    transformers, model = _tiny_llama()
    prompt = torch.randint(0, 256, (batch, prompt_len))

    def prefilled():
        cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
        model(input_ids=prompt, cache=cache, cache_position=torch.arange(prompt_len), use_cache=True)
        return cache

    return model, prompt_len, prefilled


@pytest.mark.parametrize("fused", [False, True], ids=["lowering-only", "fused"])
def test_a_static_cache_decode_step(fused):
    """HF's static KV cache: each decode step writes its key and value rows into the cache
    (index_copy_ at cache_position). The compiled step matches the same Dynamo graph run op by op
    (backend "eager": plain eager differs from both in the last bits, through HF's compile-time
    mask code), its cache writes are made in place, and the second step reuses the graph."""
    model, prompt_len, prefilled = prefilled_static_cache()
    batch = 2
    with torch.no_grad():
        ref_cache, cache = prefilled(), prefilled()
        reference = torch.compile(model.forward, backend="eager")
        compiled = torch.compile(model.forward, backend="dmfx", options=_options(fused))
        for pos in (prompt_len, prompt_len + 1):
            ids = torch.randint(0, 256, (batch, 1))
            kw = dict(input_ids=ids, cache_position=torch.tensor([pos]), use_cache=True)
            want, got = reference(cache=ref_cache, **kw).logits, compiled(cache=cache, **kw).logits
    layers = list(zip(cache.layers, ref_cache.layers))
    if fused:
        assert rel_err(got, want) < 1e-5
        for mine, ref in layers:
            assert rel_err(mine.keys, ref.keys) < 1e-6 and rel_err(mine.values, ref.values) < 1e-6
        first, ref_first = layers[0]  # the first layer's rows: GEMMs and dmfx::rope, bit for bit
        assert exact(first.keys, ref_first.keys) and exact(first.values, ref_first.values)
    else:
        assert exact(got, want)
        assert all(exact(m.keys, r.keys) and exact(m.values, r.values) for m, r in layers)
    records = [r for r in dmfx.records() if r.epilogue]
    assert len(records) == 1 and records[0].fallback is None, [r.summary() for r in dmfx.records()]
    record = records[0]
    if fused:
        for name in ("rope", "glu", "bias_dropout_residual_norm"):
            assert record.fired.get(name, 0) >= 2, record.fired
    if record.compiler == "inductor":  # (DMFX_COMPILER=inductor: Inductor reinplaces the epilogue's writes itself)
        return
    writes = _input_writes(record.inference_graph)
    in_place = [a for op, a in writes if op == "aten.index_copy_.default"]
    assert len(in_place) == 2 * len(layers), writes  # keys and values, one row each, in place
    assert all(op != "aten.copy_.default" for op, a in writes if a in in_place), writes


def _traced(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def test_reinplacing_an_input_write():
    def write(x, idx, src):
        new = torch.index_copy(x, 0, idx, src)
        x.copy_(new)
        return new.sum()

    gm = _traced(write, torch.randn(6, 4), torch.tensor([1, 4]), torch.randn(2, 4))
    assert reinplace_input_writes(gm) == 1
    assert [op for op, _ in _input_writes(gm)] == ["aten.index_copy_.default"]
    x, idx, src = torch.randn(6, 4), torch.tensor([1, 4]), torch.randn(2, 4)
    ref = x.clone()
    assert torch.equal(gm(x, idx, src), write(ref, idx, src)) and torch.equal(x, ref)


@pytest.mark.parametrize("case", ["read-after", "aliased-source", "view-returned"])
def test_reinplacing_leaves_an_unsafe_write_alone(case):
    """The write stays out of place when the old values are still read after it, when the op's
    other argument is a view of the written input, or when a view of the input is returned."""

    def read_after(x, idx, src):
        new = torch.index_copy(x, 0, idx, src)
        old = x.sum()
        x.copy_(new)
        return old

    def aliased_source(x, idx, src):
        new = torch.index_copy(x, 0, idx, x[:2])
        x.copy_(new)
        return new.sum()

    def view_returned(x, idx, src):
        v = x[1:]
        new = torch.index_copy(x, 0, idx, src)
        x.copy_(new)
        return v

    fn = {"read-after": read_after, "aliased-source": aliased_source, "view-returned": view_returned}[case]
    gm = _traced(fn, torch.randn(6, 4), torch.tensor([1, 4]), torch.randn(2, 4))
    assert reinplace_input_writes(gm) == 0
    assert [op for op, _ in _input_writes(gm)] == ["aten.copy_.default"]


def _scaled_by_state(h, state):
    h = h * (1 + 0.1 * state)  # (a value computed from the state: the backward needs it)
    state.mul_(3.0)
    return h


def _scaled_by_state_row(h, state):
    h = h * (1 + 0.1 * state)
    state[0] = 5.0
    return h


def _scaled_by_state_view(h, state):
    h = h * (1 + 0.1 * state[:, None, :]).squeeze(1)
    state.copy_(torch.full_like(state, 5.0))
    return h


def _scaled_by_the_written_state(h, state):
    return h * state.add_(1)  # (the backward reads the written value itself: not recomputed from the input)


@pytest.mark.parametrize("compiler", ["fx", "inductor"])
@pytest.mark.parametrize("fn", [_scaled_by_state, _scaled_by_state_row, _scaled_by_state_view, _scaled_by_the_written_state],
                         ids=["mul_", "setitem", "copy_", "add_-read"])
def test_a_value_computed_from_an_input_before_the_graph_writes_it_differentiates_with_the_old_value(fn, compiler):
    """The backward reads what the forward computed from the input before the write. AOTAutograd's
    min-cut partitioner recomputed ``1 + 0.1 * state`` in the backward, after the write, from the new
    state: every gradient through it was wrong, without an error (PyTorch 2.11 and 2.14, backends
    aot_eager and inductor alike). dmfx pins those reads (functionalize.pin_reads_of_written_inputs),
    in its own partitioner and in Inductor's when it leaves the graph to Inductor whole."""
    torch.manual_seed(0)
    h, state, R = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4), torch.randn(3, 4)
    want_state = state.clone()
    (fn(h, want_state) * R).sum().backward()
    want, h.grad = h.grad.clone(), None
    got_state = state.clone()
    compiled = torch.compile(fn, backend="dmfx", options={"compiler": compiler, "fallback": False})
    (compiled(h, got_state) * R).sum().backward()
    assert torch.equal(got_state, want_state)
    assert rel_err(h.grad, want) < 1e-6, rel_err(h.grad, want)
    (record,) = dmfx.records()
    assert record.epilogue and (record.fallback is None or record.fallback.startswith("left to Inductor")), record.fallback


def test_an_attention_over_a_written_cache_whose_views_are_made_after_its_softmax():
    """Functionalization re-derives the views of a written input where each is read: the values of a
    static cache, viewed into heads, come after the softmax. The fused attention, inserted where its
    pattern begins, read them before they existed ("used before it has been defined"); the fusion
    driver now moves such an op after its inputs (graph_utils.topologically_ordered)."""
    from tests.test_mutation_fuzz import LMAX, H, Program

    torch.manual_seed(0)
    model = Program(["attn", "ln"], sdpa=False).eval()
    x, pos = torch.randn(2, 1, H), torch.tensor([3])
    cache_k, cache_v, state = torch.randn(2, LMAX, H), torch.randn(2, LMAX, H), torch.randn(2, H)
    mine = [t.clone() for t in (cache_k, cache_v)]
    with torch.no_grad():
        want = model(x, state, cache_k, cache_v, pos)[0]
        got = torch.compile(model, backend="dmfx", options=_options(True))(x, state, *mine, pos)[0]
    assert rel_err(got, want) < 1e-5
    assert rel_err(mine[0], cache_k) < 1e-6 and rel_err(mine[1], cache_v) < 1e-6
    assert _record().fired.get("attention", 0) == 1, _record().fired


def _clone_between_two_index_writes(cache, pos, k1, k2):
    cache.index_copy_(1, pos, k1)
    seen = cache.clone()
    cache.index_copy_(1, pos, k2)
    return seen


def _clone_between_an_index_write_and_a_scale(cache, pos, k1, k2):
    cache.index_copy_(1, pos, k1)
    seen = cache.view(2, -1, 4, 8).transpose(1, 2).clone()
    cache.mul_(2.0)
    return seen


def _clone_between_two_setitems(cache, pos, k1, k2):
    cache[:, 3] = k1[:, 0]
    seen = cache.clone()
    cache[:, 3] = k2[:, 0]
    return seen


READ_BETWEEN_WRITES = [_clone_between_two_index_writes, _clone_between_an_index_write_and_a_scale,
                       _clone_between_two_setitems]


def _cache_args():
    torch.manual_seed(0)
    return torch.randn(2, 16, 32), torch.tensor([3]), torch.randn(2, 1, 32), torch.randn(2, 1, 32)


@pytest.mark.xfail(strict=True, reason="PyTorch's Inductor runs the clone after the second write (2.11, 2.14): "
                   "dmfx compiles such graphs as FX (functionalize.inductor_write_hazard); an XPASS means "
                   "PyTorch fixed it and the detour can go")
@pytest.mark.parametrize("fn", READ_BETWEEN_WRITES, ids=["index_copy", "index_copy-mul", "setitem"])
def test_pytorch_inductor_reads_an_input_between_two_writes(fn):
    cache, pos, k1, k2 = _cache_args()
    want_cache, got_cache = cache.clone(), cache.clone()
    want = fn(want_cache, pos, k1, k2)
    got = torch.compile(fn, backend="inductor")(got_cache, pos, k1, k2)
    assert torch.equal(got_cache, want_cache)
    assert rel_err(got, want) < 1e-6, rel_err(got, want)


@pytest.mark.parametrize("fuse", ["auto", "all"])
@pytest.mark.parametrize("fn", READ_BETWEEN_WRITES, ids=["index_copy", "index_copy-mul", "setitem"])
def test_a_graph_that_reads_an_input_between_two_writes_is_compiled_as_fx_under_inductor(fn, fuse):
    """The graphs Inductor miscompiles (above): dmfx's default compiler is Inductor, and it neither
    leaves them to Inductor whole (fuse="auto") nor compiles its rewrite with Inductor; they run as
    FX, with eager's values, and the record says why."""
    cache, pos, k1, k2 = _cache_args()
    want_cache, got_cache = cache.clone(), cache.clone()
    want = fn(want_cache, pos, k1, k2)
    compiled = torch.compile(fn, backend="dmfx", options={"compiler": "inductor", "fuse": fuse, "fallback": False})
    got = compiled(got_cache, pos, k1, k2)
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(got, want)
    (record,) = dmfx.records()
    assert record.compiler == "fx" and any("compiled as FX, not by Inductor" in m for m in record.missed), record.missed


def test_a_static_cache_written_once_per_graph_stays_with_inductor():
    """The hazard check leaves HF's decode step alone: each cache tensor is written once per graph."""
    from dmfx.functionalize import attach_epilogue, functional_body, inductor_write_hazard

    def step(cache, pos, k1, k2):
        cache.index_copy_(1, pos, k1)
        return cache.view(2, -1, 4, 8).transpose(1, 2).clone() * 2

    def lowered(fn):
        return attach_epilogue(*functional_body(lambda *a: (fn(*a),), _cache_args(), training=False))

    assert inductor_write_hazard(lowered(step)) is None
    assert "more than once" in inductor_write_hazard(lowered(_clone_between_two_index_writes))


def _index_write_then_read_for_the_gradient(h, state):
    state[0] = h[-1].detach() * 0.5
    return h * (1 + 0.1 * state)


def _index_write_read_by_a_backward(h, state):
    state[0] = h[-1].detach() * 0.5
    return h * state


def _written_state_case():
    torch.manual_seed(0)
    return torch.randn(3, 4, requires_grad=True), torch.randn(3, 4), torch.randn(3, 4)


@pytest.mark.xfail(strict=True, reason="PyTorch's Inductor overwrites the written input in the backward (2.11, "
                   "2.14): dmfx compiles such training graphs as FX (functionalize.inductor_write_hazard); an "
                   "XPASS means PyTorch fixed it")
@pytest.mark.parametrize("fn", [_index_write_then_read_for_the_gradient, _index_write_read_by_a_backward])
def test_pytorch_inductor_keeps_a_written_input_through_the_backward(fn):
    h, state, R = _written_state_case()
    want_state, got_state = state.clone(), state.clone()
    (fn(h, want_state) * R).sum().backward()
    (torch.compile(fn, backend="inductor")(h, got_state) * R).sum().backward()
    assert torch.equal(got_state, want_state)


def test_a_training_graph_that_reads_a_state_it_wrote_is_compiled_as_fx():
    """``state[0] = v`` then ``h * (1 + 0.1 * state)``: the written state feeds the gradients' path,
    and Inductor's backward overwrote the state (above; the mutation fuzz's program 85 of seed 2026,
    1.4 from eager's). Such a training graph runs as FX, whether dmfx rewrites it or would leave it
    to Inductor whole."""
    step = _index_write_then_read_for_the_gradient
    h, state, R = _written_state_case()
    want_state = state.clone()
    (step(h, want_state) * R).sum().backward()
    want, h.grad = h.grad.clone(), None
    for fuse in ("all", "auto"):
        dmfx.reset()
        torch._dynamo.reset()
        got_state = state.clone()
        compiled = torch.compile(step, backend="dmfx", options={"compiler": "inductor", "fuse": fuse, "fallback": False})
        (compiled(h, got_state) * R).sum().backward()
        assert torch.equal(got_state, want_state), fuse
        assert rel_err(h.grad, want) < 1e-6, (fuse, rel_err(h.grad, want))
        h.grad = None
        (record,) = dmfx.records()
        assert record.compiler == "fx", (fuse, record.compiler, record.missed)


def test_inputs_that_share_storage_where_one_is_written_are_left_to_pytorch_with_their_names():
    """A tensor and a view of it passed as two inputs, one written: AOTAutograd's functionalization
    refuses them. dmfx says which inputs share storage (fallback=False raises that; by default the
    graph runs as PyTorch's, with eager's values)."""

    def f(a, b):
        a.mul_(2.0)
        return b * 3

    base = torch.randn(4, 6)
    want_base = base.clone()
    want = f(want_base, want_base[1:])
    shared = base.clone()
    with pytest.raises(Exception, match="inputs .* share storage and the graph writes one of them"):
        torch.compile(f, backend="dmfx", options={"fallback": False})(shared, shared[1:])
    dmfx.reset()
    torch._dynamo.reset()
    got_base = base.clone()
    got = torch.compile(f, backend="dmfx")(got_base, got_base[1:])
    assert torch.equal(got, want) and torch.equal(got_base, want_base)
    (record,) = dmfx.records()
    assert "share storage" in record.fallback, record.fallback


def _keys_written_slice_by_slice(h, w):
    """DeepSeek V3's keys: a new buffer written slice by slice with values that require grad
    (functionalized: ``aten.copy`` into each slice, then ``slice_scatter``)."""
    k = h.new_empty(h.shape[0], 2 * h.shape[1])
    k[:, : h.shape[1]] = h @ w
    k[:, h.shape[1]:] = torch.sin(h)[:, :1]  # (a copy that broadcasts)
    return F.layer_norm(k, (k.shape[-1],)) * 3


def _copy_into_a_state(h, w, state):
    """A copy_ into an input of a value that requires grad: eager's state then requires grad too."""
    state.copy_(h @ w)
    return (h * state).sum(-1)


def _constants_written_over_a_value_that_requires_grad(h, w, c):
    """A slice of a value that requires grad overwritten by one that does not, cast from float64 (the
    copy's destination requires grad, its source not; the slice's gradient is zero)."""
    k = h @ w
    k[:, 2:5] = c
    return F.layer_norm(k, (k.shape[-1],)) * 3


# (under "auto" the CPU graphs without dropout go to Inductor whole, except the write into an input,
# which Inductor would miscompile: the defaults' way with each is tested, not only dmfx's rewrite)
@pytest.mark.parametrize("options", [{"compiler": "fx"}, {"compiler": "inductor", "fuse": "all"},
                                     {"compiler": "inductor", "fuse": "auto"}], ids=["fx", "inductor-all", "auto"])
@pytest.mark.parametrize("fn", [_keys_written_slice_by_slice, _copy_into_a_state,
                                _constants_written_over_a_value_that_requires_grad],
                         ids=["new-buffer", "input", "over-a-grad-value"])
def test_a_copy_of_a_value_that_requires_grad_trains_as_eager(fn, options):
    """``aten.copy`` (the functional form of ``copy_``) has no derivative formula; AOTAutograd's trace
    of a functional body that copies a value requiring grad, or into one, failed ("derivative for
    aten::copy is not implemented", DeepSeek V3 in training) and, with the default fallback, raised to
    the user. Such copies are lowered to the value cast and expanded to the destination (functionalize.
    differentiable_copies): the outputs, the written state and the gradients are eager's."""
    torch.manual_seed(0)
    h, w = torch.randn(5, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    args = [torch.zeros(5, 8)] if fn is _copy_into_a_state else \
        [torch.randn(5, 3, dtype=torch.float64)] if fn is _constants_written_over_a_value_that_requires_grad else []
    want_args = [a.clone() for a in args]
    want = fn(h, w, *want_args)
    R = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * R).sum(), (h, w))
    got = torch.compile(fn, backend="dmfx", options={"fallback": False, **options})(h, w, *args)
    got_grads = torch.autograd.grad((got * R).sum(), (h, w))
    assert rel_err(got, want) < 1e-5
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()
    for a, b in zip(args, want_args):
        assert rel_err(a.float(), b.float()) < 1e-5 and a.requires_grad == b.requires_grad
    assert all(r.fallback is None or r.fallback.startswith("left to Inductor: ") for r in dmfx.records())


def test_a_rewritten_graph_aotautograd_cannot_compile_is_left_to_pytorch(monkeypatch):
    """Where AOTAutograd's trace of dmfx's rewritten graph (or one of dmfx's compilers) fails, the
    default (fallback on) leaves the graph to PyTorch, as a graph dmfx cannot lower is, and the record
    says why; fallback=False raises. (The failure is made here: a forward compiler that raises.)"""
    import dmfx.backend as backend

    monkeypatch.setattr(backend, "_compiler", compilers_raising(lambda kind: RuntimeError(f"no {kind} compiler today")))
    f = lambda x, w: F.layer_norm(x @ w, (w.shape[-1],)) * 2  # noqa: E731
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    want = f(x, w)
    for compiler in ("fx", "inductor"):
        dmfx.reset()
        torch._dynamo.reset()
        options = {"compiler": compiler, "fuse": "all", "cache": False}
        with pytest.raises(Exception, match="no forward compiler today"):
            torch.compile(f, backend="dmfx", options={**options, "fallback": False})(x, w)
        dmfx.reset()
        torch._dynamo.reset()
        got = torch.compile(f, backend="dmfx", options=options)(x, w)
        assert rel_err(got, want) < 1e-6
        (record,) = dmfx.records()
        assert "AOTAutograd could not compile the rewritten graph: RuntimeError: no forward compiler today" in \
            record.fallback, record.fallback
        assert not record.fired and record.compiler == compiler, (record.fired, record.compiler)


def test_a_strict_verifier_error_in_aotautograds_step_is_not_swallowed_by_the_fallback(monkeypatch):
    """The joint graph's passes run inside AOTAutograd's step; a strict verifier error there (the
    suite's DMFX_VERIFY=strict) must fail the compile even with fallback on, as it does in the
    lowering, not turn into a quiet fallback."""
    import dmfx.backend as backend
    from dmfx.passes.verify import GraphVerificationError

    monkeypatch.setattr(backend, "_compiler", compilers_raising(
        lambda kind: GraphVerificationError("layout", "mm", "made up for the test", strict=True)))
    f = lambda x, w: F.layer_norm(x @ w, (w.shape[-1],)) * 2  # noqa: E731
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    with pytest.raises(Exception, match="made up for the test"):
        torch.compile(f, backend="dmfx", options={"compiler": "fx", "fuse": "all", "cache": False})(x, w)


@pytest.mark.parametrize("where", ["graph", "whole"])
def test_a_strict_verifier_error_under_inductor_is_not_swallowed_by_the_fallback(monkeypatch, where):
    """Inductor's compile of a graph dmfx rewrote ("graph") or of a graph left to it whole ("whole")
    runs dmfx's passes inside it; a strict verifier error there fails the compile even with fallback
    on, as in the lowering and AOTAutograd's step, instead of running the graph as FX."""
    import dmfx.backend as backend
    import dmfx.inductor as inductor
    from dmfx.passes.verify import GraphVerificationError

    def raises(*args, **kwargs):
        raise GraphVerificationError("layout", "mm", "made up for the test", strict=True)

    def lowering_fails(*args, **kwargs):
        raise RuntimeError("no lowering today")

    if where == "graph":
        monkeypatch.setattr(inductor, "compile_graph", raises)
    else:  # (a lowering that fails leaves the graph to Inductor whole)
        import torch._inductor.compile_fx as compile_fx

        monkeypatch.setattr(backend, "lower_to_aten", lowering_fails)
        monkeypatch.setattr(compile_fx, "compile_fx", raises)
    f = lambda x, w: F.layer_norm(x @ w, (w.shape[-1],)) * 2  # noqa: E731
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    with pytest.raises(Exception, match="made up for the test"):
        torch.compile(f, backend="dmfx", options={"compiler": "inductor", "fuse": "all", "cache": False})(x, w)


def test_a_graph_that_writes_an_input_runs_as_dynamo_gave_it_where_aotautograd_fails(monkeypatch):
    """Where AOTAutograd cannot compile the rewrite of a graph that writes an input, the fallback is not
    Inductor whole even under compiler="inductor": whether Inductor would miscompile the writes was
    judged on the rewritten graph only."""
    import dmfx.backend as backend

    monkeypatch.setattr(backend, "_compiler", compilers_raising(lambda kind: RuntimeError("no compiler today")))

    def f(x, w, state):
        state.add_(1.0)
        return F.layer_norm(x @ w, (w.shape[-1],)) * state

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    want_state, got_state = torch.ones(4, 8), torch.ones(4, 8)
    want = f(x, w, want_state)
    got = torch.compile(f, backend="dmfx", options={"compiler": "inductor", "fuse": "all", "cache": False})(x, w, got_state)
    assert rel_err(got, want) < 1e-6 and torch.equal(got_state, want_state)
    (record,) = dmfx.records()
    assert record.fallback.startswith("AOTAutograd could not compile") and record.compiler == "fx", \
        (record.fallback, record.compiler)


class _HoldsState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))
        self.register_buffer("last", torch.zeros(2, 4))
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        self.total.add_(x.sum(0))
        self.last[0] = x[0]
        scale = self.scale * 2
        scale += 1  # (a new tensor: not the attribute)
        return x * scale


def test_written_attributes_names_the_tensors_a_graph_holds_and_writes():
    """In-place methods and functions (``add_``, ``torch._foreach_mul_`` over a list) and item writes
    (``t[i] = v``, ``t += v``) into a graph's tensor attributes are found; an attribute only read is not."""
    from dmfx.functionalize import written_attributes

    gm = torch.fx.symbolic_trace(_HoldsState())
    assert written_attributes(gm) == ["total", "last"], gm.code

    # (as Dynamo gives an optimizer's step: symbolic_trace would run the foreach op on the buffers)
    graph = torch.fx.Graph()
    x, a, b = graph.placeholder("x"), graph.get_attr("a"), graph.get_attr("b")
    graph.call_function(torch._foreach_mul_, ([a, b], 0.5))
    graph.output(graph.call_function(torch.add, (x, a)))
    held = torch.nn.Module()
    held.a, held.b = torch.zeros(3), torch.zeros(3)  # (plain attributes, not buffers)
    assert written_attributes(torch.fx.GraphModule(held, graph)) == ["a", "b"]

    class Augmented(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("a", torch.zeros(3))

        def forward(self, x):
            a = self.a
            a += x
            return x * 2

    assert written_attributes(torch.fx.symbolic_trace(Augmented())) == ["a"]

    # (an ATen-level graph: OpOverloads are read by their schemas, whatever their names; ``out=``
    # is a write too, and an argument only read is not one)
    graph = torch.fx.Graph()
    x, a, b, c = graph.placeholder("x"), graph.get_attr("a"), graph.get_attr("b"), graph.get_attr("c")
    graph.call_function(torch.ops.aten.add_.Tensor, (a, x))
    graph.call_function(torch.ops.aten.mul.out, (x, c), {"out": b})
    graph.call_function(torch.ops.aten.index_put_.default, (c, [x], a))
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (x, c)))
    held = torch.nn.Module()
    held.a, held.b, held.c = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    assert written_attributes(torch.fx.GraphModule(held, graph)) == ["a", "b", "c"]
    graph.erase_node(next(n for n in graph.nodes if n.target is torch.ops.aten.index_put_.default))
    assert written_attributes(torch.fx.GraphModule(held, graph)) == ["a", "b"]  # (c only read)


@pytest.mark.parametrize("compiler", ["inductor", "fx"])
def test_a_compiled_training_step_with_its_optimizer_is_eagers(compiler):
    """The training step as PyTorch's tutorials compile it: forward, backward, ``optimizer.step()`` and
    ``zero_grad()`` in one compiled function. Dynamo gives the optimizer's graph the parameters and
    the optimizer's state as attributes, which it writes: dmfx leaves that graph to PyTorch (Inductor
    whole under compiler="inductor") and says why in plain words, not with the lowering's internal
    error; the model's own graphs are dmfx's. Parameters and losses stay eager's over four steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8))
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2, foreach=True)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)

    def step(net, opt, x, r):
        loss = (net(x) * r).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled = torch.compile(step, backend="dmfx", options={"compiler": compiler, "fuse": "all", "cache": False})
    for _ in range(4):
        x, r = torch.randn(8, 32), torch.randn(8, 8)
        got, want = compiled(ours, opt_ours, x, r), step(ref, opt_ref, x, r)
        assert rel_err(got, want) < 1e-5
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel_err(p, q) < 1e-5, name
    records = dmfx.records()
    assert any(r.fired.get("layer_norm") for r in records), [(r.graph_id, r.fired) for r in records]
    held = [r for r in records if r.fallback and "writes tensors it holds as attributes" in r.fallback]
    assert held, [r.fallback for r in records]
    for r in held:
        assert "as a compiled optimizer.step() writes its state" in r.fallback, r.fallback
        assert r.fallback.startswith("left to Inductor: ") == (compiler == "inductor"), r.fallback
