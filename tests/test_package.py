"""The package as installed and as read: every subpackage imports from outside the repo, the console script
runs, every import between the package's modules resolves to a file of the tree (as an IDE finds it), the
layers keep their direction, and no module-level import cycle exists."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsfp4"
LAYERS = ("convert", "layout", "runtime", "kernels")  # top-level folders, dsfp4.<name> through dsfp4/<name>
FACE = ("dsfp4.cli", "dsfp4.server", "dsfp4.tools", "dsfp4.synthetic", "dsfp4.projection")
HUB = "dsfp4.hub"  # below convert (convert --from-hub), above layout
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
GROUND = ("dsfp4.errors", "dsfp4.units", "dsfp4.version", "dsfp4.value_types")  # what layout may import besides itself


@pytest.mark.slow
def test_subpackages_import_from_outside_the_repo(tmp_path):
    code = (
        "import dsfp4, dsfp4.cli.main, dsfp4.convert.pipeline, dsfp4.layout.manifest, "
        "dsfp4.runtime.engine, dsfp4.kernels.linear; import importlib.util as u; "
        "assert u.find_spec('convert') is None and u.find_spec('layout') is None; print(dsfp4.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip()


def test_a_clone_named_dsfp4_does_not_shadow_the_package_from_the_folder_above(tmp_path):
    """Run from the folder that holds a clone named dsfp4, `import dsfp4` would take the clone for an empty namespace
    package; the install's path entry (src/, pyproject.toml) puts the real package ahead of it."""
    (tmp_path / "dsfp4").symlink_to(ROOT, target_is_directory=True)
    code = "import dsfp4; print(dsfp4.Engine.__name__, dsfp4.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("Engine "), out.stderr[-500:]


@pytest.mark.slow
def test_console_script_runs(tmp_path):
    exe = Path(sys.executable).with_name("dsfp4")
    out = subprocess.run([str(exe), "--help"], cwd=tmp_path, capture_output=True, text=True, check=True)
    for command in ("convert", "download", "profile-hot", "run", "inspect", "verify"):
        assert command in out.stdout


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name, found by walking dsfp4/ and the folders its links name."""
    found = {}
    for root in (PACKAGE, *(ROOT / name for name in LAYERS)):
        base = "dsfp4" if root == PACKAGE else f"dsfp4.{root.name}"
        for path in root.rglob("*.py"):  # rglob does not enter dsfp4/<layer>, the links
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((base, *parts[: -1 if parts[-1] == "__init__" else None]))
            found[name] = path
    return found


def _imports(path: Path, name: str, top_level_only: bool) -> list[tuple[str, int]]:
    """(imported dsfp4 module or name, line) of one module; top_level_only: what runs when it is imported (not
    inside functions, nor under TYPE_CHECKING)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if top_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                out.extend((f"{base}.{a.name}", child.lineno) for a in child.names if base.startswith("dsfp4"))
            elif isinstance(child, ast.Import):
                out.extend((a.name, child.lineno) for a in child.names if a.name.startswith("dsfp4"))
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def _target(modules: dict[str, Path], imported: str) -> str | None:
    """The module an import names: `pkg.mod` itself, or `pkg` when it imports a name defined in it."""
    if imported in modules:
        return imported
    parent = imported.rpartition(".")[0]
    return parent if parent in modules else None


@functools.cache
def _bound(path: Path) -> frozenset[str]:
    """The names a module binds anywhere (assigned, defined or imported), parsed once for all its importers."""
    tree = ast.parse(path.read_text())
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {n.name for n in ast.walk(tree) if isinstance(n, DEFINITIONS)}
    bound |= {
        (a.asname or a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom | ast.Import)
        for a in n.names
    }
    return frozenset(bound)


@pytest.mark.slow
def test_every_import_between_modules_resolves_to_a_file_of_the_tree():
    """Read the tree as an IDE does: dsfp4.a.b is dsfp4/a/b.py or dsfp4/a/b/__init__.py (through the links), and
    a name imported from a module is defined or imported there."""
    modules = _modules()
    missing = []
    for name, path in modules.items():
        for imported, line in _imports(path, name, top_level_only=False):
            target = _target(modules, imported)
            parts = (target or imported).split(".")
            on_disk = ROOT.joinpath(*parts).with_suffix(".py")
            if target is None or not (on_disk.is_file() or ROOT.joinpath(*parts, "__init__.py").is_file()):
                missing.append(f"{path.relative_to(ROOT)}:{line}: {imported}")
                continue
            # a name: it must be bound at the top level of the module
            if target != imported and imported.rpartition(".")[2] not in _bound(modules[target]):
                missing.append(f"{path.relative_to(ROOT)}:{line}: {imported} (no such name)")
    assert not missing, "imports the tree does not resolve:\n" + "\n".join(missing)


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {
            t for imported, _ in _imports(path, name, top_level_only) if (t := _target(modules, imported)) != name and t
        }
        for name, path in modules.items()
    }


def _within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


# (importer, what it must not import) pairs of packages; layout is checked against what it may import
FORBIDDEN = (
    (("dsfp4.kernels",), ("dsfp4.runtime", "dsfp4.convert")),
    (("dsfp4.convert",), ("dsfp4.runtime",)),
    (("dsfp4.runtime",), ("dsfp4.convert",)),
    (tuple(f"dsfp4.{x}" for x in LAYERS), FACE),
    (("dsfp4.runtime", "dsfp4.kernels"), (HUB,)),
    ((HUB,), ("dsfp4.convert", "dsfp4.runtime", "dsfp4.kernels", *FACE)),
)


def test_the_layers_keep_their_direction():
    """layout imports nothing but errors, units and version; kernels no runtime; convert and runtime never each
    other; none of them the CLI, the server, the tools, the synthetic models or the whole-model projection; the hub
    only what lies below it, and of the layers only convert imports it."""
    bad = []
    for name, imports in _graph(top_level_only=False).items():
        for t in sorted(imports):
            layout_up = _within(name, "dsfp4.layout") and not _within(t, "dsfp4.layout", *GROUND)
            if layout_up or any(_within(name, *a) and _within(t, *b) for a, b in FORBIDDEN):
                bad.append(f"{name} -> {t}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_module_level_import_cycle():
    graph = _graph(top_level_only=True)
    seen: dict[str, int] = {}  # 1 on the path, 2 done
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in seen:
                walk(nxt, [*path, nxt])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            walk(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
