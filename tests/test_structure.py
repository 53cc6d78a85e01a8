"""The package's import graph: no cycles, and imports run one way through the rooms.

The layer table is docs/architecture.md's (the one source: this test reads it, so the two cannot
disagree). A room is a folder of modules (``train/config/``, ``eval/``); a module imports only from its
own layer or below, at any level of the file, function-level imports included. Besides modules, rooms
and the three packages (``train`` < ``eval`` < ``launch``) must not import each other in a circle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "architecture.md"
PACKAGES = ("train", "eval", "launch")


def layer_table(text: str | None = None) -> dict[str, tuple[int, set[str]]]:
    """Room (dotted, e.g. ``train.config``) -> (layer, its module file names), from the table under the
    ``<!-- layers ... -->`` marker. A row with an empty layer and room continues the room above it."""
    text = TABLE.read_text() if text is None else text
    rows = text.split("<!-- layers", 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    rooms: dict[str, tuple[int, set[str]]] = {}
    room = None
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 4, f"{TABLE}: a layer row has 4 cells: {row!r}"
        if cells[0]:
            room = cells[1].strip("`").rstrip("/").replace("/", ".")
            assert room not in rooms, f"{TABLE}: room {room} listed twice"
            rooms[room] = (int(cells[0]), set())
        assert room is not None, f"{TABLE}: the table's first row must name its room"
        rooms[room][1].update(re.findall(r"`([\w]+\.py)`", cells[3]))
    return rooms


ROOMS = layer_table()


def modules() -> dict[str, str]:
    """Module name -> source of every module (package ``__init__`` files are empty: tested below)."""
    found = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name != "__init__.py":
                found[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path.read_text()
    return found


def room(module: str) -> str:
    return module.rsplit(".", 1)[0]


def layer(module: str) -> int:
    assert room(module) in ROOMS, f"{module}: its room {room(module)} is not in {TABLE.name}'s layer table"
    return ROOMS[room(module)][0]


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


def cycles(g: dict[str, set[str]]) -> list[str]:
    state, found = {}, []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1:
                found.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


def collapse(g: dict[str, set[str]], key) -> dict[str, set[str]]:
    """The graph between groups of modules (``key(module)``: its room, its package)."""
    out: dict[str, set[str]] = {}
    for m, targets in g.items():
        out.setdefault(key(m), set()).update(key(t) for t in targets if key(t) != key(m))
    return out


def test_the_table_lists_every_module_and_packages_are_empty():
    on_disk: dict[str, set[str]] = {}
    for m in modules():
        layer(m)
        on_disk.setdefault(room(m), set()).add(m.rsplit(".", 1)[1] + ".py")
    for r, (_, listed) in ROOMS.items():
        assert listed == on_disk.get(r, set()), (
            f"{TABLE.name}: room {r} lists {sorted(listed)}, the folder has {sorted(on_disk.get(r, set()))}")
    for folder in PACKAGES:
        for init in (ROOT / folder).rglob("__init__.py"):
            assert not init.read_text().strip(), f"{init}: keep package __init__ files empty (no re-exports)"


def test_imports_run_one_way(extra: dict[str, str] | None = None):
    wrong = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
             for m, targets in graph(extra).items() for t in sorted(targets) if layer(t) > layer(m)]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_import_cycles(extra: dict[str, str] | None = None):
    g = graph(extra)
    found = [f"modules: {c}" for c in cycles(g)]
    found += [f"rooms: {c}" for c in cycles(collapse(g, room))]
    found += [f"packages: {c}" for c in cycles(collapse(g, lambda m: m.split(".")[0]))]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_packages_stack_train_eval_launch():
    """Each package's rooms sit above every room of the package below it."""
    by_package = {p: [ROOMS[r][0] for r in ROOMS if r.split(".")[0] == p] for p in PACKAGES}
    for low, high in zip(PACKAGES, PACKAGES[1:]):
        assert max(by_package[low]) < min(by_package[high]), f"{TABLE.name}: {high}'s rooms must sit above {low}'s"


def private_imports(sources: dict[str, str]) -> list[str]:
    """``from longsft.X import _name`` in ``sources`` (name -> text): a private name used outside its module."""
    found = []
    for name, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("longsft."):
                found += [f"{name}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_is_used_outside_its_module():
    """The package and the benchmarks import only public names (tests may reach inside)."""
    bench = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "bench").glob("*.py"))}
    wrong = private_imports({**modules(), **bench})
    assert not wrong, "private names imported across modules (make them public, with a name that says what they are):\n" \
        + "\n".join(wrong)
    assert private_imports({"x": "from longsft.train.parallel.ring import _plan\n"})  # the check can fail


def test_the_checks_can_fail():
    """A planted upward import, planted cycles (two modules; two rooms; two packages), a relative import, a
    module the table does not list and a table row that names a missing module are all caught."""
    with pytest.raises(AssertionError, match="train.common._up .layer 0. imports launch.cli"):
        test_imports_run_one_way({"train.common._up": "from longsft.launch.cli import main\n"})
    with pytest.raises(AssertionError, match="modules: train.common._a -> train.common._b"):
        test_no_import_cycles({"train.common._a": "def f():\n    from longsft.train.common._b import g\n",
                               "train.common._b": "from longsft.train.common import _a\n"})
    with pytest.raises(AssertionError, match="rooms: train.data -> train.parallel -> train.data"):
        test_no_import_cycles({"train.parallel._x": "from longsft.train.data import _y\n",
                               "train.data._y": "import longsft.train.parallel.comm\n"})
    with pytest.raises(AssertionError, match="packages: eval -> train -> eval"):
        test_no_import_cycles({"train.training._z": "from longsft.eval.harness import run_eval\n"})
    with pytest.raises(AssertionError, match="relative import"):
        graph({"train.common._rel": "from .io import DataError\n"})
    with pytest.raises(AssertionError, match="room train.nowhere is not in"):
        layer("train.nowhere.x")
    table = TABLE.read_text().replace("`errors.py`, ", "`errors.py`, `gone.py`, ", 1)
    assert "gone.py" in layer_table(table)["train.common"][1]


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
