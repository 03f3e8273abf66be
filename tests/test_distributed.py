"""dmfx under torch.distributed on CPU (gloo): DistributedDataParallel and FSDP2 (fully_shard),
2 processes on this machine. Each worker trains the same model twice, eager and compiled with dmfx,
and saves the final parameters; the test compares them."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import rel_err

WORKER = textwrap.dedent(
    r"""
    import copy, os, sys
    import torch, torch.distributed as dist
    import torch.nn.functional as F

    mode, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)


    class Block(torch.nn.Module):
        def __init__(self, H=32):
            super().__init__()
            self.up = torch.nn.Linear(H, 2 * H)
            self.down = torch.nn.Linear(2 * H, H)
            self.drop = torch.nn.Dropout(0.0)
            self.ln = torch.nn.LayerNorm(H)

        def forward(self, x):
            return self.ln(self.drop(self.down(F.gelu(self.up(x)))) + x)


    class Model(torch.nn.Module):
        def __init__(self, H=32):
            super().__init__()
            self.inp = torch.nn.Linear(16, H)
            self.blocks = torch.nn.ModuleList([Block(H), Block(H)])
            self.head = torch.nn.Linear(H, 4)

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)


    def wrap(m):
        if mode.startswith("ddp"):
            from torch.nn.parallel import DistributedDataParallel
            if mode == "ddp-buckets":  # (a bucket per few parameters: Dynamo's DDPOptimizer splits the graph there)
                return DistributedDataParallel(m, bucket_cap_mb=1)
            return DistributedDataParallel(m)
        from torch.distributed.fsdp import fully_shard
        for b in m.blocks:
            fully_shard(b)
        return fully_shard(m)


    def train(m, compiled):
        # (SGD at the larger width: Adam's first steps are lr * sign(g), which turns rounding in a
        # near-zero gradient into a full step, so its parameters would be compared to Adam's noise)
        opt = torch.optim.SGD(m.parameters(), lr=1e-2) if mode == "ddp-buckets" else torch.optim.AdamW(m.parameters(), lr=1e-2)
        f = torch.compile(m, backend="dmfx", options={"fallback": False}) if compiled else m
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for _ in range(10):
            x, y = torch.randn(4, 6, 16, generator=g), torch.randn(4, 6, 4, generator=g)
            loss = F.mse_loss(f(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in m.named_parameters()}


    torch.manual_seed(0)  # the same initial model on every rank
    base = Model(384 if mode == "ddp-buckets" else 32)  # (1.2 MB per Linear: several 1 MB buckets)
    eager = train(wrap(copy.deepcopy(base)), False)
    fused = train(wrap(copy.deepcopy(base)), True)
    import dmfx
    fired = {}
    for r in dmfx.records():
        assert r.fallback is None, r.summary()
        for k, v in r.fired.items():
            fired[k] = fired.get(k, 0) + v
    torch.save({"eager": eager, "dmfx": fused, "fired": fired, "graphs": len(dmfx.records())}, f"{out}.{rank}")
    dist.destroy_process_group()
    print("WORKER OK", rank)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, tmp_path, world: int = 2, timeout: int = 120):
    port = _free_port()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(subprocess.Popen([sys.executable, str(script), mode, str(tmp_path / "result")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, results


def _check(procs, results, tmp_path, world=2, min_fired=2):
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and "WORKER OK" in out, err[-4000:]
    runs = [torch.load(tmp_path / f"result.{r}", weights_only=True) for r in range(world)]
    for run in runs:
        assert run["fired"].get("bias_dropout_residual_norm", 0) >= min_fired, run["fired"]
        for name, ref in run["eager"].items():
            assert rel_err(run["dmfx"][name], ref) < 1e-4, name
    for name in runs[0]["dmfx"]:  # replicas stay in sync
        assert torch.equal(runs[0]["dmfx"][name], runs[1]["dmfx"][name]), name


def test_ddp_gloo_two_processes_matches_eager_ddp(tmp_path):
    procs, results = _launch("ddp", tmp_path)
    _check(procs, results, tmp_path)


def test_ddp_buckets_split_the_graph_and_each_part_matches_eager(tmp_path):
    """DDP with 1 MB buckets at a width where several fill: Dynamo's DDPOptimizer splits the graph at
    the bucket boundaries (so the backward's all-reduce of one bucket overlaps the rest) and hands
    dmfx each part as a graph of its own, values crossing between the parts. Each part fuses what it
    holds; the trained parameters stay eager DDP's."""
    procs, results = _launch("ddp-buckets", tmp_path)
    _check(procs, results, tmp_path)
    run = torch.load(tmp_path / "result.0", weights_only=True)
    assert run["graphs"] >= 3 and run["fired"].get("bias_act_dropout", 0) >= 2, (run["graphs"], run["fired"])


def _fsdp2_unavailable() -> str | None:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard ({e})"
    return None


@pytest.mark.skipif(_fsdp2_unavailable() is not None, reason=str(_fsdp2_unavailable()))
def test_fsdp2_fully_shard_gloo_two_processes_matches_eager(tmp_path):
    procs, results = _launch("fsdp2", tmp_path)
    # FSDP2's hooks break the graph at each sharded block; both blocks share one compiled graph
    _check(procs, results, tmp_path, min_fired=1)
