"""The compile cache (dmfx/graph_cache.py): under compiler="inductor" dmfx's compiled graphs go
through AOTAutograd's cache, keyed also by dmfx's source fingerprint and options. A second compile
of the same graph is a hit that gives the same answers (and the same record); a changed option, a
changed source, or the option off is never a hit."""

import contextlib
import copy
import math
import uuid

import pytest
import torch
import transformers

import dmfx
from dmfx import graph_cache
from dmfx.options import Options
from tests.conftest import compilers_raising, rel_err

# fuse="all": dmfx rewrites the graph (dropout 0, so eager is the exact reference) and Inductor runs it
INDUCTOR = {"compiler": "inductor", "fuse": "all", "fallback": False}
# the users' default (fuse="auto" named, whatever DMFX_FUSE says: these tests are about its decisions)
AUTO = {"compiler": "inductor", "fuse": "auto"}


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """A fingerprint no earlier run has used (so the first compile here is a miss), graph records in a
    temp dir, and PyTorch's caches on (whatever the environment says)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    salted = graph_cache.fingerprint() + uuid.uuid4().hex
    monkeypatch.setattr(graph_cache, "fingerprint", lambda: salted)
    monkeypatch.setattr(graph_cache, "_records_dir", lambda: tmp_path / "graph_records")
    monkeypatch.setattr(graph_cache, "_lowered_dir", lambda: tmp_path / "lowered_graphs")
    monkeypatch.setattr(graph_cache, "_verdicts_dir", lambda: tmp_path / "float_verdicts")
    monkeypatch.setattr(graph_cache, "_float_verdicts", {})
    with functorch_config.patch(enable_autograd_cache=True), inductor_config.patch(fx_graph_cache=True), \
            torch.compiler.config.patch(force_disable_caches=False):
        yield tmp_path


def mlm(dropout: float = 0.0):
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).train()


def train_step(model, options):
    """One compiled training step with a random cotangent on the logits: (loss, logits, grads, record)."""
    torch._dynamo.reset()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    c = torch.compile(model, backend="dmfx", options=options)
    out = c(input_ids=ids, labels=ids)
    R = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(2))
    (out.loss + (out.logits * R).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads, dmfx.records()[-1]


def assert_grads_close(got, want, tol):
    scale = max(g.abs().max().item() for g in want.values())
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).abs().max().item() / scale < tol, name


def eager_step(model):
    """train_step's step in eager on a copy of `model`: (its output, its parameters' gradients)."""
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    out = eager(input_ids=ids, labels=ids)
    R = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(2))
    (out.loss + (out.logits * R).sum()).backward()
    return out, {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}


def test_second_compile_is_a_hit_with_the_same_answers_and_record(fresh_cache):
    base = mlm()
    out, grads_e = eager_step(base)

    loss1, logits1, grads1, rec1 = train_step(copy.deepcopy(base), INDUCTOR)
    assert rec1.cache == "miss" and rec1.fallback is None
    assert rec1.forward_graph is not None and rec1.backward_graph is not None
    assert {"bias_dropout_residual_norm", "cross_entropy"} <= set(rec1.fired)
    backward_fusions = {"fold_bias_grads", "accumulate_embedding_grad"} & set(rec1.fired)
    assert backward_fusions, rec1.fired  # (the backward passes' counts are what a hit must read back)
    assert list((fresh_cache / "graph_records").glob("*.json"))
    # AOTAutograd traced the graph as the cache keeps it; what each fused node absorbed still reached
    # the compiled forward graph (the log's bytes saved, dmfx.explain)
    from dmfx.observability import saved_bytes

    assert saved_bytes(rec1.forward_graph) > 0

    loss2, logits2, grads2, rec2 = train_step(copy.deepcopy(base), INDUCTOR)
    assert rec2.cache == "hit", rec2.summary()
    assert not rec1.lowered_from_cache and rec2.lowered_from_cache  # (the Dynamo graph was not lowered again)
    assert rec2.bytes_saved == rec1.bytes_saved > 0
    assert "from the compile cache" in rec2.summary()
    assert rec2.fired == rec1.fired and rec2.replaced == rec1.replaced and rec2.compiled == rec1.compiled
    assert rec2.forward_graph is None and rec2.rewritten_graph is not None
    # the cached code is the code compiled before: the same answers, and eager's
    assert torch.allclose(loss2, loss1, rtol=0, atol=1e-6) and torch.allclose(logits2, logits1, rtol=0, atol=1e-6)
    assert_grads_close(grads2, grads1, 1e-6)
    assert rel_err(loss2, out.loss) < 1e-5 and rel_err(logits2, out.logits) < 1e-5
    assert_grads_close(grads2, grads_e, 1e-4)


def test_inference_graph_is_cached_too(fresh_cache):
    base = mlm().eval()
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        expect = base(input_ids=ids).logits
        results = []
        for _ in range(2):
            torch._dynamo.reset()
            results.append((torch.compile(base, backend="dmfx", options=INDUCTOR)(input_ids=ids).logits, dmfx.records()[-1]))
    (first, rec1), (second, rec2) = results
    assert (rec1.cache, rec2.cache) == ("miss", "hit")
    assert rec1.inference_graph is not None and "inference" in rec2.compiled
    assert torch.equal(first, second) and rel_err(second, expect) < 1e-5


def test_an_option_the_forward_graph_does_not_show_still_changes_the_key(fresh_cache):
    """The partitioner and the backward passes act inside AOTAutograd, after its cache key is taken
    from the forward passes' graph: only dmfx's tag tells these compiles apart."""
    base = mlm()
    *_, rec1 = train_step(copy.deepcopy(base), INDUCTOR)
    *_, rec2 = train_step(copy.deepcopy(base), {**INDUCTOR, "skip": ["fold_bias_grads"]})
    *_, rec3 = train_step(copy.deepcopy(base), {**INDUCTOR, "partitioner": "default"})
    assert (rec1.cache, rec2.cache, rec3.cache) == ("miss", "miss", "miss")
    assert "fold_bias_grads" in rec1.fired and "fold_bias_grads" not in rec2.fired


def test_changed_sources_are_a_new_key(fresh_cache, monkeypatch):
    base = mlm()
    *_, rec1 = train_step(copy.deepcopy(base), INDUCTOR)
    salted = graph_cache.fingerprint() + "a pass changed"
    monkeypatch.setattr(graph_cache, "fingerprint", lambda: salted)
    *_, rec2 = train_step(copy.deepcopy(base), INDUCTOR)
    assert (rec1.cache, rec2.cache) == ("miss", "miss")


def test_option_off_and_fx_compiler_never_cache(fresh_cache):
    base = mlm()
    assert not graph_cache.enabled(Options(compiler="fx"))
    assert not graph_cache.enabled(Options(compiler="inductor", cache=False))
    with pytest.raises(ValueError, match="'cache' must be True or False"):
        Options.from_user({"cache": "yes"})
    recs = [train_step(copy.deepcopy(base), {**INDUCTOR, "cache": False})[-1] for _ in range(2)]
    assert [r.cache for r in recs] == ["", ""]
    assert all(r.forward_graph is not None for r in recs)


def test_a_hit_without_its_record_file_says_so(fresh_cache):
    base = mlm()
    *_, rec1 = train_step(copy.deepcopy(base), INDUCTOR)
    for f in (fresh_cache / "graph_records").glob("*.json"):
        f.unlink()
    loss, logits, grads, rec2 = train_step(copy.deepcopy(base), INDUCTOR)
    assert rec2.cache == "hit"
    assert any("without the record" in m for m in rec2.missed)
    assert set(rec2.fired) < set(rec1.fired)  # (the forward passes' counts only)


def test_two_dmfx_cache_dirs_sharing_one_inductor_cache_do_not_share_entries(fresh_cache, monkeypatch):
    """Two dmfx cache directories (two virtual environments, a changed DMFX_CACHE_DIR) over one Inductor
    cache: each keys its own entries, so a hit always has the record its compile wrote (before, the
    second directory got the first one's entries as hits whose records it did not have)."""
    base = mlm()
    *_, rec1 = train_step(copy.deepcopy(base), INDUCTOR)
    monkeypatch.setattr(graph_cache, "_records_dir", lambda: fresh_cache / "other" / "graph_records")
    monkeypatch.setattr(graph_cache, "_lowered_dir", lambda: fresh_cache / "other" / "lowered_graphs")
    *_, rec2 = train_step(copy.deepcopy(base), INDUCTOR)
    assert rec1.cache == rec2.cache == "miss"
    assert rec2.fired == rec1.fired and not any("without the record" in m for m in rec2.missed)
    *_, rec3 = train_step(copy.deepcopy(base), INDUCTOR)
    assert rec3.cache == "hit" and rec3.fired == rec1.fired


def test_fingerprint_hashes_every_source_file(monkeypatch, tmp_path):
    (tmp_path / "sub").mkdir()
    kernel = tmp_path / "sub" / "kernel.cpp"
    kernel.write_text("int f() { return 1; }")
    (tmp_path / "notes.txt").write_text("not a source")
    monkeypatch.setattr(graph_cache, "_package_dirs", lambda: [tmp_path])
    graph_cache.fingerprint.cache_clear()
    try:
        first = graph_cache.fingerprint()
        (tmp_path / "notes.txt").write_text("still not a source")
        graph_cache.fingerprint.cache_clear()
        assert graph_cache.fingerprint() == first
        kernel.write_text("int f() { return 2; }")
        graph_cache.fingerprint.cache_clear()
        assert graph_cache.fingerprint() != first
    finally:
        graph_cache.fingerprint.cache_clear()


def test_graphs_that_differ_only_in_a_tensor_constant_do_not_share_an_entry(fresh_cache):
    """The lowered graph holds a literal tensor as an attribute, which AOTAutograd's key hashes by
    metadata only: dmfx's tag hashes its values."""
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    caches = []
    for vals in ([1.0, 2.0, 3.0], [5.0, 6.0, 7.0]):
        def f(x, w, vals=vals):
            y = torch.nn.functional.layer_norm(x, (3,), w, None)
            return torch.nn.functional.gelu(y * torch.tensor(vals))

        torch._dynamo.reset()
        out = torch.compile(f, backend="dmfx", options=INDUCTOR)(x, w)
        caches.append(dmfx.records()[-1].cache)
        assert rel_err(out, f(x, w)) < 1e-6
    assert caches == ["miss", "miss"]


def test_constants_digest_reads_values():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    gm.register_buffer("c", torch.tensor([1.0, 2.0]), persistent=False)  # (a non-parameter tensor)
    graph = gm.graph
    with graph.inserting_before(next(iter(graph.nodes))):
        graph.get_attr("c")
    gm.recompile()
    first = graph_cache.constants_digest(gm)
    gm.c.add_(1)
    second = graph_cache.constants_digest(gm)
    assert second != first
    gm.weight.data.add_(1)  # (parameters are inputs at run time: not part of the digest)
    assert graph_cache.constants_digest(gm) == second


def test_a_dynamic_shape_graph_hit_serves_other_lengths(fresh_cache):
    base = mlm()
    recs = []
    for _ in range(2):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        c = torch.compile(model, backend="dmfx", options=INDUCTOR, dynamic=True)
        for seq in (12, 20):
            ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(seq))
            out = c(input_ids=ids, labels=ids)
            expect = copy.deepcopy(base)(input_ids=ids, labels=ids)
            assert rel_err(out.logits, expect.logits) < 1e-5 and rel_err(out.loss, expect.loss) < 1e-5
            out.loss.backward()
        recs.append(dmfx.records()[-1])
    assert len([r for r in dmfx.records()]) == 2  # (one graph, no recompile per length)
    assert [r.cache for r in recs] == ["miss", "hit"]
    assert not any(r.lowered_from_cache for r in recs)  # (symbolic shapes: the lowering is not kept)


