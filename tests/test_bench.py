"""The benchmark suite's smallest case end to end (python -m bench --smoke) and its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers")


def test_bench_smoke(tmp_path):
    out = tmp_path / "suite.json"
    p = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--threads", "1", "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=600, env={**os.environ})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "One encoder layer" in p.stdout and "Whole models" in p.stdout
    assert "[layer]" in p.stderr and "[models]" in p.stderr  # progress lines
    data = json.loads(out.read_text())
    assert {"environment", "settings", "layer", "models"} <= set(data)
    assert data["environment"]["torch"] and data["settings"]["smoke"] is True
    modes = {r["mode"] for r in data["layer"]}
    assert modes == {"train", "infer"}
    for r in data["layer"]:
        assert set(r["median_ms"]) == {"eager", "dmfx", "floor"}, r["skipped"]
        phases = {"forward", "backward", "total"} if r["mode"] == "train" else {"forward", "total"}
        assert all(set(m) == phases and all(v > 0 for v in m.values()) for m in r["median_ms"].values())
        assert r["ratios"]["dmfx"]["total_vs_eager"] > 0 and r["ratios"]["floor"]["total_x_floor"] == 1.0
        assert len(r["times_ms"]["dmfx"]["total"]) == data["settings"]["rounds"]
        assert r["floor"]["gemms"] > 0
    for r in data["models"]:
        assert set(r["median_ms"]) == {"eager", "dmfx"}, r["skipped"]
        assert r["bytes_moved"]["dmfx"] > 0 and r["peak_bytes"]["eager"] >= 0
        assert r["speedup_vs_eager"]["eager"] == 1.0


def test_bench_rejects_unknown_section():
    p = subprocess.run([sys.executable, "-m", "bench", "--only", "nope"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "unknown section" in p.stderr


def test_generate_bench_rejects_an_unknown_backend():
    from bench import generate

    with pytest.raises(SystemExit):
        generate.main(["--backends", "dmfx,nope"])


def test_step_ops_sees_inside_the_compiled_step():
    """bench/step_ops.py times the ops of the compiled code (dmfx's kernels appear, so Dynamo did not
    fall back to eager under the dispatch mode) and counts every call of a step."""
    from bench import step_ops

    args, layer_args = step_ops.parse_args(["--steps", "2", "--hidden", "64", "--heads", "4", "--ffn", "128",
                                            "--seq", "16", "--batch", "2", "--threads", "1"])
    timer, wall = step_ops.profile(args, layer_args)
    names = set(timer.calls)
    assert {"dmfx.bias_dropout_residual_norm.default", "dmfx.norm_backward.default"} <= names, names
    assert timer.calls["aten.mm.default"] % args.steps == 0 and wall > 0
    assert all(v >= 0 for v in timer.faults.values())
    text = step_ops.table(timer, args.steps, top=5)
    assert text.count("\n") == 6  # header, rule, five rows


def test_lm_step_times_a_whole_model_with_its_loss_and_its_gemm_floor():
    import time

    from bench import lm_step

    r = lm_step.run("llama-small", 1, True, ["eager", "dmfx-fx", "floor"], 1, time.perf_counter)
    assert set(r["median_ms"]) == {"eager", "dmfx-fx", "floor"}
    assert all(t > 0 for t in r["median_ms"].values())
    assert r["vs_eager"]["eager"] == 1.0 and r["vs_floor"]["floor"] == 1.0 and r["paired_vs_floor"]["floor"] == 1.0
    assert r["first_call_s"]["dmfx-fx"] > 0


def test_lm_step_lora_trains_only_the_adapters_and_starts_as_the_base_model():
    """``--lora``: the attention's query and value projections get LoRA adapters (B at zero: the
    logits are the base model's), only the adapters train, and a step gives them gradients; a model
    without such projections is refused by name."""
    import copy

    from bench import lm_step

    model, kwargs = lm_step.build("llama-small", 1)
    base = copy.deepcopy(model)
    adapted = lm_step.lora(model, 4, dropout=0.0)
    assert sum(isinstance(m, lm_step.LoRALinear) for m in adapted.modules()) == 2  # (q_proj and v_proj)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    with torch.no_grad():
        assert torch.equal(adapted(**kwargs).logits, base(**kwargs).logits)
    adapted(**kwargs).loss.backward()
    assert all(p.grad is not None for n, p in adapted.named_parameters() if n in trainable)
    with pytest.raises(ValueError, match="no linear named"):
        lm_step.lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2)


def test_lm_step_counts_the_bytes_a_step_keeps_for_its_backward():
    """kept_for_backward (``--saved``): the distinct storages autograd saves, parameters left out: here the
    linear's input and the tanh's output, not its weight."""
    from bench import lm_step

    m = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh())
    x = torch.randn(4, 8)

    def step():
        m(x).sum().backward()

    step.module = m
    assert lm_step.kept_for_backward(step) == (4 * 8 + 4 * 16) * 4
    assert m[0].weight.grad is None  # (the step's gradients are not left behind)


def test_lm_step_builds_vit_classification_with_labels():
    """The image model of bench/lm_step.py: pixels and class labels in, HF's own loss out."""
    from bench import lm_step

    model, kwargs = lm_step.build("vit-cls", 1)
    assert set(kwargs) == {"pixel_values", "labels"} and kwargs["labels"].shape == (8,)
    out = model(**kwargs)
    assert out.logits.shape == (8, 1000) and torch.isfinite(out.loss)

