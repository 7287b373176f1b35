"""The package's structure, read from its source with `ast`: imports go one way, modules import no private names
of each other, core modules stay small, the container stays lean and the public API short."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hybrid_cache

PACKAGE = Path(hybrid_cache.__file__).parent
# The core: the cache and everything it needs (the tools and metrics/ build on it).
CORE_MODULES = (
    "attention_maps",
    "banded",
    "cache",
    "checkpoints",
    "code_attention",
    "code_kernel",
    "code_path",
    "compat",
    "distributed",
    "errors",
    "frozen",
    "full",
    "generate_wrapper",
    "mask_hook",
    "memory",
    "options",
    "prefill_steps",
    "quantized",
    "quantizer",
    "ring",
    "snapshot",
    "specs",
    "state",
    "steps",
    "storage",
    "streaming",
    "switch",
    "version",
)
MAX_CORE_LINES = 600
MAX_CONTAINER_LINES = 250
MAX_PUBLIC_NAMES = 15


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(module: str, top_level_only: bool, type_only: bool = False) -> list[tuple[str, list[str]]]:
    """`(imported module, imported names)` for every import of the package's own modules in `module`; imports under
    `if TYPE_CHECKING:` never run and are left out, and so are imports inside functions when `top_level_only`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking_block(child) and not type_only:
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and not (top_level_only and in_function):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] == "hybrid_cache":
                    for (
                        alias
                    ) in child.names:  # `from . import compare` imports a module, `from .cache import X` a name
                        submodule = f"{target}.{alias.name}"
                        found.append((submodule, []) if submodule in MODULES else (target, [alias.name]))
            elif isinstance(child, ast.Import) and not (top_level_only and in_function):
                found.extend((alias.name, []) for alias in child.names if alias.name.split(".")[0] == "hybrid_cache")
            visit(child, nested)

    visit(ast.parse(path.read_text()), in_function=False)
    return [(target, names) for target, names in found if target in MODULES and target != module]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or `None`."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_core_modules_exist():
    missing = [name for name in CORE_MODULES if f"hybrid_cache.{name}" not in MODULES]
    assert not missing, f"core modules listed here but not in the package: {missing}"


def test_no_import_cycle_at_module_level():
    """Importing any module of the package never comes back to a module being imported."""
    graph = {module: {target for target, _ in _imports(module, top_level_only=True)} for module in MODULES}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_core_has_no_import_cycle_even_lazily():
    """The core modules do not import each other in a circle, not even from inside functions."""
    core = {f"hybrid_cache.{name}" for name in CORE_MODULES}
    graph = {
        module: {target for target, _ in _imports(module, top_level_only=False) if target in core} for module in core
    }
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_no_import_cycle_counting_type_only_imports():
    """Not even imports under `if TYPE_CHECKING:` close a circle: modules that see the container name what they read
    of it as a Protocol (`state.StateHolder`)."""
    graph = {
        module: {target for target, _ in _imports(module, top_level_only=False, type_only=True)} for module in MODULES
    }
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_imported_across_modules(module):
    private = [
        f"{target}.{name}"
        for target, names in _imports(module, top_level_only=False)
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private, f"{module} imports private names of other modules: {private}"


@pytest.mark.parametrize("name", CORE_MODULES)
def test_core_module_size(name):
    lines = len((PACKAGE / f"{name}.py").read_text().splitlines())
    assert lines <= MAX_CORE_LINES, f"hybrid_cache/{name}.py has {lines} lines (at most {MAX_CORE_LINES})"


def test_container_is_lean():
    tree = ast.parse((PACKAGE / "cache.py").read_text())
    (container,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "HybridRingCache"]
    lines = container.end_lineno - container.lineno + 1
    assert lines <= MAX_CONTAINER_LINES, f"class HybridRingCache has {lines} lines (at most {MAX_CONTAINER_LINES})"


def test_public_api_is_short_and_importable():
    assert len(hybrid_cache.__all__) <= MAX_PUBLIC_NAMES
    assert hybrid_cache.__all__ == sorted(hybrid_cache.__all__, key=lambda name: (not name[0].isupper(), name))
    for name in hybrid_cache.__all__:
        assert hasattr(hybrid_cache, name), name


def test_only_specs_reads_the_layer_structure_of_the_config():
    """`layer_types`, `sliding_window` and the KV-sharing fields are read by `specs.py` alone among the core modules
    (compat keeps the release-dependent reading of KV sharing that specs calls)."""
    fields = ("layer_types", "kv_sharing_modes", "num_kv_shared_layers", "per_layer_config")
    readers = []
    for name in CORE_MODULES:
        if name in ("specs", "compat"):
            continue
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        for node in ast.walk(tree):
            reads_attribute = isinstance(node, ast.Attribute) and node.attr in fields
            reads_getattr = (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in (*fields, "sliding_window")
            )
            if reads_attribute or reads_getattr:
                readers.append(f"{name}.py:{node.lineno}")
    assert not readers, f"config structure read outside specs.py: {readers}"


def test_test_modules_import_no_other_test_module():
    """Shared test code lives in `tests/builders.py`; no test module imports another test module or `conftest`."""
    tests = Path(__file__).resolve().parents[1]
    test_modules = {path.stem for path in tests.rglob("test_*.py")} | {"conftest"}
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in test_modules:
                offenders.append(f"{path.name}: from {node.module}")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.name}: import {a.name}" for a in node.names if a.name in test_modules]
    assert not offenders, offenders