def test_a_kept_lowered_graph_compiled_afresh_gives_the_same_answers(fresh_cache):
    """The lowered graph comes from the cache but AOTAutograd's entry does not (here: an Inductor
    setting in its key changed): the kept graph is traced, partitioned and compiled again."""
    from torch._inductor import config as inductor_config

    base = mlm()
    loss1, logits1, grads1, rec1 = train_step(copy.deepcopy(base), INDUCTOR)
    with inductor_config.patch(comment_origin=not inductor_config.comment_origin):
        loss2, logits2, grads2, rec2 = train_step(copy.deepcopy(base), INDUCTOR)
    assert rec2.lowered_from_cache and rec2.cache == "miss"
    assert rec2.forward_graph is not None and rec2.fired == rec1.fired
    assert rel_err(loss2, loss1) < 1e-6 and rel_err(logits2, logits1) < 1e-6
    assert_grads_close(grads2, grads1, 1e-5)


def test_a_scoped_graph_compiled_afresh_from_its_kept_lowering_skips_the_scopes_backward_passes(fresh_cache):
    """fuse="auto" rewrites a LLaMA graph for its loss only (dmfx/inductor.py Scope): its backward skips
    aten_backward, which would make dmfx kernels (Inductor fusion barriers) of the ATen backward chains
    Inductor owns. Where the lowered graph comes from the cache and AOTAutograd's entry does not, the
    backward is derived and rewritten again: it skips them as the first compile did."""
    from torch._inductor import config as inductor_config

    from dmfx.cuda_ops import selfcheck

    selfcheck.passes_to_skip(["cpu"])  # (the kernels built and checked: else the graph waits for them whole)
    cfg = transformers.LlamaConfig(vocab_size=33000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 33000, (1, 32), generator=torch.Generator().manual_seed(1))

    def step():
        torch._dynamo.reset()
        m = copy.deepcopy(base)
        out = torch.compile(m, backend="dmfx", options=AUTO)(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}, dmfx.records()[-1]

    loss1, grads1, rec1 = step()
    with inductor_config.patch(comment_origin=not inductor_config.comment_origin):
        loss2, grads2, rec2 = step()
    assert rec2.lowered_from_cache and rec2.cache == "miss"
    for rec in (rec1, rec2):
        assert any("rewritten for its loss only" in m for m in rec.missed), rec.missed
        assert "aten_backward" in rec.scope_skip and "aten_backward" not in rec.fired, rec.fired
        assert rec.fired.get("fold_logits_grad") == 1, rec.fired
        assert "attention_softmax_backward" not in str(rec.backward_graph.code)
    assert rel_err(loss2, loss1) < 1e-6
    assert_grads_close(grads2, grads1, 1e-5)


