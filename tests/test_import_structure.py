"""The package's import graph, read from the source with `ast`: no cycles between modules of
``ascend_vlm``, and no module reaches into another's privates.

Private means a leading underscore (dunders excepted): a private module (``ops/_op_spec.py``) is
visible only inside its parent package, a private name only inside its own module. Private names
of other libraries (torch, transformers, the standard library) are read only in the
``ascend_vlm/_compat`` package, where each has a named probe. Imports under ``if TYPE_CHECKING:``
are annotations, not imports, and are skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ascend_vlm

PACKAGE_DIR = Path(ascend_vlm.__file__).resolve().parent


def _module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _module_files()
COMPAT = "ascend_vlm._compat"
EXTENSION = "ascend_vlm._C"  # built, not in the source tree; private to the top-level package


def _in_compat(module: str) -> bool:
    return module == COMPAT or module.startswith(COMPAT + ".")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _imports(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of `module`, top-level
    and inside functions alike, except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for statement in node.body
        for child in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".")
                if path.name != "__init__.py":
                    anchor.pop()
                anchor = anchor[: len(anchor) - node.level + 1]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found += [(source, alias.name, node.lineno) for alias in node.names]
    return found


def _target_module(source: str, name: str | None) -> str:
    """The ascend_vlm module an import binds: ``from pkg import mod`` binds the module."""
    if name is not None and (f"{source}.{name}" in MODULES or f"{source}.{name}" == EXTENSION):
        return f"{source}.{name}"
    return source


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module, path in MODULES.items():
        for source, name, _ in _imports(module, path):
            target = _target_module(source, name)
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_walk_sees_the_package() -> None:
    # The checks below are vacuous if the walk finds nothing: it must see the known edges.
    graph = _graph()
    assert {"ascend_vlm.ops", "ascend_vlm.patching", "ascend_vlm.runtime"} <= set(MODULES)
    assert any("ascend_vlm.ops" in graph[m] for m in graph if m.startswith("ascend_vlm.patching."))
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_inside_the_package() -> None:
    assert _cycles(_graph()) == []


def test_no_module_imports_another_modules_privates() -> None:
    offences = []
    for module, path in MODULES.items():
        for source, name, line in _imports(module, path):
            target = _target_module(source, name)
            where = f"{path.relative_to(PACKAGE_DIR.parent)}:{line}"
            if target.startswith("ascend_vlm"):
                parts = target.split(".")
                for depth, part in enumerate(parts):
                    owner = ".".join(parts[:depth])
                    inside = module == owner or module.startswith(owner + ".")
                    if _is_private(part) and not inside:
                        offences.append(f"{where}: private module {target}")
            imports_a_private_name = (
                name is not None and target == source and _is_private(name) and source != module
            )
            if imports_a_private_name and (
                source.startswith("ascend_vlm") or not _in_compat(module)
            ):
                offences.append(f"{where}: private name {name} of {source}")
    assert offences == []


def _module_aliases(tree: ast.Module) -> set[str]:
    """Names bound to other libraries' modules by ``import x`` / ``import x as y``."""
    return {
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if not alias.name.startswith("ascend_vlm")
    }


def test_only_compat_reads_other_libraries_privates() -> None:
    offences = []
    for module, path in MODULES.items():
        if _in_compat(module):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = _module_aliases(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases and any(map(_is_private, chain)):
                where = f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}"
                offences.append(f"{where}: {ast.unparse(node)}")
    assert sorted(set(offences)) == []
