"""The package's import graph: no cycles, and imports run one way through the rooms.

Layers, bottom to top (a module imports only from its own layer or below, at any level of the
file, function-level imports included):

0. ``train.common``: errors, file I/O, the LLM client and cache, version guards, the --help formatter
1. ``eval.scoring``: the shared scorer (judgement parsing, metrics, bootstrap, ``score``)
2. ``train.config``: typed config and recipes (with ``train.parallel.backends``, the start-up check of
   which sequence-parallel backend can run here, which config validation calls)
3. ``train.parallel``, ``train.data``: process groups and sequence parallelism; samples and batches
4. ``train.model``: model, tokenizer, loss
5. ``train.training``, ``train.plan``, ``train.datagen``: the training loop and the memory planner whose
   choices it takes per stage (kept attention, the tied head's weight); data construction
6. ``eval``: evaluation harness, backends, report, ConStory, serve
7. ``train.cluster``: SLURM submission and sweeps
8. ``train.cli``: the command line
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [("train.common",), ("eval.scoring",), ("train.config", "train.parallel.backends"), ("train.parallel", "train.data"),
          ("train.model",), ("train.training", "train.plan", "train.datagen"), ("eval",), ("train.cluster",),
          ("train.cli",)]


def modules() -> dict[str, str]:
    """Module name -> source of every module (package ``__init__`` files are empty: tested below)."""
    found = {}
    for folder in ("train", "eval"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name != "__init__.py":
                found[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path.read_text()
    return found


def layer(module: str) -> int:
    best = (-1, -1)  # (prefix length, layer): the most specific prefix wins (eval.scoring over eval)
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                best = max(best, (len(p), i))
    assert best[1] >= 0, f"{module} is in no layer: add its room to LAYERS (and to this docstring)"
    return best[1]


def imports(module: str, source: str, known: set[str]) -> set[str]:
    """longsft modules ``source`` imports, anywhere in the file except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(source)
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{module}:{node.lineno}: relative import; the package imports absolutely")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("longsft."):
            base = node.module.removeprefix("longsft.")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix("longsft.") for a in node.names if a.name.startswith("longsft.")]
        out |= {n for n in names if n in known}
    return out


def graph(extra: dict[str, str] | None = None) -> dict[str, set[str]]:
    mods = {**modules(), **(extra or {})}
    return {m: imports(m, src, set(mods)) - {m} for m, src in mods.items()}


def test_every_module_is_in_a_layer_and_packages_are_empty():
    for m in modules():
        layer(m)
    for init in list((ROOT / "train").rglob("__init__.py")) + list((ROOT / "eval").rglob("__init__.py")):
        assert not init.read_text().strip(), f"{init}: keep package __init__ files empty (no re-exports)"


def test_imports_run_one_way(extra: dict[str, str] | None = None):
    wrong = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
             for m, targets in graph(extra).items() for t in sorted(targets) if layer(t) > layer(m)]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_import_cycles(extra: dict[str, str] | None = None):
    g, state, cycles = graph(extra), {}, []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_can_fail():
    """A planted upward import (common -> cli) and a planted pair importing each other are both caught."""
    with pytest.raises(AssertionError, match="train.common._up .layer 0. imports train.cli"):
        test_imports_run_one_way({"train.common._up": "from longsft.train.cli import main\n"})
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles({"train.common._a": "def f():\n    from longsft.train.common._b import g\n",
                               "train.common._b": "from longsft.train.common import _a\n"})
    with pytest.raises(AssertionError, match="relative import"):
        graph({"train.common._rel": "from .io import DataError\n"})


def test_ci_fails_where_a_local_run_skips(monkeypatch):
    """``skip_or_fail``: without SLURM or root a local run skips; under ``LONGSFT_CI=1`` (``.ci/run``) it fails."""
    from conftest import skip_or_fail

    skip_or_fail("SLURM", None)  # available: runs on
    monkeypatch.delenv("LONGSFT_CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no slurmctld"):
        skip_or_fail("SLURM", "no slurmctld")
    monkeypatch.setenv("LONGSFT_CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI must run the SLURM tests, but: no slurmctld"):
        skip_or_fail("SLURM", "no slurmctld")
    assert "LONGSFT_CI=1 make test" in (ROOT / ".ci" / "run").read_text()
