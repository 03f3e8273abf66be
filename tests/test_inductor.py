"""compiler="inductor" (the default users get; the rest of the suite runs compiler="fx", see conftest):
dmfx's passes, then Inductor compiles each forward / backward / inference graph with dmfx's ops as
extern kernels (dmfx/inductor.py). The same answers as eager, dmfx's kernels still running inside
Inductor's code, and a clear fallback to FX when Inductor cannot compile a graph."""

import copy

import pytest
import torch

import dmfx
from dmfx.models import small_model, zoo_case
from tests.conftest import rel_err

# fuse="all": dmfx fuses even where, under Inductor, it would leave the graph to Inductor alone (a
# graph without dropout on the CPU), so these tests see dmfx's kernels inside Inductor's code
INDUCTOR = {"compiler": "inductor", "fuse": "all", "fallback": False}



@pytest.fixture(autouse=True)
def _compiled_afresh():
    """Every compile here is a compile: the tests read what it did (the compiled graphs, the backward
    passes' counts), which a hit in a warm PyTorch cache does not carry where its records sit in another
    dmfx cache directory. The cache has its own tests (test_graph_cache.py)."""
    with torch.compiler.config.patch(force_disable_caches=True):
        yield

def dmfx_ops_run(step) -> set[str]:
    """The dmfx:: ops the profiler sees while `step()` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return {e.key for e in prof.key_averages() if e.key.startswith("dmfx::")}


def grads_match(model, ref, tol=1e-4):
    """Every parameter gradient of `model` is within `tol` of `ref`'s, relative to the largest
    gradient (some, e.g. a key bias's, are zero analytically)."""
    scale = max(q.grad.abs().max().item() for q in ref.parameters() if q.grad is not None)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        assert (p.grad - q.grad).abs().max().item() / scale < tol, name


def test_bert_layer_training_matches_eager_and_runs_dmfx_kernels():
    m = dmfx.models.bert_layer(hidden=64, heads=4, ffn=128, dropout=0.0).train()
    ref = copy.deepcopy(m)
    x = torch.randn(2, 16, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    c = torch.compile(m, backend="dmfx", options=INDUCTOR)
    out = c(x)[0]
    R = torch.randn_like(out)
    (out * R).sum().backward()
    expect = ref(x2)[0]
    (expect * R).sum().backward()
    assert rel_err(out, expect) < 1e-5
    assert rel_err(x.grad, x2.grad) < 1e-5
    grads_match(m, ref)
    rec = dmfx.records()[-1]
    assert rec.compiler == "inductor" and rec.fallback is None
    assert {"bias_dropout_residual_norm", "attention"} <= set(rec.fired)
    assert "run by Inductor" in rec.summary()

    def step():
        c(x)[0].sum().backward()

    ran = dmfx_ops_run(step)
    assert {"dmfx::bias_dropout_residual_norm", "dmfx::norm_backward"} <= ran, ran


def test_causal_lm_with_its_loss_matches_eager():
    """LLaMA with labels: the loss (log_softmax + nll_loss over [tokens, vocab]), embeddings and the
    head's glue are left to Inductor; dmfx's RMSNorm, rotary, SwiGLU and attention kernels run."""
    m = small_model("llama", lm_head=True).train()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 100, (2, 16))
    c = torch.compile(m, backend="dmfx", options=INDUCTOR)
    loss = c(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    expect = ref(input_ids=ids, labels=ids, use_cache=False).loss
    expect.backward()
    assert abs(loss.item() - expect.item()) < 1e-5 * abs(expect.item())
    grads_match(m, ref)
    assert {"rope", "glu"} <= set(dmfx.records()[-1].fired)
    ran = dmfx_ops_run(lambda: c(input_ids=ids, labels=ids, use_cache=False).loss.backward())
    assert {"dmfx::rope", "dmfx::glu", "dmfx::glu_backward"} <= ran, ran


@pytest.mark.parametrize("family", ["bert", "gpt2", "t5"])
def test_inference_matches_eager(family):
    m, kwargs = zoo_case(family)
    m.eval()
    with torch.no_grad():
        expect = m(**kwargs)[0]
        out = torch.compile(m, backend="dmfx", options=INDUCTOR)(**kwargs)[0]
    assert rel_err(out, expect) < 1e-5
    rec = dmfx.records()[-1]
    assert rec.compiler == "inductor" and "inference" in rec.compiled and rec.fired


def test_dynamic_sequence_length_compiles_once():
    m = dmfx.models.bert_layer(hidden=32, heads=4, ffn=64, dropout=0.0).eval()
    c = torch.compile(m, backend="dmfx", options=INDUCTOR, dynamic=True)
    with torch.no_grad():
        for seq in (8, 13, 21):
            x = torch.randn(2, seq, 32)
            assert rel_err(c(x)[0], m(x)[0]) < 1e-5
    assert len(dmfx.records()) == 1


def test_an_inductor_failure_runs_the_graph_as_fx(monkeypatch, caplog):
    import dmfx.inductor

    def broken(*args, **kwargs):
        raise RuntimeError("planted Inductor failure")

    monkeypatch.setattr(dmfx.inductor, "compile_graph", broken)
    m = small_model("bert").eval()
    ids = torch.randint(0, 100, (2, 8))
    with torch.no_grad(), caplog.at_level("WARNING", logger="dmfx"):
        out = torch.compile(m, backend="dmfx", options={"compiler": "inductor", "fuse": "all"})(input_ids=ids)[0]
        assert rel_err(out, m(input_ids=ids)[0]) < 1e-5
    rec = dmfx.records()[-1]
    assert rec.compiler == "fx" and rec.fired and rec.fallback is None
    assert any("Inductor failed on the inference graph" in r for r in rec.missed)
    assert "planted Inductor failure" in caplog.text and "compiler='fx'" in caplog.text


def test_a_graph_without_dropout_is_left_to_inductor_on_the_cpu():
    """fuse="auto" (the default): dmfx's fusions do not pay under Inductor without dropout on the CPU
    (bench/RESULTS.md), so the graph is Inductor's, and the record says why."""
    m = small_model("llama", lm_head=True).train()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 100, (2, 16))
    loss = torch.compile(m, backend="dmfx", options={"compiler": "inductor"})(input_ids=ids, labels=ids).loss
    loss.backward()
    expect = ref(input_ids=ids, labels=ids).loss
    expect.backward()
    assert abs(loss.item() - expect.item()) < 1e-5 * abs(expect.item())
    grads_match(m, ref)
    rec = dmfx.records()[-1]
    assert rec.fallback.startswith("left to Inductor: no dropout in this graph") and not rec.fired
    assert "fuse='all'" in rec.summary()


def test_a_cuda_graph_is_left_to_inductor_under_fuse_auto():
    """fuse="auto" on CUDA: the one whole model measured on a GPU ran slower rewritten than under
    Inductor alone (bench/RESULTS.md), so every CUDA graph, dropout or not, is Inductor's; the CPU's
    decisions are unchanged. (The decision alone: this machine has no GPU.)"""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dmfx.inductor import WHY_LEFT, WHY_LEFT_CUDA, auto_decision

    gm = make_fx(lambda x: torch.ops.aten.native_dropout(x, 0.1, True)[0] * 2)(torch.randn(4, 8))
    assert auto_decision(gm, ("cuda",), True) == (WHY_LEFT_CUDA, None)
    assert auto_decision(gm, ("cpu",), True) == (None, None)  # (dropout: rewritten on the CPU)
    plain = make_fx(lambda x: x.relu() * 2)(torch.randn(4, 8))
    assert auto_decision(plain, ("cuda",), False) == (WHY_LEFT_CUDA, None)
    assert auto_decision(plain, ("cpu",), False) == (WHY_LEFT, None)
    assert "fuse='all'" in WHY_LEFT_CUDA


def _llama_trains_as_eager_under_inductor(cfg, ids, **options):
    """A LlamaForCausalLM of `cfg` compiled by dmfx's default (Inductor; `options` besides) trains as eager
    on `ids` as labels: the loss, the logits, and every gradient through the loss plus a random cotangent on
    the logits. Returns the graph's record."""
    import transformers

    m = transformers.LlamaForCausalLM(cfg).train()
    ref = copy.deepcopy(m)
    out = torch.compile(m, backend="dmfx", options={"compiler": "inductor", "fallback": False, **options})(
        input_ids=ids, labels=ids)
    expect = ref(input_ids=ids, labels=ids)
    R = torch.randn_like(expect.logits)
    (out.loss + (out.logits * R).sum()).backward()
    (expect.loss + (expect.logits * R).sum()).backward()
    assert abs(out.loss.item() - expect.loss.item()) < 1e-5 * abs(expect.loss.item())
    assert rel_err(out.logits, expect.logits) < 1e-5
    grads_match(m, ref)
    (rec,) = dmfx.records()
    return rec


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("seq", [512, 256], ids=["long", "short"])
def test_a_graph_without_dropout_keeps_dmfxs_causal_attention_over_many_keys(seq, attn):
    """fuse="auto" on the CPU: a training graph without dropout whose eager causal attentions (under
    HF's causal mask of constants) run over at least CAUSAL_FLASH_MIN_KEYS keys (here 512) is rewritten
    for them only: each becomes dmfx's causal flash kernel, every other fusion is Inductor's, and the
    record says so; over 256 keys (and a small loss), or as the model's own causal SDPA calls (whose
    PyTorch kernel skips the masked half as well), it is left to Inductor whole. Loss, logits and
    gradients are eager's either way."""
    import transformers

    from dmfx.cuda_ops import selfcheck
    from dmfx.inductor import Scope, auto_decision, long_causal_attention

    selfcheck.passes_to_skip(["cpu"])  # (the kernels built and checked: else the graph waits for them whole)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    cfg._attn_implementation = attn
    rec = _llama_trains_as_eager_under_inductor(cfg, torch.randint(0, 64, (1, seq)))
    if seq >= 512 and attn == "eager":
        assert rec.fallback is None and rec.compiler == "inductor", rec.summary()
        assert rec.fired.get("attention") == 2, rec.fired
        assert [form for form, _ in rec.attention_forms.values()] == ["flash", "flash"], rec.attention_forms
        assert not set(rec.fired) & {"rms_norm", "rope", "glu", "qkv_attention", "cross_entropy", "aten_backward"}, rec.fired
        assert any("rewritten for its causal attention only" in m and "512 keys" in m for m in rec.missed), rec.missed
        assert traced_with_inductors_decompositions(rec)
    else:
        assert rec.fallback.startswith("left to Inductor: no dropout in this graph") and not rec.fired

    # the decision alone: a causal mask of constants over 512 keys in float32 is in scope; a mask given as
    # an input, float64, or inference is not
    from torch.fx.experimental.proxy_tensor import make_fx

    def eager(dtype, mask_input=False):
        def fn(q, mask=None):
            if mask is None:
                keep = torch.arange(512)[None, None, None, :] <= torch.arange(512)[None, None, :, None]
                mask = torch.where(keep, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))
            return torch.softmax(q @ q.transpose(-1, -2) + mask, -1) @ q
        q = torch.randn(1, 2, 512, 8, dtype=dtype)
        return make_fx(fn)(q, torch.zeros(1, 1, 512, 512, dtype=dtype)) if mask_input else make_fx(lambda q: fn(q))(q)

    assert long_causal_attention(eager(torch.float32)) == 512
    assert long_causal_attention(eager(torch.float32, mask_input=True)) is None
    assert long_causal_attention(eager(torch.float64)) is None
    assert auto_decision(eager(torch.float32), ("cpu",), True) == (None, Scope(causal_keys=512))
    assert auto_decision(eager(torch.float32), ("cpu",), False) == (None, Scope(causal_keys=512))  # (inference too)


