"""Compiled generation with HF's generate(), greedy: the tokens are eager's, a whole generate compiles
at most two graphs (prefill and decode: none per token), and none is left to PyTorch.

Two ways users compile it: HF's own (``cache_implementation="static"`` and a ``CompileConfig``, which
compiles the decode step; the static cache is written in place, dmfx/functionalize.py), and
``model.forward = torch.compile(model.forward, ...)`` with the default dynamic cache."""

from __future__ import annotations

import pytest
import torch

import dmfx

transformers = pytest.importorskip("transformers")

VOCAB = 256


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(model, prompt, new_tokens=6, **kwargs):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False,
                          **kwargs)


def _compiled_records() -> list[dmfx.GraphRecord]:
    records = dmfx.records()
    assert records and all(r.fallback is None for r in records), [r.summary() for r in records]
    return records


def test_static_cache_generate_with_a_compile_config():
    """HF's documented compiled decoding. On the CPU generate() compiles only where the (private)
    ``CompileConfig._compile_all_devices`` is set; CompileConfig's default mode is
    "reduce-overhead", which dmfx accepts. The prefill runs eagerly (HF compiles the decode step
    only): one graph, written cache rows and all, reused for every token."""
    model = _model()
    prompt = torch.randint(0, VOCAB, (2, 7))
    want = _generate(model, prompt, cache_implementation="static")
    config = transformers.CompileConfig(backend=dmfx.with_options(fallback=False))  # (options= and mode= exclude each other)
    assert config.mode == "reduce-overhead"
    config._compile_all_devices = True
    got = _generate(model, prompt, cache_implementation="static", compile_config=config)
    assert torch.equal(got, want)
    (decode,) = _compiled_records()
    assert sum("in place" in line for line in decode.epilogue) >= 4, decode.epilogue  # keys and values per layer
    for name in ("rope", "glu", "bias_dropout_residual_norm"):
        assert decode.fired.get(name, 0) >= 2, decode.fired
    _decode_attention_stays_sdpa(decode)


def _decode_attention_stays_sdpa(decode: dmfx.GraphRecord) -> None:
    """One query row against the cache: the cost model leaves it to PyTorch's SDPA, and says so."""
    assert "lower_sdpa_calls" not in decode.fired, decode.fired
    why = [m for m in decode.missed if "lower_sdpa_calls" in m]
    assert len(why) == 2 and all("one query row" in m for m in why), decode.missed


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic-dynamic"])
def test_compiled_forward_with_the_dynamic_cache(dynamic):
    """``dynamic=True``: two graphs, the prefill (any prompt length) and the decode step (one token
    against a cache of any length), and a second generate with another prompt length and more tokens
    compiles nothing more. The default (Dynamo's automatic dynamic shapes) compiles the first decode
    step for its cache length and recompiles it once, dynamic, at the second: three graphs, and a
    prompt of another length recompiles the prefill once more (Dynamo's choice, not dmfx's)."""
    model = _model()
    prompt = torch.randint(0, VOCAB, (2, 7))
    other = torch.randint(0, VOCAB, (2, 5)) if dynamic else torch.randint(0, VOCAB, (2, 7))
    want = (_generate(model, prompt), _generate(model, other, new_tokens=9))
    model.forward = torch.compile(model.forward, backend="dmfx", dynamic=dynamic, options={"fallback": False})
    got = _generate(model, prompt)
    graphs = len(_compiled_records())
    assert graphs == (2 if dynamic else 3), [r.summary() for r in dmfx.records()]
    got_other = _generate(model, other, new_tokens=9)
    assert torch.equal(got, want[0]) and torch.equal(got_other, want[1])
    records = _compiled_records()
    assert len(records) == graphs, [r.summary() for r in records]
    prefill, decode = records[0], records[-1]
    assert prefill.fired.get("rope") == 2 and decode.fired.get("glu") == 2
    # each of the prefill's SDPA calls is fused or left to PyTorch with the cost model's reason (HF calls
    # it causal or with a mask depending on the torch version; tests/test_pass_lower_sdpa_calls.py)
    why = [m for m in prefill.missed if m.startswith("lower_sdpa_calls")]
    assert prefill.fired.get("lower_sdpa_calls", 0) + len(why) == 2, (prefill.fired, prefill.missed)
    _decode_attention_stays_sdpa(decode)


