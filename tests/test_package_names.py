"""Our top-level packages must not share a name with a module another installed distribution provides: the one
first on sys.path would hide the other. transformers 5.25 started requiring Hugging Face's `kernels` package and
importing it, which found our old `kernels/` folder instead (ImportError at `from transformers import ...`); ours is
`gpu_kernels/`."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import PurePosixPath

from tests.conftest import REPO

OURS = sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").exists() and p.name != "tests") + ["launch"]
# `python benchmarks/x.py` puts benchmarks/ first on sys.path, so each script's name shadows a module of that name
# (benchmarks/kernels.py hid Hugging Face's `kernels` from transformers in the gate script).
SCRIPTS = sorted(p.stem for folder in ("benchmarks", "scripts") for p in (REPO / folder).glob("*.py"))


def _top_level_modules(dist: importlib.metadata.Distribution) -> set[str]:
    """The importable top-level names `dist` installs (top_level.txt, else the first part of its files' paths)."""
    listed = dist.read_text("top_level.txt")
    if listed:
        return set(listed.split())
    names = set()
    for file in dist.files or ():
        first = PurePosixPath(str(file)).parts[0]
        if first.endswith((".dist-info", ".data")) or first in ("..", "__pycache__"):
            continue
        names.add(first.removesuffix(".py"))
    return names


def test_no_installed_distribution_provides_a_module_named_like_one_of_our_packages_or_scripts() -> None:
    assert {"common", "frontend", "scheduler_proc", "workers", "gpu_kernels", "deltaserve"} <= set(OURS)
    assert {"gpu_correctness", "throughput", "latency"} <= set(SCRIPTS)
    clashes = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.lower() == "deltaserve":
            continue
        for module in _top_level_modules(dist) & set(OURS + SCRIPTS):
            clashes.setdefault(module, []).append(name)
    assert not clashes, f"installed distributions provide modules named like ours: {clashes}"


def test_transformers_imports_with_our_packages_first_on_the_path() -> None:
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (lazy imports that reach the hub kernels)

    if importlib.util.find_spec("transformers.integrations.hub_kernels") is not None:  # transformers >= 4.52
        importlib.import_module("transformers.integrations.hub_kernels")
