"""Every import path the docs write exists, so that one cannot go stale unseen.

In README.md and docs/**/*.md (prose and code blocks alike): each dotted name ``hybrid_cache.<...>`` resolves to a
module of the package or an attribute of one (``hybrid_cache.mask_hook.install_mask_hook``,
``hybrid_cache.HybridRingCache.load``, a class's declared attribute), and each ``from hybrid_cache... import X`` runs;
one the text says raises ``ImportError`` must raise it. Not import paths, so not checked: file paths
(``hybrid_cache/tools/cli/bench.py``), command names (``hybrid-cache-bench``), the saved file's metadata keys
(``hybrid_cache.digest``, ...: `hybrid_cache.snapshot`'s ``*_KEY`` constants). A failure names the file and line.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from hybrid_cache import snapshot

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: `hybrid_cache.` and identifiers; not inside a path, a URL or a longer dotted name (`x.hybrid_cache.y`).
DOTTED = re.compile(r"(?<![\w./\\-])hybrid_cache(?:\.[A-Za-z_]\w*)+")
#: `from hybrid_cache[.module] import a, b as c` or `import (a, b)` (the parentheses may span lines).
FROM_IMPORT = re.compile(r"(?<![\w.])from\s+(hybrid_cache(?:\.\w+)*)\s+import\s+(\([^)]*\)|\w+(?:\s*,\s*\w+)*)")
#: `... import X` followed by "raises ImportError" (in or after its backticks): a documented negative.
RAISES_IMPORT_ERROR = re.compile(r"^`?\s*(?:\)\s*)?raises\s+`?ImportError")

#: Names in the saved file's header (`hybrid_cache.format`, `hybrid_cache.digest`, ...): keys, not import paths.
METADATA_KEYS = {
    value for name, value in vars(snapshot).items() if name.endswith("_KEY") and isinstance(value, str)
} | {snapshot.RESERVED_PREFIX.rstrip(".")}


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def dotted_names(text: str) -> list[tuple[int, str]]:
    """(line, name) of every dotted ``hybrid_cache.<...>`` name in `text` that is meant as an import path."""
    return [(_line(text, m.start()), m.group()) for m in DOTTED.finditer(text) if m.group() not in METADATA_KEYS]


def from_imports(text: str) -> list[tuple[int, str, bool]]:
    """(line, statement, raises) of every ``from hybrid_cache... import ...`` in `text`, one statement per name;
    `raises`: the text says that it raises ImportError."""
    found = []
    for m in FROM_IMPORT.finditer(text):
        raises = bool(RAISES_IMPORT_ERROR.match(text[m.end() :].lstrip(" ")))
        for item in m.group(2).strip("()").split(","):
            words = item.split()
            if words:
                found.append((_line(text, m.start()), f"from {m.group(1)} import {words[0]}", raises))
    return found


def _declares(cls: type, name: str) -> bool:
    """Whether class `cls` declares attribute `name` without a class-level value (a dataclass field, an annotation)."""
    return any(name in getattr(base, "__annotations__", {}) for base in cls.__mro__)


def resolve(name: str) -> str | None:
    """None if `name` is a module of the package or an attribute (chain) of one, else why not."""
    module, *rest = name.split(".")
    obj: Any = importlib.import_module(module)
    # Down the packages while the next name is a submodule (a module found is not imported: its tests do that).
    while rest and hasattr(obj, "__path__") and importlib.util.find_spec(f"{module}.{rest[0]}") is not None:
        module, rest = f"{module}.{rest[0]}", rest[1:]
        if not rest:
            return None
        obj = importlib.import_module(module)
    where = module
    for part in rest:
        if hasattr(obj, part):
            obj, where = getattr(obj, part), f"{where}.{part}"
        elif isinstance(obj, type) and _declares(obj, part) and part == rest[-1]:
            return None
        else:
            if where == module:
                return f"module {where} has no submodule or attribute {part!r}"
            return f"{type(obj).__name__} {where} has no attribute {part!r}"
    return None


def _import_fails(statement: str) -> str | None:
    """None if `statement` runs, else the error's one line."""
    try:
        exec(statement, {})
    except ImportError as exc:
        return f"ImportError: {exc}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dotted_name_of_the_docs_resolves(doc):
    text = doc.read_text()
    where = doc.relative_to(ROOT)
    stale = [f"{where}:{line}: {name}: {why}" for line, name in dotted_names(text) if (why := resolve(name))]
    assert not stale, "import paths in the docs that do not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_from_import_of_the_docs_runs(doc):
    text = doc.read_text()
    where = doc.relative_to(ROOT)
    wrong = []
    for line, statement, raises in from_imports(text):
        error = _import_fails(statement)
        if raises and error is None:
            wrong.append(f"{where}:{line}: `{statement}` runs, but the text says it raises ImportError")
        elif not raises and error is not None:
            wrong.append(f"{where}:{line}: `{statement}`: {error}")
    assert not wrong, "imports in the docs that are not what they say:\n" + "\n".join(wrong)


