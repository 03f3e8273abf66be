"""The repository's structure, as docs/ARCHITECTURE.md states it: imports form a DAG, and a fusion
is found from its one name (pass module, pipeline entry, pass tests)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dmfx import passes

ROOT = Path(__file__).resolve().parents[1]
# importable name of each package -> its folder (pyproject.toml's package-dir)
PACKAGES = {"dmfx": ROOT / "dmfx", "dmfx.passes": ROOT / "passes", "dmfx.cuda_ops": ROOT / "cuda_ops"}


def _modules() -> dict[str, Path]:
    mods = {}
    for package, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = [p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The dmfx modules `name` imports, at module level or inside functions (a lazy import that
    closes a cycle is a cycle all the same). ``from . import x`` imports the submodule x, not the
    package (whose initialisation Python runs first for any submodule anyway)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [s for s in subs if s in mods] + ([base] if any(s not in mods for s in subs) else [])
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in mods and t != name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(u: str, path: list[str]) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (found := visit(v, path)):
                return found
        path.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u, [])):
            return found
    return None


def test_the_import_graph_of_dmfx_passes_and_cuda_ops_has_no_cycle():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert len(graph) > 40  # the walk found the packages
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_cuda_op_families_import_no_other_family():
    families = ("norm", "softmax", "pointwise", "attention", "cross_entropy")
    mods = _modules()
    for family in families:
        name = f"dmfx.cuda_ops.{family}"
        others = {f"dmfx.cuda_ops.{f}" for f in families if f != family}
        assert not (_imports(name, mods[name], mods) & others), f"{family} imports another family"


# Pipeline entries that are not fusions of their own module: (module they live in, their tests)
_HOSTED = {
    "remove_metadata_asserts": ("graph_utils", None),
    "norm_idioms": ("layer_norm", "layer_norm"),
    "lower_sdpa_calls": ("attention", "lower_sdpa_calls"),
    "noop_clones": ("attention", "attention"),
    "identity_clones": ("dropout", "dropout"),
    "restore_sdpa": ("attention", "lower_sdpa_calls"),
    "layout": ("layout", None),  # tests/test_layout_search.py
    "backward_layout": ("layout", None),
}


@pytest.mark.parametrize("name", passes.ALL_PASSES)
def test_a_pass_is_found_from_its_name(name):
    module, tests = _HOSTED.get(name, (name, name))
    folder = ROOT / "passes"
    assert (folder / f"{module}.py").is_file() or (folder / "backward" / f"{module}.py").is_file(), name
    if tests is not None:
        assert (ROOT / "tests" / f"test_pass_{tests}.py").is_file(), name
