"""The report of dmfx.explain: one row per operator of the compiled graphs (graph_rows), totals per
operator class, and ``Report``, which prints as tables and round-trips through JSON."""

from __future__ import annotations

import json
from typing import Any, Iterable

from torch.fx import GraphModule

from ..passes.fusion import provenance
from .cost import CLASSES, FUSED, VIEW, absorbed_rows, call_nodes, node_cost
from .coverage import Coverage

PAPER_REDUCTION_PCT = 22.91  # Ivanov et al. 2021: data movement reduced by up to 22.91% (BERT-large layer)


def graph_rows(gm: GraphModule, graph: str, stage: str) -> list[dict]:
    """One row per operator of `gm` (getitem left out): cost, class, and for a node a fusion made the
    ATen ops it absorbed (cost.absorbed_rows)."""
    rows = []
    for n in call_nodes(gm):
        c = node_cost(n)
        absorbed = [r["op"] for r in absorbed_rows(n)]
        note = c.note or n.meta.get("dmfx_note", "")
        rows.append({
            "graph": graph, "stage": stage, "node": n.name, "op": c.op, "class": c.cls, "flop": c.flop,
            "bytes_read": c.bytes_read, "bytes_written": c.bytes_written,
            "intensity": round(c.flop / c.bytes, 4) if c.bytes else None,
            "absorbed": absorbed, "note": note, "source": provenance(n)[:1],
        })
    return rows


def totals(rows: Iterable[dict]) -> dict[str, dict]:
    """Per class: flop, bytes, kernels (views are not kernels), with shares of the whole."""
    out = {c: {"flop": 0, "bytes": 0, "bytes_read": 0, "bytes_written": 0, "kernels": 0, "ops": 0} for c in CLASSES}
    for r in rows:
        t = out[r["class"]]
        t["flop"] += r["flop"]
        t["bytes_read"] += r["bytes_read"]
        t["bytes_written"] += r["bytes_written"]
        t["bytes"] += r["bytes_read"] + r["bytes_written"]
        t["ops"] += 1
        t["kernels"] += r["class"] != VIEW
    flop = sum(t["flop"] for t in out.values()) or 1
    nbytes = sum(t["bytes"] for t in out.values()) or 1
    for t in out.values():
        t["flop_pct"] = 100.0 * t["flop"] / flop
        t["bytes_pct"] = 100.0 * t["bytes"] / nbytes
    return {c: t for c, t in out.items() if t["ops"]}