def test_every_module_has_code_of_its_own():
    """No module is only imports (an alias of another path): each defines something, or is a docstring alone. The
    package's `__init__` is the exception: it re-exports the public API (`__all__`)."""

    def reexport(node: ast.stmt) -> bool:
        is_all = isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__"
        return isinstance(node, (ast.Import, ast.ImportFrom)) or is_all

    only_imports = []
    for name, path in MODULES.items():
        body = [node for node in ast.parse(path.read_text()).body if not isinstance(node, ast.Expr)]
        if name != "hybrid_cache" and body and all(reexport(node) for node in body):
            only_imports.append(name)
    assert not only_imports, f"modules that only import: {only_imports}"


def test_the_container_asks_layers_instead_of_checking_their_class():
    """cache.py never asks a layer which class it is (`isinstance(layer, ...)`, `type(layer) is ...`): layers say
    what they can do (`ring_ordered`, `attends_on_codes`, `records_steps`, `drops_tokens_by_design`)."""
    import hybrid_cache.cache as cache_module

    tree = ast.parse((PACKAGE / "cache.py").read_text())
    layer_classes = {
        name
        for name, value in vars(cache_module).items()
        if isinstance(value, type) and hasattr(value, "update") and hasattr(value, "get_seq_length")
    }
    checks = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "type", "issubclass"):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if names & layer_classes:
                checks.append(f"cache.py:{node.lineno}: {ast.unparse(node)}")
    assert not checks, checks


def test_constructor_and_options_list_the_same_options():
    """`CacheOptions` is the one list of options: the constructor takes exactly its fields (besides `config` and
    `stage_layers`), with the same defaults, and passes each by name (the dataclass is keyword-only)."""
    import dataclasses
    import inspect

    from hybrid_cache import HybridRingCache
    from hybrid_cache.options import CacheOptions

    parameters = dict(inspect.signature(HybridRingCache.__init__).parameters)
    for name in ("self", "config", "stage_layers"):
        parameters.pop(name)
    fields = {field.name: field.default for field in dataclasses.fields(CacheOptions)}
    assert {name: p.default for name, p in parameters.items()} == fields
    with pytest.raises(TypeError):
        CacheOptions(None, 0)  # positional construction is refused
    tree = ast.parse((PACKAGE / "cache.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "CacheOptions"]
    assert calls and all(not call.args and len(call.keywords) == len(fields) for call in calls)