@pytest.mark.parametrize("seq,attn", [(256, "eager"), (128, "eager"), (256, "sdpa")])
def test_an_inference_graph_without_dropout_keeps_causal_attention_from_256_keys(seq, attn):
    """fuse="auto" on the CPU in inference: a graph whose eager causal attentions (HF's causal mask of
    constants) run over at least CAUSAL_INFER_MIN_KEYS keys (256) is rewritten for them only: each
    becomes one causal attention reading no mask (PyTorch's SDPA below 512 keys, by the cost model), the
    rest is Inductor's; over 128 keys, or as the model's own SDPA calls, the graph is Inductor's whole.
    The logits are eager's either way."""
    import transformers

    from dmfx.cuda_ops import selfcheck
    from dmfx.passes.attention import CAUSAL_INFER_MIN_KEYS

    selfcheck.passes_to_skip(["cpu"])  # (the kernels built and checked: else the graph waits for them whole)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    cfg._attn_implementation = attn
    m = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, seq))
    with torch.no_grad():
        out = torch.compile(m, backend="dmfx", options={"compiler": "inductor", "fallback": False})(input_ids=ids)
        expect = m(input_ids=ids)
    assert rel_err(out.logits, expect.logits) < 1e-5
    (rec,) = dmfx.records()
    if seq >= CAUSAL_INFER_MIN_KEYS and attn == "eager":
        assert rec.fallback is None and rec.compiler == "inductor" and not rec.training, rec.summary()
        assert rec.fired.get("attention") == 2, rec.fired
        assert [form for form, _ in rec.attention_forms.values()] == ["sdpa", "sdpa"], rec.attention_forms
        assert not set(rec.fired) & {"rms_norm", "rope", "glu", "qkv_attention", "cross_entropy"}, rec.fired
        assert any("rewritten for its causal attention only" in m and f"{seq} keys" in m for m in rec.missed), rec.missed
    else:
        assert rec.fallback.startswith("left to Inductor: no dropout in this graph") and not rec.fired

    # the decision alone: bf16 scores promoted by a float32 causal mask (an autocast forward) over 256 or
    # 512 keys are not in scope (PyTorch's bf16 SDPA was slower than Inductor's chain there); over 1024 they are
    from torch.fx.experimental.proxy_tensor import make_fx

    from dmfx.inductor import long_causal_attention

    def scores_in(dtype, L):
        def fn(q):
            keep = torch.arange(L)[None, None, None, :] <= torch.arange(L)[None, None, :, None]
            mask = torch.where(keep, torch.zeros(()), torch.full((), torch.finfo(torch.float32).min))
            return torch.softmax(q @ q.transpose(-1, -2) * 0.125 + mask, -1, dtype=torch.float32)
        return make_fx(fn)(torch.randn(1, 2, L, 8, dtype=dtype))

    assert long_causal_attention(scores_in(torch.float32, 256), training=False) == 256
    assert long_causal_attention(scores_in(torch.bfloat16, 256), training=False) is None
    assert long_causal_attention(scores_in(torch.bfloat16, 512), training=False) is None
    assert long_causal_attention(scores_in(torch.bfloat16, 1024), training=False) == 1024
    assert long_causal_attention(scores_in(torch.bfloat16, 512), training=True) == 512
    assert long_causal_attention(scores_in(torch.float32, 256), training=True) is None


