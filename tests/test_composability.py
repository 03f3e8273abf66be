"""dmfx inside a real training script: autocast, dynamic shapes, graph breaks, train/eval switches,
no_grad / inference_mode, activation checkpointing (with dropout: the recompute draws the forward's masks),
frozen parameters, optimizers and checkpoints (state_dict save/load).

Every comparison is against eager PyTorch running the same thing, by relative norm error."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err, seeded_gradient_error

import dmfx
from dmfx.cuda_ops import build

transformers = pytest.importorskip("transformers")

BF16_TOL = 2e-2


# ----------------------------------------------------------------------------------------- models


class Layer(torch.nn.Module):
    """A pre-LN-free BERT-style layer: attention (softmax with an additive mask, dropout on the
    probabilities), bias + dropout + residual + LayerNorm twice, GELU MLP."""

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

    def forward(self, x, mask=None):
        B, L, H = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / (H // self.heads) ** 0.5
        if mask is not None:
            s = s + mask
        a = (self.drop(s.softmax(-1)) @ v).transpose(1, 2).reshape(B, L, H)
        x = self.ln1(self.drop(self.proj(a)) + x)
        return self.ln2(self.drop(self.down(F.gelu(self.up(x)))) + x)


def bert(dropout=0.0, layers=2, attn="eager"):
    cfg = transformers.BertConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=128,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, max_position_embeddings=64,
    )
    cfg._attn_implementation = attn
    return transformers.BertModel(cfg, add_pooling_layer=False)


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    return transformers.LlamaModel(cfg)


def fired() -> dict[str, int]:
    out: dict[str, int] = {}
    for r in dmfx.records():
        for k, v in r.fired.items():
            out[k] = out.get(k, 0) + v
    return out


def grads_close(m, ref, tol):
    """Each parameter's gradient, relative to the norm of all of eager's gradients (some are ~0)."""
    scale = torch.cat([q.grad.flatten() for q in ref.parameters() if q.grad is not None])
    n = 0
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        assert rel_err(p.grad, q.grad, scale) < tol, (name, rel_err(p.grad, q.grad, scale))
        n += 1
    assert n > 0


def cotangent(shape):
    """A fixed random cotangent: loss = (out * R).sum() (a loss like out.square().sum() through a
    final LayerNorm has a gradient that is zero in exact arithmetic: comparing it compares noise)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1234))


# ----------------------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_autocast_bf16_matches_eager_forward_and_backward(name):
    m = {"bert": bert, "llama": llama}[name]().train()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 500, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(m, backend="dmfx", options={"fallback": False})(input_ids=ids).last_hidden_state
        exp = ref(input_ids=ids).last_hidden_state
    assert out.dtype == exp.dtype
    assert rel_err(out, exp) < BF16_TOL
    R = cotangent(exp.shape)
    (out.float() * R).sum().backward()
    (exp.float() * R).sum().backward()
    grads_close(m, ref, BF16_TOL)
    assert all(r.fallback is None for r in dmfx.records())
    # Under CPU autocast the residual stream stays float32 (the norms run in float32), so the norms fuse.
    # (a norm after a residual add is fused into bias_dropout_residual_norm, with the bf16 GEMM output
    # cast up inside the chain)
    want = {"bert": "layer_norm", "llama": "rms_norm"}[name]
    assert fired().get(want, 0) + fired().get("bias_dropout_residual_norm", 0) >= 5, fired()
    assert fired().get("bias_dropout_residual_norm", 0) >= 4, fired()