def test_a_graph_left_to_inductor_whole_is_remembered(fresh_cache):
    """fuse="auto" on the CPU leaves a graph without dropout to Inductor: a later compile does not
    lower it again to find that out."""
    base = mlm()
    recs, outs = [], []
    for _ in range(2):
        *_, logits, _, rec = train_step(copy.deepcopy(base), AUTO)
        recs.append(rec)
        outs.append(logits)
    assert all(r.fallback and r.fallback.startswith("left to Inductor") for r in recs)
    assert [r.lowered_from_cache for r in recs] == [False, True]
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-6)


def _two_processes_of_a_norm_after_a_gemm() -> list:
    """layer_norm(x @ w) * 2 compiled under compiler="inductor", fuse="all" in two "processes" (as far
    as Dynamo and dmfx's memory go), each answer checked against eager's: the two graphs' records."""
    f = lambda x, w: torch.nn.functional.layer_norm(x @ w, (w.shape[-1],)) * 2  # noqa: E731
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    recs = []
    for _ in range(2):
        torch._dynamo.reset()
        got = torch.compile(f, backend="dmfx", options={"compiler": "inductor", "fuse": "all"})(x, w)
        assert rel_err(got, f(x, w)) < 1e-6
        recs.append(dmfx.records()[-1])
    return recs