@pytest.mark.parametrize("vocab", [33000, 32000], ids=["large-logits", "just-below"])
def test_a_graph_without_dropout_keeps_dmfxs_loss_where_the_logits_are_large(vocab):
    """fuse="auto" on the CPU: a training graph without dropout whose loss runs over logits of at least
    dmfx.inductor.LARGE_LOGITS elements (here [32, 33000]) is rewritten for its loss only (the fused
    cross-entropy and its folded logits gradient; the rest is Inductor's), and says so; at [32, 32000]
    (just under) it is left to Inductor whole. Loss, logits and gradients are eager's either way (a
    random cotangent on the returned logits too)."""
    import transformers

    import dmfx.inductor
    from dmfx.cuda_ops import selfcheck

    selfcheck.passes_to_skip(["cpu"])  # (the kernels built and checked: else the graph waits for them whole)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    rec = _llama_trains_as_eager_under_inductor(cfg, torch.randint(0, vocab, (2, 16)))
    if vocab * 32 >= dmfx.inductor.LARGE_LOGITS:
        assert rec.fallback is None and rec.compiler == "inductor", rec.summary()
        assert rec.fired.get("cross_entropy") == 1 and rec.fired.get("fold_logits_grad") == 1, rec.fired
        # (nor the ATen backward chains of what the forward left to Inductor: SCOPE_SKIPS_BACKWARD)
        assert not set(rec.fired) & {"rms_norm", "rope", "glu", "attention", "lower_sdpa_calls", "aten_backward"}, rec.fired
        assert any("rewritten for its loss only" in m and "[32, 33000]" in m for m in rec.missed), rec.missed
        # the joint graph was traced with Inductor's decompositions (option inductor_joint): no aten.t left
        assert traced_with_inductors_decompositions(rec)
    else:
        assert rec.fallback.startswith("left to Inductor: no dropout in this graph") and not rec.fired