def test_autocast_bf16_fuses_bias_dropout_residual_norm():
    """Under autocast the GEMM output is bf16 while the residual stays float32: the pass casts the GEMM
    output (and the bias) up and fuses the rest (it used to leave the chain alone)."""
    m = bert().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(m, backend="dmfx")(input_ids=torch.randint(0, 500, (2, 16)))
    assert fired().get("bias_dropout_residual_norm", 0) >= 2, fired()


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=500, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    return transformers.GPT2Model(cfg)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_autocast_bf16_attention_behind_hf_float32_masks_fuses(name):
    """HF builds its masks in the embeddings' dtype, float32 under CPU autocast: the bf16 scores + the
    mask promote to float32, the softmax runs in float32 and its probabilities are cast back for the
    second GEMM. The attention still fuses (every layer), in training as dmfx's GEMM form (faster than
    SDPA in bf16 at these lengths: bench/RESULTS.md), and matches eager, forward and backward."""
    m = {"bert": bert, "gpt2": gpt2, "llama": llama}[name]().train()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 500, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0  # a padded batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opts = {"fallback": False, "fuse": "all"}
        out = torch.compile(m, backend="dmfx", options=opts)(input_ids=ids, attention_mask=mask).last_hidden_state
        exp = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    assert rel_err(out.float(), exp.float()) < BF16_TOL
    R = cotangent(exp.shape)
    (out.float() * R).sum().backward()
    (exp.float() * R).sum().backward()
    grads_close(m, ref, BF16_TOL)
    assert fired().get("attention", 0) == 2, (fired(), [r.missed for r in dmfx.records()])
    forms = [f for r in dmfx.records() for f, _ in r.attention_forms.values()]
    assert forms == ["gemm", "gemm"], forms


# ----------------------------------------------------------------------------------------- dynamic shapes

LENGTHS = (5, 7, 9, 12, 16, 23, 31, 40)


def _no_recompile_no_rebuild(f, m, ref, make_inputs, monkeypatch):
    """Warm up once, then 8 sequence lengths: same number of graphs, no kernel module built or
    loaded, results equal eager's (forward and backward) for each length."""
    from torch._dynamo.utils import counters

    x, mask = make_inputs(2, 4)
    f(x, mask).sum().backward()
    # (Dynamo may restart its analysis inside the first compile: count from here on)
    graphs, frames, loaded = len(dmfx.records()), counters["stats"]["unique_graphs"], dict(build._loaded)
    cached = sorted(p.name for p in build.cache_root().iterdir())

    def no_build(kind):
        raise AssertionError(f"kernel module {kind} built or loaded again")

    monkeypatch.setattr(build, "_build_or_load", no_build)
    for i, L in enumerate(LENGTHS):
        for p in (*m.parameters(), *ref.parameters()):
            p.grad = None
        x, mask = make_inputs(2 + i % 3, L)
        out = f(x, mask)
        exp = ref(x, mask)
        assert rel_err(out, exp) < 1e-5, L
        R = torch.randn_like(exp)
        (out * R).sum().backward()
        (exp * R).sum().backward()
        grads_close(m, ref, 1e-5)
    assert len(dmfx.records()) == graphs, [r.summary() for r in dmfx.records()]
    assert counters["stats"]["unique_graphs"] == frames
    assert build._loaded == loaded and all(build._loaded[k] is loaded[k] for k in loaded)
    assert sorted(p.name for p in build.cache_root().iterdir()) == cached
    assert fired().get("bias_dropout_residual_norm", 0) >= 2, fired()


