"""The package's import graph, read from the source with `ast`: modules import only from their
own rank or below, features do not import each other, applications do not import each other,
no cycles between modules of ``ascend_vlm``, and no module reaches into another's privates.

Ranks, lowest first (``RANKS``): 0 core, 1 runtime, 2 ops, 3 models and shared data, 4 patching,
5 features, 6 applications, 7 the command line, 8 the package's face and test support. A
feature (rank 5) imports only itself and lower ranks: features meet through what lies below
them. So does an application (rank 6): what two apps share lies below both, or, for what
only their commands share (which checkpoint ``--model`` names, the feature options), in the
command line above them.

Private means a leading underscore (dunders excepted): a private module (``ops/_op_spec.py``) is
visible only inside its parent package, a private name only inside its own module. Private names
of other libraries (torch, transformers, the standard library) are read only in the
``ascend_vlm/_compat`` package, where each has a named probe. Imports under
``if TYPE_CHECKING:`` count like any other: an annotation depends on what it names.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
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
    """(imported module, imported name or None, line) for every import of `module`: top-level,
    inside functions and under ``if TYPE_CHECKING:`` alike."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
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


ROOT = "ascend_vlm"
FEATURES = 5
APPS = 6
COMMAND_LINE = 7
# The ranks whose packages do not import each other.
KEPT_APART = {FEATURES: "feature", APPS: "app"}
# Every module's rank: a key ranks the module or package it names and everything inside it
# (the longest key wins), except ROOT, which ranks only the package's own __init__.
RANKS: dict[str, int] = {
    # 0 core: errors, probes of other libraries' internals, backend choice, trace events, files.
    "ascend_vlm._errors": 0,
    "ascend_vlm._compat": 0,
    "ascend_vlm.kernel_backend": 0,
    "ascend_vlm._base_model": 0,
    "ascend_vlm._op_descriptor": 0,
    "ascend_vlm._version": 0,
    "ascend_vlm._files": 0,
    "ascend_vlm._byte_units": 0,
    "ascend_vlm.trace_events": 0,
    # 1 runtime: the Python face of csrc.
    "ascend_vlm.runtime": 1,
    # 2 ops: the torch.library ops.
    "ascend_vlm.ops": 2,
    # 3 models and shared data: family descriptors, the embedded default model, datasets.
    "ascend_vlm.models": 3,
    "ascend_vlm.default_model": 3,
    "ascend_vlm.data": 3,
    # 4 patching: the one mechanism that edits a model instance and reverts it.
    "ascend_vlm.patching": 4,
    # 5 features: each its own package.
    "ascend_vlm.pruning": FEATURES,
    "ascend_vlm.reuse": FEATURES,
    "ascend_vlm.quantization": FEATURES,
    "ascend_vlm.adapters": FEATURES,
    "ascend_vlm.batching": FEATURES,
    "ascend_vlm.observability": FEATURES,
    "ascend_vlm.vision_input": FEATURES,
    "ascend_vlm.distributed": FEATURES,
    # 6 applications: evaluation, fine-tuning, serving, verification, integrations.
    "ascend_vlm.evaluation": 6,
    "ascend_vlm.finetune": 6,
    "ascend_vlm.integrations": 6,
    "ascend_vlm.serving": 6,
    "ascend_vlm.verification": 6,
    # 7 the command line: the entry point, what the sub-commands share, and each app's
    # sub-command (its parser and run), which drive the apps.
    "ascend_vlm.commands": COMMAND_LINE,
    "ascend_vlm.__main__": COMMAND_LINE,
    "ascend_vlm.evaluation.cli": COMMAND_LINE,
    "ascend_vlm.finetune.cli": COMMAND_LINE,
    "ascend_vlm.serving.cli": COMMAND_LINE,
    "ascend_vlm.verification.cli": COMMAND_LINE,
    # 8 the package's face (its __init__ names every public part, lazily) and test support
    # (the mock NPU and the pytest plugins, loaded by tests and pytest only): both may import
    # every rank, and no module of the package imports them.
    ROOT: 8,
    "ascend_vlm.testing": 8,
}
# Imports allowed against the ranks until the change named beside each removes them (issue 37);
# the test fails once an entry's import is gone, so that the entry goes with it.
# integrations (the Trainer callback, FSDP loading) is the library fine-tuning is built on; it
# goes to rank 5 once it stops importing distributed, another feature.
_FINETUNE_ON_INTEGRATIONS = "fine-tuning is built on integrations"
EXEMPT_EDGES: dict[tuple[str, str], str] = {
    ("ascend_vlm.finetune.train", "ascend_vlm.integrations.callback"): _FINETUNE_ON_INTEGRATIONS,
    **{
        (f"ascend_vlm.finetune.{module}", "ascend_vlm.integrations.fsdp"): _FINETUNE_ON_INTEGRATIONS
        for module in ("held_out", "model_setup", "train")
    },
}