def test_cross_entropy_bench_runs_every_candidate():
    """bench/cross_entropy.py on a tiny problem: every candidate is timed, and the fused op's peak
    memory is below eager's (eager saves the [N, V] log-probabilities; dmfx saves [N, 2])."""
    from bench import cross_entropy

    result = cross_entropy.run(tokens=16, vocab=500, dtype=torch.float32, rounds=1, warmup=0, device="cpu")
    assert set(result["median_ms"]) == {"eager", "dmfx", "eager + logits grad", "dmfx + logits grad"}
    assert result["peak_bytes"]["dmfx"] < result["peak_bytes"]["eager"]
    assert "dmfx + logits grad" in cross_entropy.table(result)


def test_linear_cross_entropy_bench_runs_its_candidates():
    """bench/linear_cross_entropy.py on a tiny problem (Inductor left out: minutes to compile on a CPU):
    every candidate is timed, the pass fires under torch.compile, and the chunked op's peak memory is
    below eager's (eager holds the [N, V] logits, their log-probabilities and gradient)."""
    from bench import linear_cross_entropy as lce

    candidates = tuple(c for c in lce.CANDIDATES if c != "inductor")
    result = lce.run(tokens=64, hidden=8, vocab=500, dtype=torch.float32, chunk=16, rounds=1, warmup=0, device="cpu",
                     candidates=candidates)
    assert set(result["median_ms"]) == set(candidates) and result["pass_fired"]
    peak = result["peak_bytes"]
    assert max(peak["dmfx"], peak["dmfx recompute"]) < peak["eager"] / 4
    assert peak["dmfx compiled"] < peak["eager"]  # (its chunk is default_chunk's: the 64 rows at once)
    assert "dmfx recompute" in lce.table(result)


def test_varlen_attention_bench_runs_every_candidate():
    """bench/varlen_attention.py on tiny shapes: every candidate is timed (forward, and forward + backward
    with dropout), and all compute the same attention on the real tokens (no dropout)."""
    from bench import varlen_attention

    for name in ("minilm", "bert128"):
        r = varlen_attention.run_shape(name, rounds=1, warmup=0, lengths=[5, 1, 12], heads=2, head_dim=8)
        assert set(r["times_ms"]) == set(varlen_attention.CANDIDATES)
        assert all(len(t) == 1 for t in r["times_ms"].values())
        assert max(r["rel_err"][n] for n in ("varlen", "flash_padded", "sdpa_padded")) < 1e-5  # (flash_nomask: NaN)
        assert r["T"] == 18 and r["Lmax"] == 12
        assert "flash_padded" in varlen_attention.table([r])


def test_compile_cost_runs_each_backend_in_fresh_processes():
    """bench/compile_cost.py on an LM model with its loss (eager only: Inductor would take minutes):
    a cold and a warm process each report their first and second step, and the table lists them."""
    from bench import compile_cost

    for infer in (False, True):
        results = compile_cost.run("cpu", "bert-mlm", layers=1, batch=1, seq=8, backends=("eager",), repeat=1,
                                   kernels="shared", threads=1, infer=infer)
        assert [r["cache"] for r in results] == ["cold", "warm"]
        for r in results:
            assert "error" not in r, r.get("error")
            assert r["first_step_s"] > 0 and r["second_step_s"] > 0 and r["dmfx_graphs"] == []
            assert r["mode"] == ("infer" if infer else "train")
        assert "bert-mlm" in compile_cost.table(results)


def test_lm_step_candidate_names_carry_options():
    """A dmfx candidate of bench.lm_step may end in ``@option=value`` (Python literals): the options it
    compiles with are its base name's and those."""
    from bench.lm_step import dmfx_options

    assert dmfx_options("dmfx@inductor_joint=False") == {"inductor_joint": False}
    assert dmfx_options("dmfx-all-skip-rope+glu@tune=True@attention='sdpa'") == {
        "fuse": "all", "skip": ["rope", "glu"], "tune": True, "attention": "sdpa"}
    with pytest.raises(ValueError, match="unknown candidate"):
        dmfx_options("dmfx-nope@tune=True")