def test_dynamos_restart_request_reaches_dynamo(recwarn):
    """Under dynamic=True Inductor's tensorify pass asks Dynamo to trace the prefill again with a float
    specialized (TensorifyScalarRestartAnalysis). dmfx passes the request on, as Inductor's own backend
    does: the retraced graph goes to Inductor whole (fuse="auto", no dropout), where dmfx used to take
    the request for a failure of Inductor's, warn, and compile the graph itself (15 s here)."""
    model = _model()
    prompt = torch.randint(0, VOCAB, (2, 7))
    want = _generate(model, prompt)
    model.forward = torch.compile(model.forward, backend="dmfx", dynamic=True, options={"compiler": "inductor", "fuse": "auto"})
    assert torch.equal(_generate(model, prompt), want)
    assert not [str(w.message) for w in recwarn if "could not compile" in str(w.message)]
    records = dmfx.records()
    assert records and all((r.fallback or "").startswith("left to Inductor") for r in records), \
        [r.summary() for r in records]


def test_outputs_are_pinned_once():
    """pin_contiguous_outputs pins a contiguous computed output, not an input or a non-contiguous one,
    and nothing a second time (a graph compiled again: the backend's deferred self-check)."""
    from dmfx.inductor import pin_contiguous_outputs

    def f(x, y):
        return x, x + 1, (x + 1).t(), y * 2

    gm = torch.fx.symbolic_trace(f)
    args = (torch.randn(3, 4), torch.randn(3))
    for n, v in zip(gm.graph.nodes, _values(gm, args)):
        n.meta["example_value"] = v  # (as Dynamo's graph has them)
    assert pin_contiguous_outputs(gm) == 2
    assert pin_contiguous_outputs(gm) == 0
    got = gm(*args)
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(got, f(*args)))


def _values(gm, args):
    """Each node's value in a run of `gm` on `args` (placeholders, then computed values, in order)."""
    env = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, n):
            env[n] = super().run_node(n)
            return env[n]

    Keep(gm).run(*args)
    return [env.get(n) for n in gm.graph.nodes]


