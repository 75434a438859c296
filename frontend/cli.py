"""What deltaserve's two commands (`launch.py` and `python -m frontend.client`) share: help that shows each
option's default, errors in one line, and messages that name the option a user typed."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, NoReturn


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it is None or a switch's off state (those are said in the help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def docs_section(name: str) -> str:
    """"docs/configuration.md, <section>": the section of the configuration reference whose table has a row for
    `name` (just "docs/configuration.md" where the file or the row is not found)."""
    section = None
    try:
        with open(Path(__file__).resolve().parents[1] / "docs" / "configuration.md", encoding="utf-8") as f:
            for line in f:
                if line.startswith("## "):
                    section = line[3:].strip()
                elif line.startswith(f"| `{name}` |"):
                    return f"docs/configuration.md, {section}" if section else "docs/configuration.md"
    except OSError:
        pass
    return "docs/configuration.md"


class ArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line and a pointer to --help, exit status 2: the
    usage block of every option printed before a one-line mistake buried the mistake. Options are never
    abbreviated: argparse's prefix matching read the client's `--prompt hi` as `--prompt-logprobs hi`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # A bad environment variable is not among the options --help lists: point at its row in the docs.
        where = docs_section(message.split()[0]) if message.startswith("DELTASERVE_") else "see --help"
        self.exit(2, f"{self.prog}: error: {message} ({where})\n")

    def option_error(self, message: str) -> NoReturn:
        """`error` for a setting's `ValueError`, whose message starts with the setting's field name
        ("max_tokens must be ..."): the field is named by its option instead ("--max-tokens must be ...")."""
        field, sep, rest = message.partition(" ")
        option = next((a.option_strings[0] for a in self._actions if a.dest == field and a.option_strings), None)
        if option is None:
            self.error(message)
        # An option has no None to give: "an integer in [0, 20] or None, got 99" says less to a command line.
        self.error(f"{option}{sep}{re.sub(r',? or None(?=, got )', '', rest)}")