def traced_with_inductors_decompositions(rec):
    """Whether the forward and backward graphs of `rec` were traced with Inductor's decompositions, as
    option inductor_joint has them: no ``aten.t`` (Inductor's table makes it a ``permute``), which every
    linear layer's ATen graph has otherwise."""
    graphs = (rec.forward_graph, rec.backward_graph)
    assert all(g is not None for g in graphs), "the record holds no forward and backward graphs"
    return not any(n.target is torch.ops.aten.t.default for g in graphs for n in g.graph.nodes)


def test_option_inductor_joint_false_traces_a_scoped_joint_graph_as_dmfxs_passes_see_it():
    """Option inductor_joint=False: a graph rewritten for its loss only (aten_backward skipped) keeps
    AOTAutograd's undecomposed joint graph, without Inductor's joint-graph passes (the "auto" default
    decomposes it there: test_a_graph_without_dropout_keeps_dmfxs_loss_where_the_logits_are_large);
    it trains as eager either way, and the loss is still dmfx's."""
    import transformers

    from dmfx.cuda_ops import selfcheck

    selfcheck.passes_to_skip(["cpu"])
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=33000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    rec = _llama_trains_as_eager_under_inductor(cfg, torch.randint(0, 33000, (2, 16)), inductor_joint=False)
    assert rec.fired.get("cross_entropy") == 1 and rec.fired.get("fold_logits_grad") == 1, rec.fired
    assert not traced_with_inductors_decompositions(rec)
    with pytest.raises(ValueError, match="inductor_joint"):
        dmfx.with_options(inductor_joint="yes")