def _rank_entry(module: str, ranks: dict[str, int]) -> str | None:
    """The key of ``ranks`` that ranks ``module``; None when no key does."""
    keys = [key for key in ranks if module == key or (key != ROOT and module.startswith(key + "."))]
    return max(keys, key=len, default=None)


def _rank_offences(
    graph: dict[str, set[str]], ranks: dict[str, int], exempt: Collection[tuple[str, str]]
) -> list[str]:
    """Every module of ``graph`` without a rank, and, outside the ``exempt`` (importer,
    imported) pairs, every import of a higher rank than the importer's and every import of one
    feature (rank ``FEATURES``) or app (rank ``APPS``) by another."""
    offences = []
    for module in sorted(graph):
        entry = _rank_entry(module, ranks)
        if entry is None:
            offences.append(f"{module}: no rank (add it to RANKS)")
            continue
        for target in sorted(graph[module]):
            target_entry = _rank_entry(target, ranks)
            if target_entry is None or (module, target) in exempt:
                continue
            rank, target_rank = ranks[entry], ranks[target_entry]
            if target_rank > rank:
                offences.append(f"{module} (rank {rank}) imports {target} (rank {target_rank})")
            elif rank == target_rank and rank in KEPT_APART and entry != target_entry:
                kind = KEPT_APART[rank]
                offences.append(f"{kind} {module} imports another {kind}'s {target}")
    return offences


def test_the_walk_sees_the_package() -> None:
    # The checks below are vacuous if the walk finds nothing: it must see the known edges.
    graph = _graph()
    assert {"ascend_vlm.ops", "ascend_vlm.patching", "ascend_vlm.runtime"} <= set(MODULES)
    assert any("ascend_vlm.ops" in graph[m] for m in graph if m.startswith("ascend_vlm.patching."))
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_inside_the_package() -> None:
    assert _cycles(_graph()) == []


def test_the_rank_check_catches_each_kind_of_offence() -> None:
    ranks = {"low": 0, "feature_a": FEATURES, "feature_b": FEATURES, "app": APPS,
             "other_app": APPS, "other_app.cli": COMMAND_LINE}  # fmt: skip
    graph = {
        "low.base": {"app.main"},
        "feature_a.x": {"feature_a.y", "low.base"},
        "feature_a.y": {"feature_b.z"},
        "feature_b.z": {"low.base", "app.main"},
        "app.main": {"feature_a.x", "feature_b.z", "low.base", "other_app.part"},
        "other_app.part": {"app.main"},
        "other_app.cli": {"app.main", "other_app.part"},
        "stray": set(),
    }
    assert _rank_offences(graph, ranks, exempt={("feature_b.z", "app.main")}) == [
        "app app.main imports another app's other_app.part",
        "feature feature_a.y imports another feature's feature_b.z",
        "low.base (rank 0) imports app.main (rank 6)",
        "app other_app.part imports another app's app.main",
        "stray: no rank (add it to RANKS)",
    ]
    assert _rank_entry("ascend_vlm.ops._op_spec", RANKS) == "ascend_vlm.ops"
    assert _rank_entry("ascend_vlm.not_ranked", RANKS) is None
    assert _rank_entry("ascend_vlm", RANKS) == ROOT


def test_imports_under_type_checking_count(tmp_path) -> None:
    source = tmp_path / "module.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ascend_vlm.observability.tracer import Tracer\n"
    )
    assert ("ascend_vlm.observability.tracer", "Tracer", 3) in _imports("ascend_vlm.x", source)


def test_every_rank_entry_names_a_module() -> None:
    stale = [key for key in RANKS if not any(_rank_entry(m, {key: 0}) for m in MODULES)]
    assert stale == []


def test_imports_go_down_the_ranks_and_features_and_apps_stay_apart() -> None:
    graph = _graph()
    assert _rank_offences(graph, RANKS, EXEMPT_EDGES) == []
    gone = [edge for edge in EXEMPT_EDGES if edge[1] not in graph.get(edge[0], set())]
    assert gone == [], "remove these EXEMPT_EDGES entries: their imports are gone"


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