def test_a_rewritten_graph_aotautograd_cannot_compile_is_remembered(fresh_cache, monkeypatch):
    """Where AOTAutograd's step fails on dmfx's rewritten graph (made to here: a forward compiler that
    raises), the graph is left to Inductor whole, and a later process goes there at once instead of
    reading the lowered graph back and failing again; its answers are Inductor's."""
    from dmfx import backend

    attempts = []
    monkeypatch.setattr(backend, "_compiler", compilers_raising(
        lambda kind: attempts.append(kind) or RuntimeError(f"no {kind} compiler today")))
    recs = _two_processes_of_a_norm_after_a_gemm()
    assert attempts == ["forward"], attempts
    assert [r.lowered_from_cache for r in recs] == [False, True]
    for r in recs:
        assert r.fallback.startswith("left to Inductor: AOTAutograd could not compile the rewritten graph: "
                                     "RuntimeError: no forward compiler today"), r.fallback
        assert not r.fired, r.fired


def test_a_graph_that_cannot_be_lowered_is_remembered_as_inductors(fresh_cache, monkeypatch):
    """Where the lowering to a functional ATen graph fails (here with a bare ``assert``'s AssertionError,
    which has no message), the graph is left to Inductor whole and the log says why; a later process
    goes there at once instead of failing the lowering again; its answers are Inductor's."""
    from dmfx import backend

    def lower_fails(*args, **kwargs):
        attempts.append(1)
        raise AssertionError()

    attempts = []
    monkeypatch.setattr(backend, "lower_to_aten", lower_fails)
    recs = _two_processes_of_a_norm_after_a_gemm()
    assert attempts == [1], attempts
    assert [r.lowered_from_cache for r in recs] == [False, True]
    for r in recs:
        assert r.fallback == "left to Inductor: could not lower to a functional ATen graph: AssertionError: ", r.fallback
        assert r.compiler == "inductor" and not r.fired, (r.compiler, r.fired)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_dynamic_shape_graph_left_to_inductor_whole_is_remembered(fresh_cache, monkeypatch, dropout):
    """Under symbolic shapes only the decision to leave a graph to Inductor whole is kept (the lowered
    graph never is): a later process does not lower the graph again, and its answers are Inductor's."""
    from dmfx import backend

    lowerings = []
    lower = backend.lower_to_aten
    monkeypatch.setattr(backend, "lower_to_aten", lambda *a, **k: lowerings.append(1) or lower(*a, **k))
    base = mlm(dropout).eval() if dropout == 0.0 else mlm(dropout)
    recs, counts = [], []
    for _ in range(2):  # (two processes, as far as Dynamo and dmfx's memory go)
        torch._dynamo.reset()
        lowerings.clear()
        model = copy.deepcopy(base)
        c = torch.compile(model, backend="dmfx", options=AUTO, dynamic=True)
        for seq in (12, 20):
            ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(seq))
            out = c(input_ids=ids)
            if dropout == 0.0:
                assert rel_err(out.logits, copy.deepcopy(base)(input_ids=ids).logits) < 1e-5
        recs.append(dmfx.records()[-1])
        counts.append(len(lowerings))
    if dropout == 0.0:
        assert all(r.fallback and r.fallback.startswith("left to Inductor") for r in recs)
        # (Dynamo traces the forward twice, the first trace ending in Inductor's request to specialize a
        # float: both decisions are kept)
        assert [r.lowered_from_cache for r in recs] == [False, True] and counts[0] >= 1 and counts[1] == 0
    else:  # (dmfx rewrites it: lowered again in every process)
        assert not any(r.fallback for r in recs)
        assert [r.lowered_from_cache for r in recs] == [False, False] and counts[1] == counts[0] >= 1