@pytest.mark.parametrize("shift", ["labels", "logits"])
def test_a_loss_over_a_shifted_copy_of_the_logits_is_left_to_inductor(shift):
    """transformers 4.x's causal-LM loss shifts the logits (``logits[..., :-1, :].contiguous()``), 5.x's
    the labels. fuse="auto" keeps dmfx's loss only where it reads the LM head's logits themselves:
    over the shifted copy it ran slower than Inductor alone (dmfx.inductor._reads_a_gemm), so that
    graph is Inductor's whole. Both give eager's loss and gradients."""
    import torch.nn.functional as F

    from dmfx.cuda_ops import selfcheck

    selfcheck.passes_to_skip(["cpu"])  # (the kernels built and checked: else the graph waits for them whole)
    V = 33000

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = torch.nn.Linear(32, 32), torch.nn.Linear(32, V, bias=False)

        def forward(self, h, labels):
            logits = self.head(torch.tanh(self.lin(h)))
            if shift == "logits":
                loss = F.cross_entropy(logits[:, :-1, :].contiguous().view(-1, V), labels[:, 1:].reshape(-1))
            else:
                shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
                loss = F.cross_entropy(logits.view(-1, V), shifted.reshape(-1))
            return loss, logits

    torch.manual_seed(0)
    m = Head()
    ref = copy.deepcopy(m)
    h, labels = torch.randn(2, 17, 32), torch.randint(0, V, (2, 17))
    loss, logits = torch.compile(m, backend="dmfx", options={"compiler": "inductor", "fallback": False})(h, labels)
    want, want_logits = ref(h, labels)
    loss.backward()
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-5 * abs(want.item()) and rel_err(logits, want_logits) < 1e-5
    grads_match(m, ref)
    (rec,) = dmfx.records()
    if shift == "labels":
        assert rec.fallback is None and rec.fired.get("cross_entropy") == 1, rec.summary()
    else:
        assert rec.fallback.startswith("left to Inductor: no dropout in this graph") and not rec.fired, rec.summary()


