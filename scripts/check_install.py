"""What ``scripts/setup.sh`` asks the interpreter it installs into (standard library only: any Python >= 3.10 runs it).

``python scripts/check_install.py``: exit 0 when this checkout is already installed, editable, with every requirement
of ``pyproject.toml`` (and of its extras, ``HYBRID_CACHE_EXTRAS``: ``tools``, ``real`` and ``test`` by default) satisfied; else print why and exit 1. The set-up then
skips pip when nothing needs installing (about a second instead of ~15 s of pip resolving). Anything it cannot decide
(Python 3.10 has no ``tomllib``) counts as "not installed": pip then decides.

``python scripts/check_install.py --blocker``: print why this interpreter cannot take packages, if it cannot
(``externally-managed``: a system Python marked by its distribution per PEP 668, outside a virtual environment;
``no-pip``); print nothing when it can.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The extras installed with it (scripts/setup.sh's HYBRID_CACHE_EXTRAS).
EXTRAS = tuple(filter(None, os.environ.get("HYBRID_CACHE_EXTRAS", "tools,real,test").split(",")))


def install_blocker() -> str | None:
    """Why packages cannot be installed into this interpreter (PEP 668 marker outside a venv, or no pip), or None."""
    in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
    if not in_venv and os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")):
        return "externally-managed"
    if importlib.util.find_spec("pip") is None:
        return "no-pip"
    return None


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a fresh venv has pip's vendored copy only
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def checkout_version(project: dict) -> str:
    """The checkout's version: `project.version`, or the `__version__` that setuptools reads when it is dynamic."""
    if "version" in project:
        return project["version"]
    text = (ROOT / "hybrid_cache" / "version.py").read_text()  # pyproject: attr hybrid_cache.version.__version__
    match = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    return match.group(1) if match else "unknown"


def missing() -> str | None:
    """Why the install is incomplete, or None when it is complete."""
    try:
        import tomllib
    except ImportError:
        return "Python < 3.11 (no tomllib to read pyproject.toml)"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    try:
        dist = metadata.distribution(project["name"])
    except metadata.PackageNotFoundError:
        return f"{project['name']} is not installed"
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("url") != ROOT.as_uri() or not direct.get("dir_info", {}).get("editable"):
        return f"{project['name']} is not installed editable from {ROOT}"
    version = checkout_version(project)
    if dist.version != version:
        return f"{project['name']} {dist.version} is installed, the checkout is {version}"
    scripts = {ep.name for ep in dist.entry_points if ep.group == "console_scripts"}
    if scripts != set(project.get("scripts", {})):
        return "the console scripts changed"
    requirement = _requirement_class()
    wanted = list(project["dependencies"])
    for extra in EXTRAS:
        wanted += project.get("optional-dependencies", {}).get(extra, [])
    for text in wanted:
        req = requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            return f"{req.name} is not installed"
        if not req.specifier.contains(version, prereleases=True):
            return f"{req.name} {version} does not satisfy {req}"
    return None


if __name__ == "__main__":
    if sys.argv[1:] == ["--blocker"]:
        print(install_blocker() or "")
        sys.exit(0)
    reason = missing()
    if reason:
        print(reason)
    sys.exit(1 if reason else 0)