def test_lowered_key_declines_what_it_cannot_see():
    opts = Options(compiler="inductor")
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))  # (its weight and bias are graph attributes)
    assert graph_cache.lowered_key(gm, [torch.randn(3, 2)], opts) is None

    class RunningStat(torch.nn.Module):  # (a buffer the graph writes, as BatchNorm's running stats)
        def __init__(self):
            super().__init__()
            self.register_buffer("stat", torch.zeros(2))

        def forward(self, x):
            self.stat.add_(x.mean(0))
            return x + self.stat

    stat = torch.fx.symbolic_trace(RunningStat())
    assert graph_cache.lowered_key(stat, [torch.randn(3, 2)], opts) is None

    def f(x):
        return torch.nn.functional.gelu(x) * 2

    plain = torch.fx.symbolic_trace(f)
    key = graph_cache.lowered_key(plain, [torch.randn(3, 2)], opts)
    assert key is not None
    assert graph_cache.whole_graph_key(plain, [torch.randn(3, 2)], opts) is None  # (static shapes: lowered_key's)
    assert graph_cache.lowered_key(plain, [torch.randn(3, 3)], opts) != key  # shapes
    assert graph_cache.lowered_key(plain, [torch.randn(3, 2).t()], opts) != key  # strides
    assert graph_cache.lowered_key(plain, [torch.randn(3, 2, requires_grad=True)], opts) != key
    assert graph_cache.lowered_key(plain, [torch.randn(3, 2)], Options(compiler="inductor", attention="gemm")) != key
    with torch.no_grad():
        assert graph_cache.lowered_key(plain, [torch.randn(3, 2)], opts) != key
    x = torch.randn(4, 2)
    two = torch.fx.symbolic_trace(lambda a, b: a + b)
    assert graph_cache.lowered_key(two, [x, x], opts) != graph_cache.lowered_key(two, [x, x.clone()], opts)  # aliasing


def gpt2_with_dropout():
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.3,
                                  embd_pdrop=0.3, attn_pdrop=0.3)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