def test_an_evaluation_loss_over_large_logits_is_left_to_inductor():
    """The same large loss in an evaluation step (no gradient): the fused loss's gain is its backward's,
    and its forward alone is no faster than Inductor's, so the graph stays Inductor's whole."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=33000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    m = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 33000, (2, 16))
    with torch.no_grad():
        loss = torch.compile(m, backend="dmfx", options={"compiler": "inductor"})(input_ids=ids, labels=ids).loss
        expect = m(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - expect.item()) < 1e-5 * abs(expect.item())
    (rec,) = dmfx.records()
    assert rec.fallback.startswith("left to Inductor: no dropout in this graph") and not rec.fired, rec.summary()


@pytest.mark.parametrize("case", ["transposed", "channels-last", "repeated", "two", "promoted"])
def test_cats_decomposition_gives_eager_values_and_layout(case):
    """dmfx's decomposition of ``cat`` (Inductor's, for the joint graph and the re-trace of each graph it
    compiles) gives eager's values, dtype and strides: a lone input left after a legacy empty one is
    dropped (HF's DynamicCache, its rotary embedding) is copied into eager's memory format, not its own;
    a repeated input is expanded, never concatenated."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dmfx.inductor import decompositions

    x = torch.randn(2, 3, 4, 5)
    fn, arg = {
        "transposed": (lambda a: torch.cat([torch.empty(0), a], -2), x.transpose(1, 2)),
        "channels-last": (lambda a: torch.cat([torch.empty(0), a], 1), x.to(memory_format=torch.channels_last)),
        "repeated": (lambda a: torch.cat([a, a], -1), x.transpose(1, 2)),
        "two": (lambda a: torch.cat([a, torch.empty(0), a * 2], 0), x.transpose(1, 2)),
        "promoted": (lambda a: torch.cat([torch.empty(0, dtype=torch.float64), a], -1), x.transpose(1, 2)),
    }[case]
    gm = make_fx(fn, decomposition_table=decompositions())(arg)
    out, expect = gm(arg), fn(arg)
    assert torch.equal(out, expect) and out.dtype == expect.dtype and out.stride() == expect.stride(), \
        (out.stride(), expect.stride())
    if case == "repeated":
        assert not any(n.target is torch.ops.aten.cat.default for n in gm.graph.nodes), gm.code


@pytest.mark.parametrize("joint", ["auto", True], ids=["retraced", "inductor-joint"])
def test_full_rotary_under_autocast_compiles_with_inductor(joint):
    """HF's rope with rotary over the whole head (Phi-3) concatenates the rotated half with an empty
    tensor. Inductor's cat decomposition drops the empty one and clones the other with its layout, where
    the graph's later view expected eager's contiguous cat: under bf16 autocast Inductor could not compile
    the graph (it ran as FX, or raised with fallback=False). dmfx's decompositions give the clone eager's
    layout (inductor._cat_as_eager), in its re-trace of each graph and in the joint graph AOTAutograd
    traces with them (option inductor_joint)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                                  intermediate_size=128, vocab_size=128, pad_token_id=0, use_cache=False,
                                  attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    cfg._attn_implementation = "eager"
    m = transformers.Phi3Model(cfg).train()
    ref = copy.deepcopy(m)
    ids = torch.randint(3, 128, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(m, backend="dmfx", options={**INDUCTOR, "inductor_joint": joint})(
            input_ids=ids).last_hidden_state
        expect = ref(input_ids=ids).last_hidden_state
    R = torch.randn(expect.shape)
    (out.float() * R).sum().backward()
    (expect.float() * R).sum().backward()
    assert rel_err(out.float(), expect.float()) < 2e-2
    grads_match(m, ref, tol=2e-2)
    (rec,) = dmfx.records()
    assert rec.compiler == "inductor" and rec.fallback is None, rec.summary()


def test_a_graph_with_dropout_is_fused_under_inductor_and_reproducible():
    m = dmfx.models.bert_layer(hidden=64, heads=4, ffn=128, dropout=0.1).train()
    x = torch.randn(2, 16, 64, requires_grad=True)
    c = torch.compile(m, backend="dmfx", options={"compiler": "inductor", "fallback": False})
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        out = c(x)[0]
        out.sum().backward()
        outs.append((out.detach(), x.grad.clone()))
        x.grad = None
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    rec = dmfx.records()[-1]
    assert rec.fallback is None and rec.compiler == "inductor"
    assert {"bias_dropout_residual_norm", "attention"} <= set(rec.fired)
    m.eval()  # dropout off: the same layer's compiled output equals eager's
    with torch.no_grad():
        c_eval = torch.compile(m, backend="dmfx", options={"compiler": "inductor", "fuse": "all"})
        assert rel_err(c_eval(x)[0], m(x)[0]) < 1e-5


@pytest.mark.parametrize("joint", ["auto", True], ids=["retraced", "inductor-joint"])
def test_a_dropout_no_pass_absorbs_compiles_under_inductor(joint):
    """A native_dropout left in the graph (here: every dropout pass skipped; on CUDA, attention dropout
    where attention stays PyTorch's) decomposes to aten.rand, which Inductor's inner compiler takes only
    after its replace_random pass (found on the first GPU run: a LoweringException); with option
    inductor_joint, Inductor's joint-graph passes replace it in the joint graph (under the graph's fake
    mode, as compile_fx runs them: without it they raised). About p of the elements are dropped, the
    kept ones scaled by 1/(1-p), and the backward uses the forward's mask."""
    from dmfx.passes import PIPELINE

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.drop = torch.nn.Linear(64, 64), torch.nn.Dropout(0.5)

        def forward(self, x):
            h = self.lin(x)
            return self.drop(h) * 3 + 1, h

    m = Block().train()
    x = torch.randn(8, 32, 64, requires_grad=True)
    c = torch.compile(m, backend="dmfx", options={**INDUCTOR, "skip": [p for p in PIPELINE if "dropout" in p],
                                                  "inductor_joint": joint})
    out, h = c(x)
    R = torch.randn_like(out)
    (out * R).sum().backward()
    rec = dmfx.records()[-1]
    assert rec.fallback is None and rec.compiler == "inductor", rec.summary()
    kept = out != 1
    assert 0.45 < kept.float().mean().item() < 0.55
    assert rel_err(out, torch.where(kept, h * 6 + 1, torch.ones_like(h))) < 1e-6
    g = R * kept * 6  # d out / d h
    assert rel_err(x.grad, g @ m.lin.weight) < 1e-5
    assert rel_err(m.lin.weight.grad, g.reshape(-1, 64).T @ x.detach().reshape(-1, 64)) < 1e-5


def test_a_graph_dmfx_cannot_lower_is_compiled_by_inductor():
    """Under compiler="inductor", a graph dmfx cannot lower (here a no_grad region that updates a
    parameter in place, in training) is still compiled by Inductor, not run op by op: the first GPU
    run had a LLaMA step at 0.47x Inductor because its graph ran eagerly."""
    w = torch.nn.Parameter(torch.randn(16))

    def f(x):
        with torch.no_grad():
            w.mul_(0.5)
        return torch.nn.functional.gelu(x * w) * 2

    x = torch.randn(4, 16)
    w0 = w.detach().clone()
    got = torch.compile(f, backend="dmfx", options={"compiler": "inductor"})(x)
    got.sum().backward()
    w1 = w0 * 0.5
    assert torch.equal(w.detach(), w1) and rel_err(got, torch.nn.functional.gelu(x * w1) * 2) < 1e-6
    rec = dmfx.records()[-1]
    assert rec.fallback.startswith("left to Inductor: could not lower") and rec.compiler == "inductor", rec.fallback


def test_compiler_option_and_env_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="option 'compiler' must be 'inductor' or 'fx'"):
        dmfx.Options.from_user({"compiler": "tvm"})
    with pytest.raises(ValueError, match="option 'fuse' must be 'auto' or 'all'"):
        dmfx.Options.from_user({"fuse": "some"})
    monkeypatch.setenv("DMFX_COMPILER", "nvfuser")
    with pytest.raises(ValueError, match="env DMFX_COMPILER must be"):
        dmfx.Options.from_user({})
    monkeypatch.setenv("DMFX_COMPILER", "")
    assert dmfx.Options.from_user({}).compiler == "inductor"
    monkeypatch.setenv("DMFX_FUSE", "some")
    with pytest.raises(ValueError, match="env DMFX_FUSE must be 'auto' or 'all', got 'some'"):
        dmfx.Options.from_user({})
    monkeypatch.setenv("DMFX_FUSE", "ALL")
    assert dmfx.Options.from_user({}).fuse == "all" and dmfx.Options.from_user({"fuse": "auto"}).fuse == "auto"
    monkeypatch.setenv("DMFX_FUSE", "")
    assert dmfx.Options.from_user({}).fuse == "auto"


