"""The client command line refuses what it can judge alone at once, naming the argument: no engine is
needed for any of these."""

from __future__ import annotations

import pytest

from frontend.client import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63) or None, got -1"),
    (["--seed", str(2**63)], f"--seed must be an integer in [0, 2**63) or None, got {2**63}"),
    (["--max-tokens", "0"], "--max-tokens must be an integer in [1, 2**63), got 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
])
def test_a_sampling_value_out_of_range_is_refused_naming_the_option(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--timeout", "1", "hi"])

    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err
