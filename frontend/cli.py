"""What deltaserve's two commands (`launch.py` and `python -m frontend.client`) share: help that shows each
option's default, errors in one line, and messages that name the option a user typed; the sampling and
structured-output flags and the SamplingParams they build; the checks of prompt text and host made before
anything is sent or started."""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path
from typing import Any, NoReturn

from common.errors import quote
from common.sampling_params import SamplingParams


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
        where = docs_section(message.split()[0].rstrip(":")) if message.startswith("DELTASERVE_") else "see --help"
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


# Sampling flags shared by the client and launch.py (vLLM's names); their values build SamplingParams.
SAMPLING_FLAGS = ("n", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "min_tokens", "stop", "logprobs", "prompt_logprobs")


def add_sampling_arguments(group: Any) -> None:
    """Add the sampling flags beyond --temperature, --max-tokens, --ignore-eos and --seed to a parser group."""
    group.add_argument("--n", type=int, default=1, help="samples per prompt (the prompt is computed once)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep tokens while the "
                       "probability of those more likely is below this, in (0, 1]; 1 = off")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1 = off")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than this times the most likely one, in [0, 1]; 0 = off")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="> 0: logits of prompt and output tokens are divided (positive) or multiplied "
                            "(negative) by it; 1 = off")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="in [-2, 2]: subtracted from the logit of every token already generated")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="in [-2, 2]: times its count, subtracted from the logit of every generated token")
    group.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before a stop token or "
                       "stop string may end the output")
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeat for several)")
    group.add_argument("--logprobs", type=int, default=None,
                       help="return each sampled token's logprob and the N most likely (0..20)")
    group.add_argument("--prompt-logprobs", type=int, default=None,
                       help="return each prompt token's logprob and the N most likely (0..20)")
    # Structured outputs (SamplingParams.structured_outputs): at most one of these.
    group.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="constrain the output to JSON valid against this schema (JSON text, or @FILE)")
    group.add_argument("--json-object", action="store_true", help="constrain the output to some JSON object")
    group.add_argument("--regex", default=None, help="constrain the whole output to match this regular expression")
    group.add_argument("--choice", action="append", default=None,
                       help="constrain the output to exactly one of these strings (repeat for each)")
    group.add_argument("--grammar", default=None, metavar="EBNF",
                       help="constrain the output to this EBNF (GBNF) grammar with a root rule (text, or @FILE)")


# Structured-output flag -> the StructuredOutputsParams field it sets
STRUCTURED_FLAGS = {"json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}


def _structured_outputs_from_args(parser: ArgumentParser, args: Any) -> tuple[str, dict[str, Any]] | None:
    """(the flag, the structured_outputs dict) of the structured-output flags, None without any; exits naming
    the flag for two of them or for an @FILE that cannot be read."""
    given = {flag: getattr(args, flag) for flag in STRUCTURED_FLAGS if getattr(args, flag) not in (None, False)}
    if not given:
        return None
    options = [f"--{flag.replace('_', '-')}" for flag in given]
    if len(given) > 1:
        parser.error(f"{options[1]}: only one structured-output flag may be set, got {' and '.join(options)}")
    (flag, value), = given.items()
    if flag in ("json_schema", "grammar") and value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"{options[0]}: cannot read {quote(value[1:])}: {exc}")
    if flag in ("regex", "grammar") and isinstance(value, str):  # refused before an engine starts, not after
        from workers.structured_output import syntax_error

        problem = syntax_error(flag, value)
        if problem is not None:
            parser.error(f"{options[0]}: {problem}")
    return options[0], {STRUCTURED_FLAGS[flag]: value}


def sampling_params_from_args(parser: ArgumentParser, args: Any, **fields: Any) -> SamplingParams:
    """SamplingParams from the sampling flags (`args`, parsed by `parser`) plus `fields`; a bad value exits
    with a one-line error naming its flag (e.g. "--top-p must be a finite number in (0, 1] ...")."""
    option, structured = _structured_outputs_from_args(parser, args) or (None, None)
    try:
        return SamplingParams(**fields, **{name: getattr(args, name) for name in SAMPLING_FLAGS},
                              structured_outputs=structured)
    except ValueError as exc:
        message = str(exc)
        if option is not None and message.startswith("structured_outputs"):
            parser.error(f"{option}: {message}")
        parser.option_error(message)


def undecodable_text(text: str) -> str | None:
    """Where `text` has no UTF-8 encoding (a byte the shell passed undecoded, kept by Python as a
    surrogate escape, or any lone surrogate); None if it has one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate {text[exc.start]!r}"
        return f"{what} at character {exc.start}"
    return None


def unresolvable_host(address: str) -> tuple[str, str] | None:
    """(host, why) when the host of a tcp:// `address` has no network address; None when it has one
    or `address` is not tcp. ZeroMQ would retry such a host in silence until the client times out."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://"):].rpartition(";")[2].rpartition(":")[0].strip("[]")  # [src;]host:port
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return host, getattr(exc, "strerror", None) or str(exc)
    return None