def test_max_autotune_mode_turns_on_tuning():
    from dmfx.backend import _apply_mode

    opts = _apply_mode(dmfx.Options.from_user({}), "max-autotune")
    assert opts.tune and opts.max_autotune
    assert _apply_mode(dmfx.Options.from_user({}), "reduce-overhead") == dmfx.Options.from_user({"cudagraphs": True})


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_module_that_writes_its_buffers_under_inductor(training):
    """Input writes (dmfx/functionalize.py's epilogue) reach Inductor as copy_ into graph inputs."""
    from tests.test_mutation import RunningStats

    with torch.no_grad():
        for p in (ref := RunningStats()).parameters():
            p.normal_()
    mine = copy.deepcopy(ref)
    compiled = torch.compile(mine, backend="dmfx", options=INDUCTOR)
    for _ in range(2):
        x = torch.randn(16, 48, requires_grad=training)
        with torch.set_grad_enabled(training):
            want, got = ref(x), compiled(x)
        assert rel_err(mine.mean, ref.mean) < 1e-6 and torch.equal(mine.steps, ref.steps)
        assert rel_err(got, want) < 1e-5
        if training:
            cot = torch.randn(16, 48)
            assert rel_err(torch.autograd.grad((got * cot).sum(), x)[0], torch.autograd.grad((want * cot).sum(), x)[0]) < 1e-5
    (record,) = dmfx.records()
    assert record.fallback is None and record.compiler == "inductor" and record.fired.get("layer_norm") == 1