class Report:
    """The result of ``dmfx.explain``: ``print(report)`` for tables, ``to_dict()`` / ``to_json()``
    for everything (per operator rows, totals, coverage, run-time check, measurements)."""

    def __init__(self, data: dict):
        self.data = data

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def to_dict(self) -> dict:
        return json.loads(json.dumps(self.data))

    def to_json(self, path: str | None = None, indent: int | None = 1) -> str:
        text = json.dumps(self.data, indent=indent)
        if path:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        return cls(json.loads(json.dumps(data)))

    @classmethod
    def from_json(cls, text: str) -> "Report":
        return cls(json.loads(text))

    # -------------------------------------------------------------- convenience views
    @property
    def reduction_pct(self) -> float:
        return self.data["data_movement"]["reduction_pct"]

    @property
    def coverage(self) -> Coverage:
        return Coverage(**self.data["coverage"])

    def rows(self, stage: str = "after", graph: str | None = None) -> list[dict]:
        return [r for r in self.data["ops"][stage] if graph is None or r["graph"] == graph]

    def __repr__(self) -> str:
        dm = self.data["data_movement"]
        before, after = _fmt_bytes(dm["before_bytes"]), _fmt_bytes(dm["after_bytes"])
        return f"<dmfx.explain.Report {self.data['model']}: {before} -> {after} ({dm['reduction_pct']:.2f}% less)>"

    def __str__(self) -> str:
        return self.render()

    def render(self, top: int = 12) -> str:
        from tabulate import tabulate

        d = self.data
        lines = [f"dmfx.explain: {d['model']} | {'training step (forward + backward)' if d['training'] else 'inference'}"
                 f" | {d['device']} | torch {d['torch']}"]
        before, after = d["totals"]["before"], d["totals"]["after"]
        rows = []
        for c in CLASSES:
            b, a = before.get(c), after.get(c)
            if not b and not a:
                continue
            b = b or {"flop_pct": 0, "bytes": 0, "bytes_pct": 0, "kernels": 0, "ops": 0}
            a = a or {"flop_pct": 0, "bytes": 0, "bytes_pct": 0, "kernels": 0, "ops": 0}
            label = c + (" (no data moved)" if c == VIEW else "")
            rows.append([label, f"{b['flop_pct']:.2f}", f"{a['flop_pct']:.2f}", _fmt_bytes(b["bytes"]), f"{b['bytes_pct']:.1f}",
                         _fmt_bytes(a["bytes"]), f"{a['bytes_pct']:.1f}",
                         b["kernels"] if c != VIEW else f"({b['ops']} ops)", a["kernels"] if c != VIEW else f"({a['ops']} ops)"])
        dm = d["data_movement"]
        rows.append(["total", "100", "100", _fmt_bytes(dm["before_bytes"]), "100", _fmt_bytes(dm["after_bytes"]), "100",
                     d["kernels"]["before"], d["kernels"]["after"]])
        lines.append(tabulate(rows, headers=["class", "flop % before", "flop % after", "bytes before", "% ", "bytes after", "% ",
                                             "kernels before", "kernels after"], tablefmt="github", disable_numparse=True))
        lines.append(f"data movement: {_fmt_bytes(dm['before_bytes'])} -> {_fmt_bytes(dm['after_bytes'])}: "
                     f"{dm['reduction_pct']:.2f}% less (the paper: up to {PAPER_REDUCTION_PCT}% on a BERT-large layer); "
                     f"kernels {d['kernels']['before']} -> {d['kernels']['after']}")
        rt = d.get("runtime") or {}
        if rt:
            parts = [f"{s}: static {_fmt_bytes(rt[s]['static_bytes'])} vs dispatched {_fmt_bytes(rt[s]['total'])} "
                     f"({rt[s]['diff_pct']:+.1f}%)" for s in ("before", "after") if s in rt]
            lines.append("run-time check (bytes counted by a dispatch mode in a real step): " + "; ".join(parts))
        up = d.get("unpad")
        if up:
            lines.append(f"unpad: {up['rows_computed']} of {up['rows_padded']} token rows computed ({up['padding_pct']:.0f}% "
                         f"padding skipped); bytes moved, counted at run time: {_fmt_bytes(up['bytes_without_unpad'])} "
                         f"fused without unpad -> {_fmt_bytes(up['bytes_with_unpad'])} with it ({up['reduction_pct']:.1f}% less)")
        pm = d.get("peak_memory") or {}
        if pm:
            lines.append(f"peak live memory of a step ({pm['after']['method']}): before {_fmt_bytes(pm['before']['peak_bytes'])}, "
                         f"after {_fmt_bytes(pm['after']['peak_bytes'])}")
        # fused kernels, grouped
        groups: dict[tuple, dict] = {}
        for r in d["ops"]["after"]:
            if r["class"] != FUSED:
                continue
            key = (r["graph"], r["op"], ", ".join(r["absorbed"]) or r["note"])
            g = groups.setdefault(key, {"n": 0, "bytes": 0, "time": 0.0})
            g["n"] += 1
            g["bytes"] += r["bytes_read"] + r["bytes_written"]
            g["time"] += r.get("time_us") or 0.0
        if groups:
            lines.append("")
            lines.append("dmfx kernels (absorbed ATen ops):")
            lines.append(tabulate([[g, op, v["n"], _fmt_bytes(v["bytes"]), ab] for (g, op, ab), v in groups.items()],
                                  headers=["graph", "kernel", "count", "bytes", "absorbed"], tablefmt="github", disable_numparse=True))
        if d.get("attention_forms"):
            lines.append("")
            lines.append("attention (form chosen by the cost model; see passes/attention.py):")
            forms: dict[tuple, int] = {}
            for a in d["attention_forms"]:
                forms[(a["form"], a["why"])] = forms.get((a["form"], a["why"]), 0) + 1
            lines.append(tabulate([[f, n, why] for (f, why), n in forms.items()], headers=["form", "count", "why"],
                                  tablefmt="github", disable_numparse=True))
        if d.get("copies_added"):
            lines.append("")
            lines.append("copies dmfx added or kept knowingly (the layout search prices every copy; the others are gone):")
            lines.append(tabulate([[c.get("graph", ""), c["node"], _fmt_bytes(c["bytes"]), c["why"]] for c in d["copies_added"]],
                                  headers=["graph", "node", "bytes", "why"], tablefmt="github", disable_numparse=True))
        cov = d["coverage"]
        lines.append("")
        lines.append(f"coverage: {cov['fused']} of {cov['total']} memory-bound ATen ops are inside dmfx kernels "
                     f"({100 * cov['ratio']:.1f}%)")
        if cov["misses"]:
            miss_groups: dict[tuple, int] = {}
            for m in cov["misses"]:
                key = (m["graph"], m["op"], m["reason"])
                miss_groups[key] = miss_groups.get(key, 0) + 1
            ranked = sorted(miss_groups.items(), key=lambda kv: -kv[1])
            lines.append(tabulate([[g, op, n, why[:100]] for (g, op, why), n in ranked[:top]],
                                  headers=["graph", "not fused", "count", "why"], tablefmt="github", disable_numparse=True))
            if len(ranked) > top:
                lines.append(f"... and {len(ranked) - top} more kinds (report.to_dict()['coverage']['misses'])")
        ms = d.get("measure")
        if ms:
            lines.append("")
            lines.append(f"measured: copy bandwidth {ms['copy_bandwidth_gbs']:.1f} GB/s; "
                         f"kernel time before {ms['time_ms']['before']:.2f} ms, "
                         f"after {ms['time_ms']['after']:.2f} ms (sum over kernels, run one by one)")
            mb = [r for r in d["ops"]["after"] if r.get("mue") is not None]
            mb.sort(key=lambda r: -(r.get("time_us") or 0))
            lines.append(tabulate([[r["graph"], r["node"], r["op"], f"{r['time_us']:.1f}", _fmt_bytes(r["bytes_read"] + r["bytes_written"]),
                                    f"{r['mue']:.1f}"] for r in mb[:top]],
                                  headers=["graph", "node", "op", "us", "bytes", "MUE %"], tablefmt="github", disable_numparse=True))
        return "\n".join(lines)

    def plot(self, path: str) -> str | None:
        """A PNG of bytes per class before/after (needs matplotlib; returns None without it)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        classes = [c for c in CLASSES if c != VIEW and (c in self.data["totals"]["before"] or c in self.data["totals"]["after"])]
        b = [self.data["totals"]["before"].get(c, {}).get("bytes", 0) / 1e6 for c in classes]
        a = [self.data["totals"]["after"].get(c, {}).get("bytes", 0) / 1e6 for c in classes]
        fig, ax = plt.subplots(figsize=(8, 4))
        xs = range(len(classes))
        ax.bar([x - 0.2 for x in xs], b, 0.4, label="before")
        ax.bar([x + 0.2 for x in xs], a, 0.4, label="after (dmfx)")
        ax.set_xticks(list(xs), classes, rotation=20)
        ax.set_ylabel("MB moved")
        ax.set_title(f"{self.data['model']}: {self.reduction_pct:.1f}% less data movement")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"
