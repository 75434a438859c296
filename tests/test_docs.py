"""The documentation stays true to the repository: README.md and docs/*.md link only to files and headings that
exist, docs/configuration.md names every command-line option and every DELTASERVE_* variable the code reads, and
README.md stays short."""

from __future__ import annotations

import argparse
import ast
import re
import runpy
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
CONFIGURATION = DOCS / "configuration.md"
README_MAX_BYTES = 12 * 1024

# Every command with an argparse parser: launch.py, the client, and the engine processes (the HTTP server among them),
# as `python <script>` or `python -m <module>` runs it.
COMMANDS = [("path", "launch.py"), ("module", "frontend.client"), ("module", "frontend.openai"),
            ("module", "frontend"), ("module", "scheduler_proc"), ("module", "workers")]
# Where the engine reads its environment variables; tests/ is left out (its variables are made up to be refused).
SOURCE_FOLDERS = ("common", "frontend", "scheduler_proc", "workers", "gpu_kernels", "scripts")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def without_code(text: str) -> str:
    """`text` with fenced blocks and inline code removed: a `[x](y)` there is an example, not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of the Markdown file `path`: lower case, punctuation but `-` and `_` dropped,
    spaces to `-`; a repeated anchor gets `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(path: Path) -> list[str]:
    return [target for target in LINK.findall(without_code(path.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: ... are not checked


def link_error(source: Path, target: str) -> str | None:
    """Why the relative link `target` of `source` does not resolve, or None when it does."""
    file_part, _, anchor = target.partition("#")
    destination = (source.parent / file_part).resolve() if file_part else source
    if not destination.exists():
        return f"{source.relative_to(REPO)}: {target}: no such file"
    if anchor and (destination.suffix != ".md" or anchor not in anchors(destination)):
        return f"{source.relative_to(REPO)}: {target}: no heading #{anchor} in {destination.relative_to(REPO)}"
    return None


class _ParserBuilt(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def command_parser(kind: str, target: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The argparse parser a command builds, caught when it first parses its arguments: the command runs as
    `python launch.py` or `python -m <module>` would run it, and stops there, before it starts anything."""

    def catch(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _ParserBuilt(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    monkeypatch.setattr(sys, "argv", [target])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before, by another test
        try:
            if kind == "path":
                runpy.run_path(str(REPO / target), run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        except _ParserBuilt as built:
            return built.parser
    raise AssertionError(f"{target} finished without parsing any arguments")


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [option for action in parser._actions for option in action.option_strings]


def documented_options(text: str) -> set[str]:
    """The options docs/configuration.md names in code spans (`--tp N`, `--tp`, `-h`)."""
    return {word for span in INLINE_CODE.findall(text) for word in re.findall(r"(?<![\w-])--?[a-z][\w-]*", span)}


def test_readme_is_at_most_12_kib() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md has {size} bytes; move reference text into docs/"


def test_every_docs_page_is_listed_in_the_readme() -> None:
    listed = set(relative_links(README))
    missing = [f"docs/{page.name}" for page in sorted(DOCS.glob("*.md")) if f"docs/{page.name}" not in listed]
    assert not missing, f"README.md's map of docs/ leaves out {missing}"


def test_every_relative_link_resolves_to_a_file_and_heading() -> None:
    links = [(path, target) for path in doc_files() for target in relative_links(path)]
    assert len(links) > 20  # the pages do link to each other: a broken pattern must not pass by finding none
    errors = [error for path, target in links if (error := link_error(path, target))]
    assert not errors, "\n".join(errors)


def test_a_link_to_a_missing_heading_or_file_is_reported() -> None:
    page = DOCS / "configuration.md"
    assert link_error(page, "http.md#timeouts-and-limits") is None
    assert link_error(page, "#environment-variables") is None
    assert link_error(page, "http.md#no-such-heading") is not None
    assert link_error(page, "no-such-page.md") is not None


def test_anchors_follow_github() -> None:
    assert {"why-gpu_kernels-and-not-kernels", "the-pipelined-step"} <= anchors(DOCS / "architecture.md")
    assert "python--m-frontendclient" in anchors(CONFIGURATION)


@pytest.mark.parametrize(("kind", "target"), COMMANDS, ids=[target for _, target in COMMANDS])
def test_every_option_is_documented_in_configuration(kind: str, target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    options = option_strings(command_parser(kind, target, monkeypatch))
    assert "--help" in options and len(options) > 3
    documented = documented_options(CONFIGURATION.read_text(encoding="utf-8"))
    missing = [option for option in options if option not in documented]
    assert not missing, f"docs/configuration.md does not name these options of {target}: {missing}"


def test_a_missing_option_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: configuration.md without its --kv-cache-dtype rows misses launch.py's option."""
    options = option_strings(command_parser("path", "launch.py", monkeypatch))
    text = "\n".join(line for line in CONFIGURATION.read_text(encoding="utf-8").splitlines()
                     if "--kv-cache-dtype" not in line)
    assert "--kv-cache-dtype" in options and "--kv-cache-dtype" not in documented_options(text)


def test_every_environment_variable_is_documented_in_configuration() -> None:
    files = [REPO / "launch.py", *(f for folder in SOURCE_FOLDERS for f in sorted((REPO / folder).rglob("*"))
                                   if f.suffix in (".py", ".sh"))]
    variables = {name for f in files for name in re.findall(r"\bDELTASERVE_[A-Z0-9_]*[A-Z0-9]",
                                                            f.read_text(encoding="utf-8"))}
    assert {"DELTASERVE_CACHE", "DELTASERVE_CURVE_KEYS", "DELTASERVE_PDL"} <= variables
    documented = set(re.findall(r"`(DELTASERVE_[A-Z0-9_]+)`", CONFIGURATION.read_text(encoding="utf-8")))
    assert not variables - documented, f"docs/configuration.md does not list {sorted(variables - documented)}"


# ============================================================================ the module map
MAP_START = "<!-- The module map"
MAP_END = "<!-- End of the module map. -->"
MAPPED_PACKAGES = ("common", "frontend", "scheduler_proc", "workers", "gpu_kernels", "deltaserve")


def module_map() -> str:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    return text[text.index(MAP_START): text.index(MAP_END)]


def only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def unmapped_modules(map_text: str) -> list[str]:
    """Our modules the map names neither by path nor by file name in the row of their folder (`workers/models/`
    ... `llama.py`). A package's `__main__.py` and an `__init__.py` that holds only its docstring need no row."""
    rows = [line for line in map_text.splitlines() if line.startswith("|")]
    missing = []
    for package in MAPPED_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if path.name == "__main__.py" or (path.name == "__init__.py" and only_a_docstring(path)):
                continue
            folder = rel.rsplit("/", 1)[0] + "/"
            named = f"`{rel}`" in map_text or (path.name == "__init__.py" and f"`{folder}`" in map_text)
            in_folder_row = any(f"`{folder}`" in row and f"`{path.name}`" in row for row in rows)
            if not (named or in_folder_row):
                missing.append(rel)
    return missing


def test_the_module_map_names_every_module() -> None:
    missing = unmapped_modules(module_map())

    assert not missing, f"docs/architecture.md's module map does not name: {missing}"


def test_the_module_map_check_sees_a_missing_row() -> None:
    text = module_map()
    row = next(line for line in text.splitlines() if "`workers/cuda_graphs.py`" in line)

    assert unmapped_modules(text.replace(row, "")) == ["workers/cuda_graphs.py"]
