"""The linear_cross_entropy fusion (passes/linear_cross_entropy.py): the LM head GEMM (``mm`` / ``addmm``
of ``t(W)``, viewed ``[N, V]``, perhaps upcast) and the ``dmfx::cross_entropy`` the cross_entropy pass
made of its loss become ``dmfx::linear_cross_entropy`` where nothing else reads the logits, so that the
``[N, V]`` logits never exist; the near-misses (logits returned or read elsewhere, a weight not read
transposed, a bias that broadcasts, an addmm that scales, a batched GEMM, a slice of the logits) are
left alone with their reason. End to end: a module computing its loss from hidden states, and HF's
LlamaForCausalLM called for its loss alone, fire it, with the loss and every gradient equal to eager's
(each judged relative to the largest); HF's LlamaForCausalLM and GPT2LMHeadModel, which return their
logits, are near-misses, their loss fused by the cross_entropy pass alone."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import check_same, rel_err, rewrite

import dmfx
from dmfx.cuda_ops.cross_entropy import default_chunk

aten, dmfx_ops = torch.ops.aten, torch.ops.dmfx
V, H = 50, 16


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target is dmfx_ops.linear_cross_entropy.default]


def _aten(gm, *ops):
    return [n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) in ops]


def _inputs(bias=True, dtype=torch.float32, grad=True):
    h = torch.randn(2, 7, H, dtype=dtype, requires_grad=grad)
    w = (torch.randn(V, H) / H**0.5).to(dtype).requires_grad_(grad)
    b = torch.randn(V, dtype=dtype, requires_grad=grad) if bias else None
    y = torch.randint(0, V, (2, 7))
    y[0, :2] = -100
    return h, w, b, y


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fires_on_the_lm_head_and_its_loss(reduction, bias):
    def fn(h, w, y, b=None):
        return F.cross_entropy(F.linear(h, w, b).view(-1, V), y.view(-1), reduction=reduction)

    h, w, b, y = _inputs(bias)
    args = (h, w, y, b) if bias else (h, w, y)
    gm, ctx = rewrite(fn, *args)
    assert ctx.fired.get("linear_cross_entropy") == 1 and "cross_entropy" not in ctx.fired, ctx.fired
    (n,) = _fused(gm)
    code = {"none": 0, "mean": 1, "sum": 2}[reduction]
    _, _, bias_arg, _, ignore_index, eps, code_arg, chunk, grads = n.args
    assert (bias_arg is not None) == bias and (ignore_index, eps, code_arg) == (-100, 0.0, code)
    assert chunk == 16  # (default_chunk: the 14 rows in one chunk)
    # the gradients the backward needs, computed in the forward where the loss is reduced
    assert grads == [reduction != "none"] * 2 + [bias and reduction != "none"]
    assert not _aten(gm, aten.mm, aten.addmm, aten._log_softmax, aten.nll_loss_forward)
    assert not [m for m in ctx.missed if m.startswith("linear_cross_entropy")]
    check_same(fn, gm, *args, tol=1e-6)


def test_the_gradients_it_computes_in_the_forward_are_those_that_are_needed():
    def fn(h, w, b, y):
        return F.cross_entropy(F.linear(h, w, b).view(-1, V), y.view(-1))

    h, w, b, y = _inputs()
    cases = {  # (input_requires_grad for h, w, b, y; training) -> grads
        ((True, False, False, False), True): [True, False, False],  # a frozen head
        ((False, True, True, False), True): [False, True, True],
        ((True, True, True, False), False): [False, False, False],  # inference
    }
    for (requires, training), want in cases.items():
        gm, ctx = rewrite(fn, h, w, b, y, input_requires_grad=requires, training=training)
        (n,) = _fused(gm)
        assert n.args[8] == want, (requires, training)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_style_upcast_is_absorbed_and_the_low_precision_hidden_states_are_read(dtype):
    def fn(h, w, y):  # transformers' loss functions: logits.float(), then view(-1, V)
        return F.cross_entropy(F.linear(h, w).float().view(-1, V), y.view(-1), ignore_index=-100)

    h, w, _, y = _inputs(False, dtype)
    gm, ctx = rewrite(fn, h, w, y)
    assert ctx.fired.get("linear_cross_entropy") == 1
    (n,) = _fused(gm)
    assert n.args[0].meta["val"].dtype == dtype and n.meta["val"][0].dtype == torch.float32
    assert not _aten(gm, aten._to_copy, aten.mm)
    out, want = gm(h, w, y)[0], fn(h, w, y)
    assert out.dtype == want.dtype == torch.float32 and rel_err(out, want) < 1e-3


def test_two_dim_hidden_states_and_a_hand_written_gemm():
    h, w, b, y = _inputs()
    h, y = h.reshape(-1, H), y.reshape(-1)
    for fn, args in ((lambda h, w, y: F.cross_entropy(h @ w.t(), y, reduction="sum"), (h, w, y)),
                     (lambda h, w, b, y: F.cross_entropy(torch.addmm(b, h, w.transpose(0, 1)), y), (h, w, b, y))):
        gm, ctx = rewrite(fn, *args)
        assert ctx.fired.get("linear_cross_entropy") == 1, ctx.missed
        check_same(fn, gm, *args, tol=1e-6)


def _returns_logits(h, w, y):
    z = F.linear(h, w)
    return F.cross_entropy(z.view(-1, V), y.view(-1)), z


def _logits_read_elsewhere(h, w, y):
    z = F.linear(h, w).view(-1, V)
    return F.cross_entropy(z, y.view(-1)) + z.argmax(-1).sum()


def test_near_misses_are_left_alone_with_their_reason():
    h, w, b, y = _inputs()
    h2, y2 = h.reshape(-1, H), y.reshape(-1)
    cases = {
        "a graph output (the model returns its logits)": (_returns_logits, (h, w, y)),
        "read elsewhere, by": (_logits_read_elsewhere, (h, w, y)),
        "not a [V, H] matrix read transposed": (lambda h, wp, y: F.cross_entropy(h @ wp, y), (h2, w.t().detach().clone(), y2)),
        "the bias is not a [V] vector": (lambda h, w, b, y: F.cross_entropy(torch.addmm(b[None], h, w.t()), y), (h2, w, b, y2)),
        "the addmm scales": (lambda h, w, b, y: F.cross_entropy(torch.addmm(b, h, w.t(), beta=0.5), y), (h2, w, b, y2)),
        "a batched GEMM (bmm)": (lambda h, w, y: F.cross_entropy(torch.bmm(h, w.t().expand(2, H, V)).view(-1, V), y.view(-1)),
                                 (h, w, y)),
        "a slice or a copy of the logits": (lambda h, w, y: F.cross_entropy(F.linear(h, w)[:, :-1].reshape(-1, V),
                                                                            y[:, 1:].reshape(-1)), (h, w, y)),
    }
    for why, (fn, args) in cases.items():
        gm, ctx = rewrite(fn, *args)
        assert "linear_cross_entropy" not in ctx.fired and ctx.fired.get("cross_entropy") == 1, why
        assert any(m.startswith("linear_cross_entropy at") and why in m for m in ctx.missed), (why, ctx.missed)
        check_same(fn, gm, *args)


def test_a_loss_of_logits_that_are_an_input_is_not_this_pattern():
    fn = lambda z, y: F.cross_entropy(z, y)  # noqa: E731
    gm, ctx = rewrite(fn, torch.randn(6, V), torch.randint(0, V, (6,)))
    assert ctx.fired.get("cross_entropy") == 1 and not any(m.startswith("linear_cross_entropy") for m in ctx.missed)


# ------------------------------------------------------------------------------------- end to end


class LossHead(torch.nn.Module):
    """A final norm, an LM head and the loss, computed from hidden states: the logits are never returned."""

    def __init__(self, vocab=300, hidden=16, bias=False, reduction="mean"):
        super().__init__()
        self.norm, self.lm_head = torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, vocab, bias=bias)
        self.vocab, self.reduction = vocab, reduction

    def forward(self, h, labels):
        logits = self.lm_head(self.norm(h))
        return F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1), reduction=self.reduction)


def _grads_match(model, ref, got_x, want_x, tol):
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())]
    grads.append(("hidden", got_x, want_x))
    largest = max(g.norm() for _, _, g in grads)
    for name, got, exp in grads:
        assert rel_err(got, exp, scale=largest) < tol, name


@pytest.mark.parametrize("bias, reduction", [(False, "mean"), (True, "sum"), (True, "none")])
def test_a_training_step_fires_and_matches_eager(bias, reduction):
    model = LossHead(bias=bias, reduction=reduction)
    ref = copy.deepcopy(model)
    h, labels = torch.randn(2, 20, 16), torch.randint(0, 300, (2, 20))
    labels[1, 15:] = -100
    x, xr = h.clone().requires_grad_(), h.clone().requires_grad_()
    compiled = torch.compile(model, backend="dmfx", options={"fallback": False})
    loss, want = compiled(x, labels), ref(xr, labels)
    R = torch.randn(want.shape)
    (loss * R).sum().backward()
    (want * R).sum().backward()
    record = dmfx.records()[-1]
    assert record.fired.get("linear_cross_entropy") == 1 and "cross_entropy" not in record.fired, record.fired
    fwd = [n for n in record.forward_graph.graph.nodes if n.op == "call_function"]
    bwd = [n.target for n in record.backward_graph.graph.nodes if n.op == "call_function"]
    assert dmfx_ops.linear_cross_entropy_backward.default in bwd and aten.mm.default not in bwd
    # no [N, V] tensor in either graph (N * V = 12000 elements; the largest tensor is the weight's 4800)
    for n in [*fwd, *record.backward_graph.graph.nodes]:
        for v in (n.meta.get("val"),) if not isinstance(n.meta.get("val"), (tuple, list)) else n.meta["val"]:
            assert not isinstance(v, torch.Tensor) or v.numel() < 40 * 300, n.name
    assert rel_err(loss, want) < 1e-6
    _grads_match(model, ref, x.grad, xr.grad, 1e-5)


def test_inference_fires_without_gradients():
    model = LossHead(bias=True).eval()
    h, labels = torch.randn(2, 20, 16), torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        loss = torch.compile(model, backend="dmfx", options={"fallback": False})(h, labels)
        want = model(h, labels)
    record = dmfx.records()[-1]
    assert record.fired.get("linear_cross_entropy") == 1
    (n,) = _fused(record.inference_graph)
    assert list(n.args[8] if len(n.args) > 8 else n.kwargs.get("grads", [False] * 3)) == [False] * 3
    assert rel_err(loss, want) < 1e-6


def test_bf16_training_step_reads_the_bf16_hidden_states():
    model = LossHead(bias=True).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    h, labels = torch.randn(2, 20, 16).bfloat16(), torch.randint(0, 300, (2, 20))
    x, xr = h.clone().requires_grad_(), h.clone().requires_grad_()
    loss = torch.compile(model, backend="dmfx", options={"fallback": False})(x, labels)
    want = ref(xr, labels)
    loss.backward()
    want.backward()
    (n,) = _fused(dmfx.records()[-1].forward_graph)
    assert n.args[0].meta["val"].dtype == torch.bfloat16
    assert rel_err(loss.float(), want.float()) < 1e-2
    _grads_match(model, ref, x.grad, xr.grad, 3e-2)  # (bf16 dlogits and GEMMs; eager's log-softmax in bf16)


# ------------------------------------------------------------------------------------- HF models


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, vocab_size=60, max_position_embeddings=64, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return model.train()


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=60, n_positions=64, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "eager"
    return model.train()


def _ids_and_labels():
    ids = torch.randint(3, 60, (2, 9))
    labels = ids.clone()
    labels[1, 6:] = -100
    return ids, labels


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_hf_lm_heads_return_their_logits_so_only_the_loss_fuses(build):
    model = build()
    ref = copy.deepcopy(model)
    ids, labels = _ids_and_labels()
    out = torch.compile(model, backend="dmfx", options={"fallback": False})(input_ids=ids, labels=labels)
    records = dmfx.records()
    assert not any("linear_cross_entropy" in r.fired for r in records)
    (loss_graph,) = [r for r in records if r.fired.get("cross_entropy") == 1]
    logits = [n for n in loss_graph.forward_graph.graph.nodes if n.target is dmfx_ops.cross_entropy.default][0].args[0]
    while logits.op == "call_function" and logits.target in (aten.view.default, aten.reshape.default):
        logits = logits.args[0]
    if logits.op != "placeholder":  # (GPT-2: a graph break puts the loss in a graph of its own, logits an input)
        assert any(m.startswith("linear_cross_entropy at") and "a graph output (the model returns its logits)" in m
                   for m in loss_graph.missed), loss_graph.missed
    assert build is _gpt2 or logits.op != "placeholder"
    assert rel_err(out.loss, ref(input_ids=ids, labels=labels).loss) < 1e-6


def test_hf_causal_lm_called_for_its_loss_alone_fires_and_matches_eager():
    model = _llama()
    ref = copy.deepcopy(model)
    ids, labels = _ids_and_labels()

    def loss_of(m, ids, labels):  # the logits are dead outside the loss: [N, V] need never exist
        return m(input_ids=ids, labels=labels).loss

    loss = torch.compile(loss_of, backend="dmfx", options={"fallback": False})(model, ids, labels)
    want = loss_of(ref, ids, labels)
    loss.backward()
    want.backward()
    record = dmfx.records()[-1]
    assert record.fired.get("linear_cross_entropy") == 1 and "cross_entropy" not in record.fired, record.fired
    assert rel_err(loss, want) < 1e-6
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters()) if q.grad is not None]
    largest = max(g.norm() for _, _, g in grads)
    for name, got, exp in grads:
        assert rel_err(got, exp, scale=largest) < 1e-5, name


def test_under_inductor_the_op_is_an_extern_kernel_and_the_step_matches_eager():
    """compiler="inductor" (users' default; fuse="all": a CPU graph without dropout would go to Inductor
    whole): the op and its backward run as extern kernels inside Inductor's code."""
    model = LossHead(bias=True, reduction="none")
    ref = copy.deepcopy(model)
    h, labels = torch.randn(2, 20, 16), torch.randint(0, 300, (2, 20))
    x, xr = h.clone().requires_grad_(), h.clone().requires_grad_()
    options = {"fallback": False, "compiler": "inductor", "fuse": "all"}
    loss, want = torch.compile(model, backend="dmfx", options=options)(x, labels), ref(xr, labels)
    R = torch.randn(want.shape)
    (loss * R).sum().backward()
    (want * R).sum().backward()
    record = dmfx.records()[-1]
    assert record.compiler == "inductor" and record.fired.get("linear_cross_entropy") == 1, (record.compiler, record.fired)
    assert rel_err(loss, want) < 1e-6
    _grads_match(model, ref, x.grad, xr.grad, 1e-5)


def test_dynamic_shapes_one_graph_for_every_batch_and_a_chunk_by_the_vocabulary_alone():
    model = LossHead(vocab=300)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dmfx", options={"fallback": False}, dynamic=True)
    for S in (9, 13, 40):
        h, labels = torch.randn(2, S, 16), torch.randint(0, 300, (2, S))
        x, xr = h.clone().requires_grad_(), h.clone().requires_grad_()
        loss, want = compiled(x, labels), ref(xr, labels)
        loss.backward()
        want.backward()
        assert rel_err(loss, want) < 1e-6 and rel_err(x.grad, xr.grad) < 1e-5
    (record,) = dmfx.records()
    (n,) = _fused(record.forward_graph)
    assert record.fired.get("linear_cross_entropy") == 1 and n.args[7] == default_chunk(None, 300) == 32768
