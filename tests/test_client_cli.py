"""The client command line refuses what it can judge alone at once, naming the argument: no engine is
needed for any of these."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from frontend.client_cli import main
from tests.conftest import REPO

UNRESOLVABLE = "no-such-host.invalid"  # RFC 2606: the .invalid top-level domain never resolves


@pytest.mark.parametrize(("argv", "message"), [
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63), got -1"),  # no "or None": an option has none
    (["--seed", str(2**63)], f"--seed must be an integer in [0, 2**63), got {2**63}"),
    (["--logprobs", "21"], "--logprobs must be an integer in [0, 20], got 21"),
    (["--max-tokens", "0"], "--max-tokens must be an integer in [1, 2**63), got 0"),
    (["--temperature", "-1"], "--temperature must be a finite number in [0, 3.4e38]"),
])
def test_a_sampling_value_out_of_range_is_refused_naming_the_option(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--timeout", "1", "hi"])

    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err


@pytest.mark.parametrize("where", [["--host", UNRESOLVABLE], ["--address", f"tcp://{UNRESOLVABLE}:8000"]])
def test_an_unresolvable_host_fails_at_once_with_one_line_naming_it(where: list[str], capsys) -> None:
    start = time.monotonic()
    code = main([*where, "--timeout", "5", "hi"])
    elapsed = time.monotonic() - start

    err = capsys.readouterr().err
    assert code == 1 and elapsed < 3
    assert err.startswith(f"error: cannot resolve the engine host '{UNRESOLVABLE}' ({where[0]}): "), err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("chat", [["--chat"], []])
def test_a_prompt_argument_that_is_not_utf8_is_refused_naming_the_argument(chat: list[str], capsys) -> None:
    bad = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # how Python hands over an undecodable argument

    with pytest.raises(SystemExit) as exit_info:
        main([*chat, "--timeout", "1", "fine", bad])

    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "prompt argument 2 is not UTF-8 text: byte 0xe9 at character 3 cannot be decoded" in err, err
    assert "messages[0]" not in err


def test_prompt_options_follow_the_positional_prompts_as_in_launch_py(capsys) -> None:
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")

    with pytest.raises(SystemExit) as exit_info:
        main(["--timeout", "1", "--prompt", bad, "fine"])

    assert exit_info.value.code == 2
    assert "prompt argument 2 is not UTF-8 text" in capsys.readouterr().err  # "fine" first, then --prompt's


def test_an_abbreviated_option_is_refused_not_matched_to_a_longer_one(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--timeout", "1", "--prompt-log", "3", "hi"])  # argparse alone would take it for --prompt-logprobs

    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unrecognized arguments: --prompt-log " in err, err


def test_a_latin1_byte_from_the_shell_is_refused_naming_the_argument() -> None:
    result = subprocess.run([sys.executable, "-m", "frontend.client", "--chat", "--timeout", "1", b"caf\xe9"],
                            cwd=REPO, capture_output=True, timeout=60)

    assert result.returncode == 2
    assert b"prompt argument 1 is not UTF-8 text: byte 0xe9 at character 3" in result.stderr, result.stderr


def test_the_client_help_gives_every_option_a_meaning_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])

    entries = re.split(r"\n  (?=-)", capsys.readouterr().out.split("\noptions:", 1)[1])  # one per option
    help_of = {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries if e.strip()}
    for option, default in [("--host", "127.0.0.1"), ("--port", "8000"), ("--max-tokens", "64"),
                            ("--seed", "the engine's own seeded stream"), ("--timeout", "20.0")]:
        text = help_of[option]
        assert f"(default: {default})" in text, text
        assert len(text.replace(f"(default: {default})", "").split()) > 3, text  # a meaning, not just the metavar


def test_json_lines_write_a_split_character_s_token_bytes_as_byte_values() -> None:
    """A logprob entry of a token that holds part of a UTF-8 character carries its raw bytes: `--json` (client and
    launch.py) crashed on them with "Object of type bytes is not JSON serializable"; they are written as the HTTP
    API's `bytes` field is, a list of byte values."""
    import json

    from common.protocol import PositionLogprobs, RequestOutput, TopLogprob
    from frontend.client_cli import json_line, json_row

    position = PositionLogprobs(7, -0.5, 1, "\ufffd", [TopLogprob(7, -0.5, "\ufffd", b"\xf0\x9f"),
                                                      TopLogprob(8, -1.5, "a")], b"\xf0\x9f")
    out = RequestOutput("r", "\ufffd", [7], True, "length", logprobs=[position], cumulative_logprob=-0.5)
    row = json.loads(json_line(json_row("emoji", out)))
    entry = row["outputs"][0]["logprobs"][0]
    assert entry["token_bytes"] == [0xF0, 0x9F] and entry["top"][0]["token_bytes"] == [0xF0, 0x9F]
    assert entry["top"][1]["token_bytes"] is None