def _inputs(B, L, H=32):
    x = torch.randn(B, L, H)
    mask = torch.zeros(B, 1, 1, L)
    mask[..., L // 2:] = -1e4  # pad the second half of each sequence out
    return x, mask


def test_dynamic_true_eight_lengths(monkeypatch):
    m = Layer().train()
    ref = copy.deepcopy(m)
    f = torch.compile(m, backend="dmfx", dynamic=True, options={"fallback": False})
    _no_recompile_no_rebuild(f, m, ref, _inputs, monkeypatch)


def test_mark_dynamic_batch_and_sequence(monkeypatch):
    m = Layer().train()
    ref = copy.deepcopy(m)
    f = torch.compile(m, backend="dmfx", options={"fallback": False})

    def make(B, L):
        x, mask = _inputs(B, L)
        for t, dims in ((x, (0, 1)), (mask, (0, 3))):
            for d in dims:
                torch._dynamo.mark_dynamic(t, d)
        return x, mask

    _no_recompile_no_rebuild(f, m, ref, make, monkeypatch)


def test_functional_layer_norm_with_a_dynamic_hidden_size_fuses():
    def f(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b)

    args = (torch.randn(2, 5, 24), torch.randn(24), torch.randn(24))
    out = torch.compile(f, backend="dmfx", dynamic=True)(*args)
    assert rel_err(out, f(*args)) < 1e-5  # correct either way
    assert dmfx.records()[-1].fired == {"layer_norm": 1}, dmfx.records()[-1].missed


# ----------------------------------------------------------------------------------------- graph breaks


class Broken(torch.nn.Module):
    """Graph breaks in the middle of the LayerNorm / attention chain: a print between the scores and
    the softmax, a data-dependent branch between attention and the residual + LayerNorm."""

    def __init__(self, H=32):
        super().__init__()
        self.ln0 = torch.nn.LayerNorm(H)
        self.qkv = torch.nn.Linear(H, 3 * H)
        self.proj = torch.nn.Linear(H, H)
        self.ln1 = torch.nn.LayerNorm(H)

    def forward(self, x):
        h = self.ln0(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        s = q @ k.transpose(-1, -2) / 32**0.5
        print("dmfx test: graph break between scores and softmax")
        a = s.softmax(-1) @ v
        if x.sum() > 0:  # data-dependent: Dynamo breaks the graph here
            a = a * 2.0
        else:
            a = a - 1.0
        return self.ln1(self.proj(a) + h)


def test_graph_breaks_inside_a_layer(capsys):
    m = Broken()
    ref = copy.deepcopy(m)
    f = torch.compile(m, backend="dmfx", options={"fallback": False})
    for trial in range(4):  # both branches, twice
        for p in (*m.parameters(), *ref.parameters()):
            p.grad = None
        x = torch.randn(2, 6, 32) + (0.5 if trial % 2 else -0.5)
        out, exp = f(x), ref(x)
        assert rel_err(out, exp) < 1e-5
        R = torch.randn_like(exp)
        (out * R).sum().backward()
        (exp * R).sum().backward()
        grads_close(m, ref, 1e-5)
    assert "graph break between scores" in capsys.readouterr().out
    assert len(dmfx.records()) >= 3, [r.summary() for r in dmfx.records()]  # the pieces compiled separately
    f_ = fired()
    assert f_.get("layer_norm", 0) >= 1 and f_.get("bias_dropout_residual_norm", 0) >= 1, f_


# ----------------------------------------------------------------------------------------- train / eval


def test_eval_turns_dropout_off_and_train_back_on():
    m = Layer(p=0.3).train()
    f = torch.compile(m, backend="dmfx", options={"fallback": False})
    x, mask = _inputs(2, 8)
    a, b = f(x, mask), f(x, mask)
    assert rel_err(a, b) > 1e-2  # dropout on: two calls differ
    # the attention dropout is inside the fused softmax (or a standalone dmfx dropout)
    assert fired().get("bias_dropout_residual_norm", 0) >= 1, fired()
    assert fired().get("attention_softmax", 0) + fired().get("attention", 0) + fired().get("dropout", 0) >= 1, fired()

    m.eval()
    a, b = f(x, mask), f(x, mask)
    assert torch.equal(a, b)
    assert rel_err(a, m(x, mask)) < 1e-5

    m.train()
    a, b = f(x, mask), f(x, mask)
    assert rel_err(a, b) > 1e-2
    # and the training-mode statistics are eager's: mean/std of many outputs close
    e = torch.stack([m(x, mask) for _ in range(20)])
    d = torch.stack([f(x, mask) for _ in range(20)])
    assert abs(d.std().item() - e.std().item()) < 0.05 * e.std().item()
    assert rel_err(d.mean(0), e.mean(0)) < 0.15


def test_no_grad_and_inference_mode_on_a_model_compiled_for_training():
    m = Layer(p=0.1).train()
    f = torch.compile(m, backend="dmfx", options={"fallback": False})
    x, mask = _inputs(2, 8)
    f(x.requires_grad_(), mask).sum().backward()  # compiled for training first
    x = x.detach()
    m.eval()
    with torch.no_grad():
        out = f(x, mask)
        assert not out.requires_grad
        assert rel_err(out, m(x, mask)) < 1e-5
    with torch.inference_mode():
        out = f(x, mask)
        assert out.is_inference()
        assert rel_err(out, m(x, mask)) < 1e-5
    m.train()
    out = f(x, mask)  # and training again after both
    assert out.requires_grad
    assert all(r.fallback is None for r in dmfx.records())


@pytest.mark.parametrize("options", [{"fuse": "all"}, {"fuse": "all", "compiler": "fx"}, {"unpad": True, "fuse": "all"}],
                         ids=["inductor", "fx", "unpad"])
def test_one_compiled_model_served_from_several_threads_at_once(options):
    """A server's pattern: one compiled model called from four Python threads at once, each with its
    own padded batches (dmfx's kernels and the compiled code release the GIL, so the calls overlap).
    Every output is eager's on the real tokens (under unpad the padding rows are zeros, as its
    contract says)."""
    import threading

    torch.manual_seed(0)
    model = bert().eval()
    f = torch.compile(model, backend="dmfx", options={**options, "fallback": False})

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        ids, mask = torch.randint(0, 500, (3, 12), generator=g), torch.ones(3, 12, dtype=torch.long)
        for b, n in enumerate(torch.randint(6, 13, (3,), generator=g).tolist()):
            mask[b, n:] = 0
        return ids, mask

    with torch.no_grad():
        f(*batch(0))  # (compiled before the threads start)
        expected = {s: model(*batch(s)).last_hidden_state for s in range(16)}
    errors, worst = [], []

    def serve(t):
        try:
            with torch.no_grad():
                for s in [(t * 4 + r) % 16 for r in range(12)]:
                    ids, mask = batch(s)
                    real = mask.bool()[..., None]
                    worst.append(rel_err(f(ids, mask).last_hidden_state * real, expected[s] * real))
        except Exception as e:  # noqa: BLE001  (reported below, with the thread's number)
            errors.append(f"thread {t}: {e!r}")

    threads = [threading.Thread(target=serve, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(worst) == 48 and max(worst) < 1e-5, max(worst)
    assert fired().get("bias_dropout_residual_norm", 0) >= 2, fired()
    assert fired().get("unpad", 0) >= (1 if options.get("unpad") else 0), fired()
    assert all(r.fallback is None for r in dmfx.records())


# ----------------------------------------------------------------------------------------- checkpointing


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Layer(), Layer()

    def forward(self, x, mask):
        x = torch.utils.checkpoint.checkpoint(self.a, x, mask, use_reentrant=False)
        return self.b(x, mask)


def test_activation_checkpoint_inside_the_compiled_region():
    m = Checkpointed()
    ref = copy.deepcopy(m)
    x, mask = _inputs(2, 8)
    out = torch.compile(m, backend="dmfx", options={"fallback": False})(x, mask)
    exp = ref(x, mask)
    assert rel_err(out, exp) < 1e-5
    R = torch.randn_like(exp)
    (out * R).sum().backward()
    (exp * R).sum().backward()
    grads_close(m, ref, 1e-5)
    assert fired().get("bias_dropout_residual_norm", 0) >= 2, fired()


def test_compiled_block_inside_eager_checkpoint():
    m = Checkpointed()
    ref = copy.deepcopy(m)
    m.a = torch.compile(m.a, backend="dmfx", options={"fallback": False})
    x, mask = _inputs(2, 8)
    x.requires_grad_()
    out, exp = m(x, mask), ref(x, mask)
    assert rel_err(out, exp) < 1e-5
    R = torch.randn_like(exp)
    (out * R).sum().backward()
    (exp * R).sum().backward()
    grads_close(m, ref, 1e-5)
    assert fired().get("bias_dropout_residual_norm", 0) >= 2, fired()


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing_enable(reentrant):
    m = bert().train()
    ref = copy.deepcopy(m)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 500, (2, 16))
    out = torch.compile(m, backend="dmfx")(input_ids=ids).last_hidden_state
    exp = ref(input_ids=ids).last_hidden_state
    assert rel_err(out, exp) < 1e-5
    R = cotangent(exp.shape)
    (out * R).sum().backward()
    (exp * R).sum().backward()
    grads_close(m, ref, 1e-5)
    assert fired().get("layer_norm", 0) + fired().get("bias_dropout_residual_norm", 0) >= 3, fired()


class CheckpointedDropout(torch.nn.Module):
    """Two dropout layers, the first under activation checkpointing."""

    def __init__(self, preserve_rng_state=True):
        super().__init__()
        self.a, self.b = Layer(p=0.2), Layer(p=0.2)
        self.preserve = preserve_rng_state

    def forward(self, x, mask):
        x = torch.utils.checkpoint.checkpoint(self.a, x, mask, use_reentrant=False, preserve_rng_state=self.preserve)
        return self.b(x, mask)


def test_the_seeded_gradient_check_sees_a_recompute_with_another_mask():
    """The check below can fail: eager checkpointing told not to restore the RNG recomputes its
    dropout with another mask, and the gradient is no longer the forward's derivative."""
    x, mask = _inputs(2, 8)
    R = cotangent((2, 8, 32)).double()
    for preserve, ok in ((True, True), (False, False)):
        torch.manual_seed(0)
        m = CheckpointedDropout(preserve).double().train()

        def f():
            torch.manual_seed(5)
            return (m(x.double(), mask.double()) * R).sum()

        assert (seeded_gradient_error(m, f) < 1e-6) == ok


@pytest.mark.parametrize("where", ["module", "bert-eager-attention", "bert-sdpa-reentrant"])
def test_dropout_under_activation_checkpointing_gives_its_forwards_gradient(where):
    """With dropout, dmfx's fused kernels draw their masks from seeds; under activation
    checkpointing the backward recomputes the forward, and must recompute the same masks. The
    masks differ from eager's, so the oracle is the finite difference of the seeded forward."""
    torch.manual_seed(0)
    if where == "module":
        m = CheckpointedDropout().double().train()
        x, mask = _inputs(2, 8)
        args, kwargs = (x.double(), mask.double()), {}
        R = cotangent((2, 8, 32)).double()
    else:
        m = bert(dropout=0.1, attn="sdpa" if "sdpa" in where else "eager").double().train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": where.endswith("reentrant")})
        # (no padding_idx 0: its embedding row gets no gradient by design, though it moves the output)
        args, kwargs = (), {"input_ids": torch.randint(1, 500, (2, 16))}
        R = cotangent((2, 16, 64)).double()
    cm = torch.compile(m, backend="dmfx")

    def f():
        torch.manual_seed(5)
        out = cm(*args, **kwargs)
        return ((out if where == "module" else out.last_hidden_state) * R).sum()

    assert seeded_gradient_error(m, f) < 1e-6
    assert all(r.fallback is None for r in dmfx.records())
    assert fired().get("bias_dropout_residual_norm", 0) >= 2, fired()
    assert fired().get("attention", 0) >= 1, fired()


@pytest.mark.parametrize("freeze", ["bitfit", "top-layer-only", "embeddings"])
def test_frozen_parameters_train_as_eager(freeze):
    """Fine-tuning with part of the model frozen (BitFit: biases and norms only; the top layer
    only; frozen embeddings): the backward then lacks some weight gradients, which the bias-gradient
    folds and the GEMM accumulation passes must not assume. fuse="all", so every pass runs."""
    def trainable(name):
        if freeze == "bitfit":
            return not name.endswith("weight") or "LayerNorm" in name
        if freeze == "top-layer-only":
            return "layer.1." in name
        return "embeddings" not in name

    m = bert(dropout=0.0).train()
    for name, q in m.named_parameters():
        q.requires_grad_(trainable(name))
    ref = copy.deepcopy(m)
    ids = torch.randint(1, 500, (2, 16))
    out = torch.compile(m, backend="dmfx", options={"fuse": "all", "fallback": False})(input_ids=ids).last_hidden_state
    exp = ref(input_ids=ids).last_hidden_state
    assert rel_err(out, exp) < 1e-5
    R = cotangent(exp.shape)
    (out * R).sum().backward()
    (exp * R).sum().backward()
    grads_close(m, ref, 1e-5)  # (a frozen parameter's gradient must stay None, as eager's)
    assert fired().get("bias_dropout_residual_norm", 0) >= 4, fired()


def test_compiled_autograd_gives_eagers_gradients():
    """Compiled autograd (which FSDP2 users turn on) hands the backend a backward graph of its own, whose
    inputs are lists: dmfx leaves that graph to PyTorch (Inductor whole by default) and says why,
    before tracing it; the forward stays dmfx's and the gradients are eager's."""
    m = Layer().train()
    ref = copy.deepcopy(m)
    x, mask = _inputs(2, 8)
    compiled = torch.compile(m, backend="dmfx", options={"fuse": "all"})
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="dmfx", options={"fuse": "all"})):
        out = compiled(x, mask)
        R = cotangent(out.shape)
        (out * R).sum().backward()
    exp = ref(x, mask)
    (exp * R).sum().backward()
    assert rel_err(out, exp) < 1e-5
    grads_close(m, ref, 1e-5)
    records = dmfx.records()
    assert any(r.fired for r in records), [r.fallback for r in records]
    assert any(r.fallback and "the graph takes lists as inputs" in r.fallback for r in records), \
        [r.fallback for r in records]


# ----------------------------------------------------------------------------------------- optimizer + checkpoints


def _train(m, steps, compiled):
    torch.manual_seed(7)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    f = torch.compile(m, backend="dmfx", options={"fallback": False}) if compiled else m
    losses = []
    for _ in range(steps):
        x, mask = _inputs(3, 8)
        target = torch.randn(3, 8, 32)
        loss = F.mse_loss(f(x, mask), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt


def test_adamw_steps_and_state_dict_round_trip(tmp_path):
    m = Layer().train()
    ref = copy.deepcopy(m)
    eager_losses, _ = _train(ref, 5, False)
    losses, opt = _train(m, 5, True)
    for a, b in zip(losses, eager_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, eager_losses)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        if name == "qkv.bias":
            # The key bias's gradient is zero in exact arithmetic (softmax is shift-invariant), so
            # AdamW turns rounding noise into +-lr steps there: compare only the query/value parts.
            p, q = torch.cat([p[:32], p[64:]]), torch.cat([q[:32], q[64:]])
        assert rel_err(p, q) < 1e-5, name
    assert fired().get("bias_dropout_residual_norm", 0) >= 2, fired()

    sd = m.state_dict()
    assert set(sd) == set(ref.state_dict())
    path = tmp_path / "model.pt"
    torch.save({"model": sd, "opt": opt.state_dict()}, path)
    loaded = torch.load(path, weights_only=True)
    for k, v in loaded["model"].items():
        assert type(v) is torch.Tensor and v.device.type == "cpu", (k, type(v))
        assert torch.equal(v, sd[k])
    for state in loaded["opt"]["state"].values():
        assert all(type(v) is torch.Tensor for v in state.values())

    fresh = Layer()
    fresh.load_state_dict(loaded["model"])
    x, mask = _inputs(2, 8)
    m.eval(), fresh.eval()
    with torch.no_grad():
        assert rel_err(fresh(x, mask), m(x, mask)) < 1e-6
    # torch.compile's wrapper prefixes its keys with "_orig_mod." (torch's behaviour, not dmfx's):
    # the wrapped module's state_dict is the one to save
    compiled = torch.compile(m, backend="dmfx")
    assert {k.removeprefix("_orig_mod.") for k in compiled.state_dict()} == set(sd)