@pytest.mark.parametrize("options", [AUTO, INDUCTOR], ids=["default", "fuse-all"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_dropout_draws_a_fresh_mask_on_every_call_on_a_miss_and_on_a_hit(fresh_cache, options, family):
    """The kept graph must keep the seed's randint a call. (A GraphModule's own pickling traces its
    code again, which ran the randint once and kept the seed as a constant: every step of every
    process reused one dropout mask.)"""
    model = mlm(dropout=0.3) if family == "bert" else gpt2_with_dropout()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    for expect in ("miss", "hit"):
        torch._dynamo.reset()
        before = len(dmfx.records())
        c = torch.compile(model, backend="dmfx", options=options)
        first = c(input_ids=ids, labels=ids)
        (first.loss + first.logits.sum()).backward()  # (AOTAutograd keeps its entry once the backward compiled)
        # (GPT-2's loss is a graph of its own, which fuse="auto" leaves to Inductor: no dropout in it)
        recs = [r for r in dmfx.records()[before:] if r.fallback is None]
        assert recs and all(r.cache == expect for r in recs), [r.summary() for r in dmfx.records()[before:]]
        assert all(r.lowered_from_cache == (expect == "hit") for r in recs)
        fusion = "bias_dropout_residual_norm" if family == "bert" else "dropout"
        assert any(fusion in r.fired for r in recs), [r.fired for r in recs]
        with torch.no_grad():
            a, b = c(input_ids=ids).logits, c(input_ids=ids).logits
            torch.manual_seed(7)
            s1 = c(input_ids=ids).logits
            torch.manual_seed(7)
            s2 = c(input_ids=ids).logits
        assert not torch.equal(a, b), f"{expect}: two calls dropped the same elements"
        assert torch.equal(s1, s2), f"{expect}: torch.manual_seed does not reproduce a call"


def test_the_kept_graph_is_the_graph_node_for_node():
    """dump_graph keeps calls that take no tensor (randint, zeros) as calls; same_graph tells a graph
    read back as something else (here: the GraphModule's own pickling, which made them constants)."""
    import pickle

    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    seed = g.call_function(aten.randint.low, (0, 2**62, [2]), {"dtype": torch.int64, "device": torch.device("cpu")})
    zeros = g.call_function(aten.zeros.default, ([3],), {"dtype": torch.float32, "device": torch.device("cpu")})
    g.output((g.call_function(aten.add.Tensor, (x, zeros)), seed))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)

    back = graph_cache.load_graph(graph_cache.dump_graph(gm))
    assert graph_cache.same_graph(gm, back) is None
    assert [n.target for n in back.graph.nodes if n.op == "call_function"][:2] == [aten.randint.low, aten.zeros.default]
    s1, s2 = back(torch.zeros(3))[1], back(torch.zeros(3))[1]
    assert not torch.equal(s1, s2)

    retraced = pickle.loads(pickle.dumps(gm))  # (the GraphModule's own pickling)
    assert graph_cache.same_graph(gm, retraced) == "its code differs"


FLOAT_PROGRAMS = {  # a Python float `s` a lowering specializes on (pytorch/pytorch#194976, #197889)
    "layer_norm(x * s) + floor(s)": lambda x, s: torch.nn.functional.layer_norm(x * s, (8,)) + math.floor(s),
    "rms_norm(x * s, eps=s)": lambda x, s: torch.nn.functional.rms_norm(x * s, (8,), eps=s * 1e-1),
}


@pytest.mark.parametrize("options", [{}, {"fuse": "all"}], ids=["default", "fuse-all"])
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic-dynamic", "dynamic"])
@pytest.mark.parametrize("program", list(FLOAT_PROGRAMS))
def test_a_python_float_input_is_never_served_from_a_cache(fresh_cache, program, dynamic, options):
    """A float that changes between calls becomes a graph input (automatic dynamic, or dynamic=True),
    and lowering specializes on its value, while every cache's key is the same graph: PyTorch's caches
    then serve an earlier value's graph (with Inductor alone this test's programs give wrong outputs
    and gradients on torch 2.11-2.14), and so would dmfx's. Such a graph compiles with every cache
    off, and says so: outputs and gradients are eager's for every value, in a process whose caches
    already hold another value's graph."""
    f = FLOAT_PROGRAMS[program]
    x = torch.randn(4, 8, requires_grad=True)
    R = torch.randn(4, 8)
    for process in ("first", "later"):  # (a later process: Dynamo reset, the verdicts read from disk)
        _new_process()
        compiled = torch.compile(f, backend="dmfx", dynamic=dynamic, options={"compiler": "inductor", **options})
        for s in (0.3, 1.5, 2.5, 3.7):
            _assert_matches_eager(f, compiled, x, s, R, process)
        floats = [r for r in dmfx.records() if r.float_inputs]
        assert floats, [r.summary() for r in dmfx.records()]
        for r in floats:
            # (the first process's compile writes PyTorch's caches, reading none: graph_cache.caches_off)
            assert r.float_inputs == ("L['s']",) and r.cache in (("", "miss") if process == "first" else ("",)), \
                (r.float_inputs, r.cache)
            assert r.float_verdict != "value-free" and r.floats_uncached, r.float_verdict
            assert any(m.startswith("cache: not cached") for m in r.missed), r.missed
        assert set(graph_cache._float_verdicts.values()) <= {"specializes"}, graph_cache._float_verdicts
    assert "specializes" in graph_cache._float_verdicts.values()


def test_caches_off_keeps_only_what_was_compiled_before_a_value_was_read(fresh_cache, monkeypatch):
    """Inside caches_off (a graph with float inputs whose verdict is not "value-free") AOTAutograd's
    cache and Inductor's FX graph cache find nothing, and keep a compiled graph only where
    FloatInputs.may_save says no value was read before it: a training graph's AOTAutograd entry,
    saved after the backward compiled outside the block, with the backward's reads. Outside, both
    caches are PyTorch's own."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(fresh_cache / "inductor"))

    class Floats:  # (FloatInputs' part caches_off reads)
        key = "a verdict key"

        def __init__(self, read: bool) -> None:
            self.read = read

        def may_save(self) -> bool:
            return not self.read

    def run(floats, backward_reads=False):
        """(FX graph cache keys kept, its hits, AOTAutograd cache hits, its entries saved)"""
        torch._dynamo.reset()
        counters.clear()
        x = torch.randn(4, 8, requires_grad=True)
        with graph_cache.caches_off(floats):
            out = torch.compile(lambda x: (x.sin() * 2).cos(), backend="inductor")(x)
        if backward_reads:
            floats.read = True
        with graph_cache.caches_off(floats):  # (as dmfx's compilers do, around the backward's compile only)
            out.sum().backward()  # (AOTAutograd saves its entry after this, outside the block)
        kept = sorted((fresh_cache / "inductor").glob("fxgraph/*/*"))  # (a key each)
        return (len(kept), counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"],
                counters["aot_autograd"]["autograd_cache_saved"])

    assert run(Floats(read=True)) == (0, 0, 0, 0)  # a value read: nothing kept
    assert run(Floats(read=False), backward_reads=True) == (1, 0, 0, 0)  # the forward, not AOTAutograd's entry
    assert run(Floats(read=False)) == (2, 0, 0, 1)  # both graphs and the entry kept
    assert run(Floats(read=False)) == (2, 0, 0, 1)  # lookups find nothing (so it compiles, and saves, again)
    assert run(None)[1:3] == (2, 1)  # outside: PyTorch's caches as they are (its entry loads both graphs)
    assert run(Floats(read=True)) == (2, 0, 0, 0)


def test_an_entry_looked_up_in_caches_off_is_not_saved_once_its_verdict_is_gone():
    """AOTAutograd saves a training graph's entry after its backward compiled, outside caches_off;
    where the compile's FloatInputs is gone by then, the entry is not saved (never saved unjudged)."""
    import gc

    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    class Floats:
        key = "a verdict key"

        def may_save(self) -> bool:
            return True

    saved = []

    class Entry:  # (what PyTorch's own save calls first)
        def pre_save(self):
            saved.append(True)
            raise RuntimeError("not a real entry")

    floats = Floats()
    with graph_cache.caches_off(floats):
        assert AOTAutogradCache._lookup("an entry's key", False, False, [], {}, None) is None  # (a miss)
    del floats
    gc.collect()
    with contextlib.suppress(RuntimeError):
        AOTAutogradCache.save("an entry's key", Entry(), False)
    assert saved == []
    with contextlib.suppress(RuntimeError):
        AOTAutogradCache.save("another key", Entry(), False)  # (not looked up restricted: PyTorch's save)
    assert saved == [True]


def test_no_key_where_a_tensor_input_has_no_storage():
    """Every key names which inputs share a storage; a tensor without one (sparse) gives no key, so
    the graph is not cached (FloatInputs' key raised on it before)."""
    from dmfx.options import Options

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    sparse = torch.randn(2, 3).to_sparse()
    assert graph_cache._verdict_key(gm, [sparse], Options()) is None
    assert graph_cache.lowered_key(gm, [sparse], Options()) is None
    assert graph_cache._verdict_key(gm, [torch.randn(2, 3)], Options()) is not None
    assert graph_cache.lowered_key(gm, [torch.randn(2, 3)], Options()) is not None


def _saved_concatenations(forward: torch.fx.GraphModule) -> list[str]:
    """The forward's outputs (what it returns and saves for the backward) made by a cat, through
    transposes and views."""
    (out,) = [n for n in forward.graph.nodes if n.op == "output"]
    found = []
    for n in torch.fx.node.map_aggregate(out.args[0], lambda a: a if isinstance(a, torch.fx.Node) else None) or ():
        while isinstance(n, torch.fx.Node) and n.target in (torch.ops.aten.t.default, torch.ops.aten.view.default):
            n = n.args[0]
        if isinstance(n, torch.fx.Node) and n.target is torch.ops.aten.cat.default:
            found.append(n.name)
    return found


def test_a_cached_graph_keeps_the_stacked_weights_recomputed(fresh_cache):
    """QKV stacking tags its concatenated weight for recomputation in the backward (the min-cut
    partitioner's "recompute" node metadata), where unstack_dx then reads the three weights. The cache
    keeps that tag with the graph: AOTAutograd traces the graph as the cache keeps it, so without it
    the stacked copy was saved for the whole step (7 MB a layer at BERT-base's sizes), on a miss too,
    and unstack_dx never fired under compiler="inductor"."""
    from torch._inductor import config as inductor_config

    options = {**INDUCTOR, "stack_qkv": True, "attention": "flash"}
    base = mlm()
    out, grads_e = eager_step(base)
    first = train_step(copy.deepcopy(base), options)
    with inductor_config.patch(comment_origin=not inductor_config.comment_origin):  # (AOTAutograd's entry missed)
        again = train_step(copy.deepcopy(base), options)
    assert not first[3].lowered_from_cache and again[3].lowered_from_cache and again[3].cache == "miss"
    for loss, logits, grads, rec in (first, again):
        assert rec.fired.get("qkv_attention") == 1 and rec.fired.get("unstack_dx") == 1, rec.fired
        assert not _saved_concatenations(rec.forward_graph), (rec.cache, rec.lowered_from_cache)
        assert rel_err(loss, out.loss) < 1e-5 and rel_err(logits, out.logits) < 1e-5
        assert_grads_close(grads, grads_e, 1e-4)


def _new_process():
    """A later process, as far as Dynamo and dmfx's memory go (the float verdicts are read from disk)."""
    torch._dynamo.reset()
    graph_cache._float_verdicts.clear()
    dmfx.reset()


def _assert_matches_eager(f, compiled, x, s, R, process):
    """compiled(x, s) and its gradient for x under the random cotangent R are f's (eager's)."""
    want = f(x, s)
    (want_dx,) = torch.autograd.grad((want * R).sum(), x)
    got = compiled(x, s)
    (got_dx,) = torch.autograd.grad((got * R).sum(), x)
    assert rel_err(got, want) < 1e-5, (process, s, rel_err(got, want))
    assert rel_err(got_dx, want_dx) < 1e-5, (process, s, rel_err(got_dx, want_dx))


def rms_scaled(x, s):  # HF's RMSNorm (eps added to a tensor) times a scale: no lowering reads `s` itself
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s * 1e-2) * s