@pytest.mark.parametrize("fuse", ["auto", "all"])
def test_the_prefill_leaves_the_cache_in_eagers_layout_so_decoding_compiles_once(fuse):
    """HF's DynamicCache appends the prefill's keys and values to empty tensors. Eager's ``cat`` gives
    a contiguous tensor; Inductor's decomposition of it keeps the appended tensor's layout (the
    attention's transposed one), so the first decode step was compiled for that layout and the
    second, whose ``cat`` is contiguous, compiled a third graph (Inductor alone does the same). dmfx
    keeps the outputs eager makes contiguous so, on Inductor's whole graphs (fuse="auto") and on its
    own (fuse="all")."""
    model = _model()
    prompt = torch.randint(0, VOCAB, (2, 7))

    def prefill_layout(forward):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            forward(input_ids=prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, use_cache=True)
        return [(layer.keys.stride(), layer.values.stride()) for layer in cache.layers]

    want_layout, want = prefill_layout(model.forward), _generate(model, prompt, new_tokens=5)
    compiled = torch.compile(model.forward, backend="dmfx", dynamic=True,
                             options={"compiler": "inductor", "fuse": fuse, "fallback": False})
    assert prefill_layout(compiled) == want_layout
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model.forward = compiled
    assert torch.equal(_generate(model, prompt, new_tokens=5), want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2, [r.summary() for r in dmfx.records()]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_left_padded_prompts_under_dmfxs_own_rewrites(cache):
    """A batch of prompts of different lengths, left-padded as generate() wants them: the mask's zeros
    reach the prefill's attention (fused by dmfx under fuse="all") and every decode step's, and the
    tokens are still eager's, with the graph counts of the unpadded tests above (the mask's values
    must not specialize a graph)."""
    model = _model()
    prompt = torch.randint(1, VOCAB, (3, 9))
    mask = torch.ones_like(prompt)
    mask[0, :4] = 0
    mask[1, :2] = 0
    prompt[mask == 0] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    options = {"fuse": "all", "fallback": False}
    if cache == "static":
        want = model.generate(prompt, cache_implementation="static", **kwargs)
        config = transformers.CompileConfig(backend=dmfx.with_options(**options))
        config._compile_all_devices = True
        got = model.generate(prompt, cache_implementation="static", compile_config=config, **kwargs)
    else:
        want = model.generate(prompt, **kwargs)
        model.forward = torch.compile(model.forward, backend="dmfx", dynamic=True, options=options)
        got = model.generate(prompt, **kwargs)
    assert torch.equal(got, want)
    records = _compiled_records()
    assert len(records) == (1 if cache == "static" else 2), [r.summary() for r in records]
    assert all(r.fired.get("rope") == 2 for r in records), [r.fired for r in records]


def test_a_sliding_window_cache_under_dynamic_shapes():
    """Mistral's sliding-window layers of HF's DynamicCache under ``dynamic=True``: the prefill graph
    returns the cache's new length, which is the prompt length's symbol, an input of the graph, next to
    an output that is an input tensor (the window's), so the graph has an epilogue. The epilogue cloned
    every output that is an input, the symbol too (``aten.clone`` of a SymInt: the compile failed and,
    with fallback on, the graph ran op by op). The tokens are eager's and no graph falls back. (Three
    graphs: Dynamo recompiles the decode step once for the sliding window, with any backend.)"""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    model = transformers.MistralForCausalLM(cfg).eval()
    prompt = torch.randint(0, VOCAB, (2, 7))
    want = _generate(model, prompt)
    model.forward = torch.compile(model.forward, backend="dmfx", dynamic=True,
                                  options={"fuse": "all", "fallback": False})
    assert torch.equal(_generate(model, prompt), want)
    records = _compiled_records()
    assert any(any("is input" in line for line in r.epilogue) for r in records), [r.epilogue for r in records]
    assert all(r.fired.get("rope") == 2 for r in records), [r.fired for r in records]


def _interleaved_rope_model(family: str):
    torch.manual_seed(0)
    if family == "gptj":  # rotary on the first 8 of 16 head features, tables repeated per tensor
        cfg = transformers.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, rotary_dim=8, n_positions=64,
                                      bos_token_id=0, eos_token_id=1)
        return transformers.GPTJForCausalLM(cfg).eval()
    cfg = transformers.CohereConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                                    pad_token_id=2)
    return transformers.CohereForCausalLM(cfg).eval()


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("family", ["cohere", "gptj"])
def test_interleaved_rotary_families_generate_eagers_tokens(family, cache):
    """Cohere and GPT-J rotate interleaved pairs of features (rotate_every_two): under fuse="all" each
    compiled graph, the prefill's and the one-token decode step's, fuses each layer's rotation into one
    dmfx::rope, and greedy decoding gives eager's tokens (one graph for a static cache's decode step,
    two for the dynamic cache's prefill and decode)."""
    model = _interleaved_rope_model(family)
    prompt = torch.randint(3, VOCAB, (2, 7))
    options = {"fuse": "all", "fallback": False}
    if cache == "static":
        want = _generate(model, prompt, cache_implementation="static")
        config = transformers.CompileConfig(backend=dmfx.with_options(**options))
        config._compile_all_devices = True
        got = _generate(model, prompt, cache_implementation="static", compile_config=config)
    else:
        want = _generate(model, prompt)
        model.forward = torch.compile(model.forward, backend="dmfx", dynamic=True, options=options)
        got = _generate(model, prompt)
    assert torch.equal(got, want)
    records = _compiled_records()
    assert len(records) == (1 if cache == "static" else 2), [r.summary() for r in records]
    assert all(r.fired.get("rope") == 2 for r in records), [r.fired for r in records]
