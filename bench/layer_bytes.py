"""Bytes moved, peak memory and fusion coverage of one HuggingFace BertLayer training step, with and
without dmfx (issue 3's layer: BERT-base sizes, batch 8, sequence 128, dropout 0.1, fp32).

The numbers come from ``dmfx.explain``: every op of the compiled forward and backward graphs is
costed (bytes read + written), the count is checked against a dispatch-mode count of a real step,
and "before" is the same graphs compiled with every dmfx pass skipped. The loss is ``mean()`` of the
layer output (its ``mean`` and the ``div`` of its backward are the two ops no dmfx pass covers).

Usage: ``python -m bench.layer_bytes [--seq 128] [--batch 8] [--dropout 0.1] [--json PATH]``
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

import dmfx


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from dmfx.models import bert_layer

    torch.set_num_threads(a.threads)
    hidden = 768  # BERT-base
    layer = bert_layer(hidden=hidden, dropout=a.dropout)
    x = torch.randn(a.batch, a.seq, hidden, requires_grad=True)
    report = dmfx.explain(layer, x, training=True, name=f"BertLayer B={a.batch} L={a.seq} p={a.dropout}")
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M} | torch {torch.__version__} | threads {a.threads}")
    print(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1, default=str)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