@pytest.mark.parametrize("options", [{}, {"fuse": "all"}], ids=["default", "fuse-all"])
def test_a_float_input_no_compile_reads_is_cached_once_seen_so(fresh_cache, options, monkeypatch):
    """A graph whose compile does not read its float inputs' values (no guard on them) is compiled
    uncached once, which finds that out ("value-free") and keeps what it compiled; a later process
    compiles it with the caches on (finding that), and the one after that is served from them, with
    eager's outputs and gradients for every value."""
    from torch._dynamo.utils import counters

    # (left to Inductor whole, the graph goes to Inductor's own cache entries, without dmfx's tag)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(fresh_cache / "inductor"))
    x = torch.randn(4, 8, requires_grad=True)
    R = torch.randn(4, 8)
    verdicts, hits, fx_hits = [], [], []
    for process in range(3):
        _new_process()
        counters.clear()
        compiled = torch.compile(rms_scaled, backend="dmfx", dynamic=True, options={"compiler": "inductor", **options})
        for s in (0.3, 1.5, 2.5):
            _assert_matches_eager(rms_scaled, compiled, x, s, R, process)
        (r,) = [r for r in dmfx.records() if r.float_inputs]  # (one graph for every value: no guard on `s`)
        verdicts.append((r.float_verdict, r.floats_uncached))
        hits.append(counters["aot_autograd"]["autograd_cache_hit"])
        fx_hits.append(counters["inductor"]["fxgraph_cache_hit"])
    assert verdicts == [("", True), ("value-free", False), ("value-free", False)], verdicts
    # The first process kept what it compiled before any value was read (graph_cache.caches_off):
    # AOTAutograd's entry and Inductor's forward and backward, which the second finds
    assert hits == [0, 1, 1], hits
    assert fx_hits == [0, 2, 2], fx_hits


