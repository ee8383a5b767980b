"""The layering of docs/architecture.md (section 2), checked on the source.

- No import cycle between modules of ``torchtitan/`` (imports inside functions count too).
- Each package imports only from the layers below it.
- ``distributed/`` applies the plans it is given: it names no attribute of a model family.
- Code cites the repository's own docs, never a design document outside it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "torchtitan"

# package -> the torchtitan packages it may import (besides itself). Entry points
# (``__main__`` modules, train, log_ranks) and the trainer sit on top and may import anything.
BASE = {"config", "tools", "distributed"}
ALLOWED = {
    "tools": set(),
    "config": {"tools"},
    "distributed": {"config", "tools"},
    "models": BASE,
    "loss": BASE,
    "optim": BASE,
    "metrics": BASE,
    "guards": BASE,
    "data": BASE | {"loss"},
    "checkpoint": BASE | {"guards"},
    "eval": BASE | {"data", "metrics", "loss", "models", "checkpoint"},
    "lora": BASE | {"models"},
    "preflight": BASE
    | {"models", "loss", "optim", "metrics", "guards", "data", "checkpoint", "eval", "lora"}
    | {"posttrain"},
    "planner": BASE
    | {"models", "loss", "optim", "metrics", "guards", "data", "checkpoint", "eval", "lora"}
    | {"preflight", "fault_tolerance"},
    "fault_tolerance": BASE | {"guards"},
    "posttrain": BASE
    | {"models", "loss", "optim", "metrics", "guards", "data", "checkpoint", "lora"},
}
ALLOWED["training"] = set(ALLOWED)  # the training layer sits on top: it may import any package
TOP = {
    "torchtitan.train",
    "torchtitan.training",
    "torchtitan.training.trainer",
    "torchtitan.training.posttrain",
    "torchtitan.training.builders",
    "torchtitan.training.train_step",
    "torchtitan.training.microbatch",
    "torchtitan.log_ranks",
    "torchtitan.launch",
    "torchtitan.convert",
}

# Names of Llama 3's modules and buffers: the generic layers must get them from a plan.
LLAMA_NAMES = {
    "tok_embeddings", "layers", "attention", "feed_forward", "attention_norm", "ffn_norm",
    "freqs_cis", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "n_heads", "n_kv_heads", "kv_heads",
}  # fmt: skip


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str) -> str:
    """The module a dotted import name refers to (``from a.b import c``: ``a.b.c`` if that is a
    module, else ``a.b``)."""
    path = ROOT.joinpath(*name.split("."))
    if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
        return name
    return name.rpartition(".")[0]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {_resolve(n) for n in names if n.startswith("torchtitan.")}
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        me = _module_name(path)
        edges = set()
        for target in _imports(path):
            # Importing a.b.c runs a and a.b first, unless they are our own ancestors.
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep != me and not me.startswith(dep + "."):
                    edges.add(dep)
        graph[me] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    assert len(graph) > 40, "the scan found too few modules"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else None


def test_each_layer_imports_only_the_layers_below() -> None:
    bad = []
    for module, edges in _graph().items():
        pkg = _package(module)
        if module in TOP or module.endswith("__main__") or pkg is None:
            continue
        for dep in edges:
            dep_pkg = _package(dep)
            if dep in TOP or (dep_pkg not in ALLOWED[pkg] | {pkg}):
                bad.append(f"{module} imports {dep}")
    assert not bad, "layering broken (docs/architecture.md, section 2):\n" + "\n".join(sorted(bad))


def test_distributed_names_no_model_attribute() -> None:
    found = []
    for path in sorted((PKG / "distributed").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.value
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                else None
            )
            if name in LLAMA_NAMES:
                found.append(f"{path.name}:{node.lineno}: {name}")
    assert not found, "distributed/ names model internals; put them in the model's plan:\n" + (
        "\n".join(found)
    )


@pytest.mark.parametrize("folder", ["torchtitan", "tests", "scripts", "benchmarks", "docs"])
def test_nothing_cites_a_document_outside_the_repository(folder: str) -> None:
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / folder).rglob("*"))
        if p.suffix in (".py", ".md", ".sh", ".toml") and p.name != "test_architecture.py"
        for i, line in enumerate(p.read_text().splitlines(), start=1)
        if "DESIGN" in line or "../shared" in line
    ]
    assert not hits, "cite docs/architecture.md instead:\n" + "\n".join(hits)


def test_the_layer_table_names_every_package() -> None:
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(ALLOWED), (
        f"add to ALLOWED (and docs/architecture.md, section 2): {packages ^ set(ALLOWED)}"
    )


# A newcomer reads a package at a sitting and a module at a glance (docs/architecture.md,
# section 2): about 15 modules a package, about 500 lines a module.
MAX_MODULES, MAX_LINES = 16, 520


def test_packages_and_modules_stay_small() -> None:
    big = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted(PKG.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    crowded = [
        f"{d.relative_to(ROOT)}: {n} modules"
        for d in sorted(PKG.rglob("*"))
        if d.is_dir()
        and (n := len([m for m in d.glob("*.py") if m.name != "__init__.py"])) > MAX_MODULES
    ]
    assert not big and not crowded, "split these:\n" + "\n".join(big + crowded)