@pytest.mark.parametrize("fuse", ["auto", "all"])
def test_a_static_cache_decode_step_under_inductor(fuse):
    """The decode step of HF's static cache (index_copy_ into the cache at cache_position): left to
    Inductor whole by default (no dropout), or dmfx's fusions inside Inductor's code with fuse="all";
    both match the Dynamo graph run op by op and write the same cache rows."""
    from tests.test_mutation import prefilled_static_cache

    model, prompt_len, prefilled = prefilled_static_cache()
    batch = 2
    with torch.no_grad():
        ref_cache, cache = prefilled(), prefilled()
        reference = torch.compile(model.forward, backend="eager")
        compiled = torch.compile(model.forward, backend="dmfx", options={**INDUCTOR, "fuse": fuse})
        for pos in (prompt_len, prompt_len + 1):
            ids = torch.randint(0, 256, (batch, 1))
            kw = dict(input_ids=ids, cache_position=torch.tensor([pos]), use_cache=True)
            assert rel_err(compiled(cache=cache, **kw).logits, reference(cache=ref_cache, **kw).logits) < 1e-5
    for mine, ref in zip(cache.layers, ref_cache.layers):
        assert rel_err(mine.keys, ref.keys) < 1e-6 and rel_err(mine.values, ref.values) < 1e-6
    (record,) = dmfx.records()
    if fuse == "auto":
        assert record.fallback.startswith("left to Inductor")
    else:
        assert record.fallback is None and record.compiler == "inductor" and record.fired.get("rope", 0) >= 2