def test_api_md_lists_the_public_api():
    """docs/api.md's count and list of `hybrid_cache.__all__` are the package's."""
    import hybrid_cache

    text = (ROOT / "docs" / "api.md").read_text()
    found = re.search(r"The public API is `hybrid_cache.__all__` \((\d+) names\):(.*?)\. Everything else", text, re.S)
    assert found, "docs/api.md: the paragraph 'The public API is `hybrid_cache.__all__` (N names): ...' is gone"
    listed, count, public = re.findall(r"`(\w+)`", found.group(2)), int(found.group(1)), hybrid_cache.__all__
    where = f"docs/api.md:{_line(text, found.start())}"
    assert count == len(public), f"{where}: says {count} names, hybrid_cache.__all__ has {len(public)}"
    assert sorted(listed) == sorted(public), f"{where}: lists {sorted(listed)}, __all__ is {sorted(public)}"


def test_the_docs_name_many_import_paths():
    """The scan finds what the docs hold (a pattern that matched nothing would pass every doc)."""
    names = {name for doc in DOCS for _, name in dotted_names(doc.read_text())}
    imports = [s for doc in DOCS for _, s, _ in from_imports(doc.read_text())]
    assert len(names) >= 40 and "hybrid_cache.mask_hook.install_mask_hook" in names, sorted(names)
    assert "from hybrid_cache import HybridRingCache" in imports, imports


def test_what_the_scan_takes_for_an_import_path():
    text = (
        "See `hybrid_cache/tools/cli/bench.py` and `hybrid-cache-bench`, or run `python -m hybrid_cache.tools.cli.bench`.\n"
        "The header's `hybrid_cache.digest` and `hybrid_cache.format_version`; `hybrid_cache.snapshot.load_into(c, p)`.\n"
        "pip install 'hybrid_cache[tools]'; github.com/x/hybrid_cache.git; `hybrid_cache.switch.is_enabled(model)`.\n"
        "```python\nfrom hybrid_cache import (\n    HybridRingCache,\n    enable as on,\n)\n```\n"
        "(`from hybrid_cache import read_metadata` raises `ImportError`), from hybrid_cache.snapshot import load_into.\n"
    )
    assert dotted_names(text) == [
        (1, "hybrid_cache.tools.cli.bench"),
        (2, "hybrid_cache.snapshot.load_into"),
        (3, "hybrid_cache.switch.is_enabled"),
        (10, "hybrid_cache.snapshot"),
    ]
    assert from_imports(text) == [
        (5, "from hybrid_cache import HybridRingCache", False),
        (5, "from hybrid_cache import enable", False),
        (10, "from hybrid_cache import read_metadata", True),
        (10, "from hybrid_cache.snapshot import load_into", False),
    ]
    assert resolve("hybrid_cache.switch.is_enabled") is None and resolve("hybrid_cache.tools.cli.bench") is None
    assert resolve("hybrid_cache.HybridRingCache.load") is None
    assert resolve("hybrid_cache.tools.progress.Progress") is None
    assert resolve("hybrid_cache.layers") == "module hybrid_cache has no submodule or attribute 'layers'"
    assert resolve("hybrid_cache.is_enabled") == "module hybrid_cache has no submodule or attribute 'is_enabled'"
    assert resolve("hybrid_cache.HybridRingCache.nope") == "type hybrid_cache.HybridRingCache has no attribute 'nope'"