def test_a_graph_left_whole_for_unbuilt_kernels_is_rewritten_once_they_are_built(fresh_cache, monkeypatch):
    """fuse="auto" keeps a graph without dropout for dmfx only for a large loss (dmfx.inductor.loss_pays).
    On a machine where dmfx's kernels are not built (their self-check verdict unknown), that does not
    pay for their build: the graph is left to Inductor whole, and a later process finds that decision
    kept. Once the kernels are built (the verdict known), the kept decision is dropped and the graph is
    rewritten for its loss; the losses are the same."""
    from dmfx.cuda_ops import selfcheck

    selfcheck.passes_to_skip(["cpu"])  # (built and checked, for the last step)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=33000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    base = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 33000, (2, 16))
    real = selfcheck.known_passes_to_skip

    def step(built: bool):
        monkeypatch.setattr(selfcheck, "known_passes_to_skip", real if built else (lambda devices: None))
        torch._dynamo.reset()
        dmfx.reset()
        m = copy.deepcopy(base)
        loss = torch.compile(m, backend="dmfx", options={**AUTO, "fallback": False})(
            input_ids=ids, labels=ids).loss
        loss.backward()
        (rec,) = dmfx.records()
        return loss.item(), rec

    unbuilt = [step(False) for _ in range(2)]
    for _, rec in unbuilt:
        assert rec.fallback.startswith("left to Inductor: no dropout in this graph, and dmfx's kernels are not built"), \
            rec.summary()
    assert [rec.lowered_from_cache for _, rec in unbuilt] == [False, True]
    loss, rec = step(True)
    assert rec.fallback is None and not rec.lowered_from_cache and rec.fired.get("cross_entropy") == 1, rec.summary()
    assert abs(loss - unbuilt[0][0]) < 1e-5 * abs(loss)
