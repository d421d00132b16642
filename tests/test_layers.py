"""The package layers (docs/architecture.md), checked on the source and on real imports:

- the torch-free parts of ``supervisor`` never import torch nor ``supervisor.resumable``, and the
  login-node commands load no torch (``python -X importtime -m supervisor status|watch``);
- ``supervisor.resumable`` pulls in nothing of the reference trainer nor of the drill: the drill's
  hangs are injected (supervisor/format/hooks.py), not imported;
- its public surface is its ``__all__``, every module beside it private;
- ``train_ref`` uses the library through that surface only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "supervisor" / "resumable"
# The one train_ref module that reaches into the library's privates: the GPU self-test of the
# pinned-memory stager, which has no public handle (it is the checkpointer's).
PRIVATE_USERS = {REPO / "train_ref" / "gpu_check.py"}


def _imports(path: Path, top_level_only: bool) -> Iterator[tuple[int, str]]:
    """(line, module) of each import in ``path``; with ``top_level_only`` the module-level ones
    (a function's own import runs only when called: the CLI defers torch that way)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def _torch_free_modules() -> list[Path]:
    return [p for p in (REPO / "supervisor").rglob("*.py") if LIBRARY not in p.parents]


def test_torch_free_parts_import_neither_torch_nor_the_library() -> None:
    bad = [
        f"{p.relative_to(REPO)}:{line} imports {mod}"
        for p in _torch_free_modules()
        for line, mod in _imports(p, top_level_only=True)
        if mod == "torch" or mod.startswith(("torch.", "supervisor.resumable", "train_ref"))
    ]
    assert not bad, bad


def test_the_library_imports_no_demo_and_no_drill_module() -> None:
    bad = [
        f"{p.relative_to(REPO)}:{line} imports {mod}"
        for p in LIBRARY.glob("*.py")
        for line, mod in _imports(p, top_level_only=False)
        if mod.startswith(("train_ref", "supervisor.drill", "supervisor.cli", "supervisor.watch"))
    ]
    assert not bad, bad


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return set(out.split())


def test_importing_the_library_loads_no_demo_or_drill_module() -> None:
    loaded = _loaded_after("import supervisor.resumable")
    assert "torch" in loaded and "supervisor.resumable._resumable" in loaded  # the probe sees imports
    assert not {m for m in loaded if m.startswith(("train_ref", "supervisor.drill", "supervisor.watch"))}
    # The adapters' frameworks load on first use of their name only (supervisor/resumable/__init__.py).
    assert not {m for m in loaded if m.split(".")[0] in ("lightning", "accelerate", "transformers")}


def test_the_public_surface_is_all_and_nothing_else() -> None:
    import supervisor.resumable as lib

    public = {n for n in dir(lib) if not n.startswith("_")}
    assert public == set(lib.__all__)
    assert all(p.name.startswith("_") for p in LIBRARY.glob("*.py"))


def test_the_reference_trainer_uses_the_public_surface_only() -> None:
    bad = [
        f"{p.relative_to(REPO)}:{line} imports {mod}"
        for p in (REPO / "train_ref").glob("*.py")
        if p not in PRIVATE_USERS
        for line, mod in _imports(p, top_level_only=False)
        if mod.startswith("supervisor.resumable._")
    ]
    assert not bad, bad


@pytest.mark.parametrize("command", [["status"], ["watch", "--help"], ["ckpt", "list"]])
def test_login_node_commands_load_no_torch(tmp_path: Path, command: list[str]) -> None:
    args = [*command, "--ckpt-root", str(tmp_path)] if command != ["watch", "--help"] else command
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "supervisor", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    imported = {ln.split("|")[-1].strip() for ln in p.stderr.splitlines() if ln.startswith("import time:")}
    assert "supervisor.cli.main" in imported, p.stderr[-2000:]  # the probe sees our own imports
    assert not {m for m in imported if m == "torch" or m.startswith(("torch.", "supervisor.resumable"))}


def test_the_watchdog_knows_nothing_of_slurm() -> None:
    """The watchdog runs anywhere (a while-true wrapper, torchrun alone); the SLURM glue sits above it
    and the notice signal both share is declared in the format layer (supervisor/format/notice.py)."""
    bad = [
        f"{p.relative_to(REPO)}:{line} imports {mod}"
        for p in (REPO / "supervisor" / "watch").glob("*.py")
        for line, mod in _imports(p, top_level_only=False)
        if mod.startswith("supervisor.slurm")
    ]
    assert not bad, bad
