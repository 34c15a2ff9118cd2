"""The architecture, checked from the source: layers, import rules, module size and docstrings
(docs/architecture.md, "The file tree").

Read statically (``ast``), so nothing is imported and every module is seen, frameworks or not.
The layers count every import, lazy ones (inside a function) included; cycles count the imports
that run when a module is imported (a lazy import, or one under ``if TYPE_CHECKING``, does not).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "horovod"
MAX_LINES = 800

# Packages of horovod, lowest layer first. A module may import only from its own package and
# from the packages this table allows (an arrow may only point down), lazily or not.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "rendezvous": {"common"},
    "transport": {"common", "rendezvous"},
    "collectives": {"common", "transport"},
    "core": {"common", "rendezvous", "transport", "collectives"},
    "frontend": {"common", "core"},
    # the device data plane: the executor's seam for device tensors (torch installs it)
    "device": {"common", "transport", "collectives", "core"},
    # elastic training, worker side: states and the retry loop (the driver is runner's)
    "elastic": {"common", "rendezvous", "core", "frontend"},
    "numpy": {"common", "frontend", "elastic"},
    "keras_common": {"common", "frontend", "elastic"},
    "torch": {"common", "core", "frontend", "elastic", "device"},
    # (torch: GPU tensors to the device plane through horovod.torch, by DLPack)
    "tensorflow": {"common", "core", "frontend", "keras_common", "elastic", "torch"},
    "jax": {"common", "frontend", "torch"},  # (torch: GPU arrays to the device plane)
    "mxnet": {"common", "frontend"},
    # Keras 3 on the TensorFlow backend uses horovod.tensorflow's compression
    "keras": {"common", "core", "frontend", "keras_common", "tensorflow", "jax", "elastic"},
    # beside the stack: the launcher never imports the training runtime
    "runner": {"common", "rendezvous", "__version__"},
    # cluster engines as launchers: Ray actors, like the runner, never the training runtime
    "ray": {"common", "rendezvous", "runner"},
    # the profiler: a job of its own through the PyTorch frontend
    "profile": {"common", "torch"},
    # (torch, tensorflow, numpy: the estimators' training functions, in the Spark tasks)
    "spark": {"common", "rendezvous", "runner", "torch", "tensorflow", "numpy"},
    # tools on top: nothing in the runtime imports them (no layer above lists them)
    "timeline": {"common"},
    "testing": {"common", "core", "frontend", "transport", "numpy"},
    # (transport: the MPI plane benchmark times the plane's MPI calls; collectives: the Adasum
    # benchmark times its combination)
    "benchmarks": {
        "common",
        "collectives",
        "testing",
        "numpy",
        "torch",
        "tensorflow",
        "jax",
        "transport",
        "device",
    },
    # ``horovod`` itself: its version and ``horovod.run``
    "horovod": {"runner"},
}


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


MODULES = dict(_modules())


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "horovod"


def _is_package(module: str) -> bool:
    path = MODULES.get(module)
    return path is not None and path.name == "__init__.py"


def _module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (not in functions, not TYPE_CHECKING)."""

    def walk(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from walk(node.orelse)
            else:
                for field in ("body", "orelse", "finalbody"):
                    yield from walk(getattr(node, field, []) or [])
                for handler in getattr(node, "handlers", []) or []:
                    yield from walk(handler.body)

    yield from walk(tree.body)


def _targets(node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str | None]]:
    """(horovod module imported, name taken from it or None) for one import statement."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "horovod":
                yield alias.name, None
        return
    if node.level or not node.module or node.module.split(".")[0] != "horovod":
        return
    for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        if sub in MODULES:  # ``from horovod.x import module``
            yield sub, None
        else:
            yield node.module, alias.name


TREES = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}


def test_every_module_is_small():
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules past {MAX_LINES} lines (split them along a seam): {big}"


def test_every_module_says_what_it_owns_and_must_not_touch():
    missing = []
    for m, tree in TREES.items():
        doc = ast.get_docstring(tree) or ""
        if m.endswith("__main__"):
            continue  # ``python -m`` entry points: the package's docstring speaks for them
        if not doc or "must not" not in doc.lower():
            missing.append(m)
    assert not missing, f"modules without a docstring naming what they must not touch: {missing}"


def test_imports_point_down_the_layers():
    wrong = []
    for m, tree in TREES.items():
        mine = _package(m)
        assert mine in ALLOWED, f"package {mine!r} is in no layer: add it to ALLOWED"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, name in _targets(node):
                theirs = _package(target) if target != "horovod" else (name or "horovod")
                if theirs != mine and theirs not in ALLOWED[mine]:
                    wrong.append(f"{m} imports {target}{'.' + name if name else ''}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def _private_uses(m: str, tree: ast.Module) -> Iterator[str]:
    mine = m if _is_package(m) else m.rsplit(".", 1)[0]

    def foreign(target: str) -> bool:
        pkg = target if _is_package(target) else target.rsplit(".", 1)[0]
        return pkg != mine and not pkg.startswith(mine + ".") and not mine.startswith(pkg + ".")

    aliases: dict[str, str] = {}  # local name -> horovod module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target, name in _targets(node):
                if target not in MODULES:
                    continue
                leaf = target.rsplit(".", 1)[-1]
                if name is not None and name.startswith("_") and not name.startswith("__"):
                    if foreign(target):
                        yield f"{m}: from {target} import {name}"
                elif name is None and leaf.startswith("_") and foreign(target):
                    yield f"{m}: imports private module {target}"
                if name is None:
                    for alias in node.names:
                        local = alias.asname or alias.name.rsplit(".", 1)[-1]
                        if target.endswith(alias.name.rsplit(".", 1)[-1]):
                            aliases[local] = target
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and foreign(aliases[node.value.id])
        ):
            yield f"{m}: {node.value.id}.{node.attr} ({aliases[node.value.id]})"


def test_no_private_name_is_used_across_packages():
    found = [use for m, tree in TREES.items() for use in _private_uses(m, tree)]
    assert not found, "private names used from another package:\n" + "\n".join(found)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, tree in TREES.items():
        for node in _module_level_imports(tree):
            for target, _ in _targets(node):
                while target not in MODULES and "." in target:
                    target = target.rsplit(".", 1)[0]
                # a package importing its own submodules is how packages are built
                if target in MODULES and target != m and not target.startswith(m + "."):
                    graph[m].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize(
    "source, expect",
    [
        ("from horovod.core.engine import _private\n", "from horovod.core.engine import _private"),
        ("from horovod import frontend as F\nF._hidden()\n", "F._hidden"),
        ("import horovod.core.engine as E\nE._x\n", "E._x"),
    ],
)
def test_the_private_name_check_catches(source, expect):
    found = list(_private_uses("horovod.torch.example", ast.parse(source)))
    assert any(expect in f for f in found), found


def test_the_cycle_check_catches_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_readme_runs_the_suite_ci_runs():
    """A newcomer's test command (README) and CI's install the same things (.ci/setup) and run
    the same pytest: otherwise tests CI runs skip on a newcomer's machine, or the reverse."""
    readme = (ROOT.parent / "README.md").read_text()
    ci = (ROOT.parent / ".ci" / "run").read_text()
    assert "bash .ci/setup && . .venv/bin/activate && python -m pytest -q\n" in readme
    assert "\nbash .ci/setup\n" in ci and "\npython -m pytest -q" in ci
    assert "pip install" not in ci, "installs belong in .ci/setup, which the README runs too"
