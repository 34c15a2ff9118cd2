"""Import rules that keep the layers honest (docs/architecture.md): an arrow may only point
down, and the launcher never imports the training runtime (nor the runtime the launcher)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "horovod"

# package -> packages/modules it must never import
FORBIDDEN = {
    "common": [
        "horovod.rendezvous",
        "horovod.transport",
        "horovod.collectives",
        "horovod.core",
        "horovod.frontend",
        "horovod.numpy",
        "horovod.runner",
        "horovod.testing",
    ],
    "rendezvous": [
        "horovod.transport",
        "horovod.collectives",
        "horovod.core",
        "horovod.frontend",
        "horovod.numpy",
        "horovod.runner",
    ],
    "transport": [
        "horovod.collectives",
        "horovod.core",
        "horovod.frontend",
        "horovod.numpy",
        "horovod.runner",
    ],
    "collectives": ["horovod.core", "horovod.frontend", "horovod.numpy", "horovod.runner"],
    "core": ["horovod.frontend", "horovod.numpy", "horovod.runner", "horovod.testing"],
    "timeline": [  # the timeline reader works on files alone
        "horovod.core",
        "horovod.transport",
        "horovod.collectives",
        "horovod.frontend",
        "horovod.runner",
    ],
    "runner": [
        "horovod.core",
        "horovod.transport",
        "horovod.collectives",
        "horovod.frontend",
        "horovod.numpy",
        "horovod.testing",
    ],
}


def imports_of(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports(package):
    bad = []
    for path in (ROOT / package).rglob("*.py"):
        for mod in imports_of(path):
            if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert bad == []
