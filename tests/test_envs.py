"""Environment variables: every bad value is refused with an error naming the variable and what it accepts,
before the engine starts any process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common import envs
from common.config import EngineConfig
from frontend.launcher import EngineProcesses
from tests.test_config import write_checkpoint


@pytest.mark.parametrize("value", ["0", "-1", "nan", "NaN", "soon", "inf", "1e309"])
def test_client_silence_must_be_a_positive_number(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DELTASERVE_CLIENT_SILENCE_S", value)
    with pytest.raises(ValueError, match=r"DELTASERVE_CLIENT_SILENCE_S must be a finite number > 0 \(seconds\), got"):
        envs.client_silence_s()


def test_client_silence_default_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTASERVE_CLIENT_SILENCE_S", raising=False)
    assert envs.client_silence_s() == 60.0
    monkeypatch.setenv("DELTASERVE_CLIENT_SILENCE_S", "2.5")
    assert envs.client_silence_s() == 2.5


@pytest.mark.parametrize("value", ["-1", "nan", "never", "inf"])
def test_step_timeout_must_be_a_number_at_least_zero(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DELTASERVE_STEP_TIMEOUT_S", value)
    with pytest.raises(ValueError, match="DELTASERVE_STEP_TIMEOUT_S must be a finite number >= 0"):
        envs.step_timeout_s()


@pytest.mark.parametrize("value", ["bogus", "NCCL"])
def test_all_reduce_must_be_auto_or_nccl(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DELTASERVE_ALL_REDUCE", value)
    with pytest.raises(ValueError, match="DELTASERVE_ALL_REDUCE must be one of 'auto', 'nccl', got"):
        envs.all_reduce_impl()


def test_gemv_max_batch_default_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTASERVE_GEMV_MAX_BATCH", raising=False)
    assert envs.gemv_max_batch() == 1
    monkeypatch.setenv("DELTASERVE_GEMV_MAX_BATCH", "16")
    assert envs.gemv_max_batch() == 16
    monkeypatch.setenv("DELTASERVE_GEMV_MAX_BATCH", "0")
    assert envs.gemv_max_batch() == 0


@pytest.mark.parametrize("value", ["", "  "])
def test_a_blank_variable_means_its_default_for_every_kind(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """`NAME= command` asks for the default, for numbers and choices as for the boolean variables."""
    for name in ("DELTASERVE_GEMV_MAX_BATCH", "DELTASERVE_CLIENT_SILENCE_S", "DELTASERVE_ALL_REDUCE",
                 "DELTASERVE_CHECK_INVARIANTS"):
        monkeypatch.setenv(name, value)
    assert envs.gemv_max_batch() == envs.GEMV_MAX_BATCH_DEFAULT
    assert envs.client_silence_s() == 60.0
    assert envs.all_reduce_impl() == "auto"
    assert envs.check_invariants() is False
    for name in ("DELTASERVE_API_KEY", "DELTASERVE_CACHE", "DELTASERVE_STEP_LOG_DIR"):  # text: no key, no folder
        monkeypatch.setenv(name, value)
    assert envs.api_key() is None
    assert envs.step_log_dir() is None
    assert envs.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "deltaserve")


@pytest.mark.parametrize("value", ["inf", "1e309", "1e308", "-inf", "nan", "1048577"])
def test_an_infinite_body_limit_is_refused_by_name_not_with_a_traceback(monkeypatch: pytest.MonkeyPatch,
                                                                       value: str) -> None:
    monkeypatch.setenv("DELTASERVE_HTTP_MAX_BODY_MB", value)
    with pytest.raises(ValueError, match=r"^DELTASERVE_HTTP_MAX_BODY_MB must be a finite number > 0 and <= 1048576 "
                                         r"\(MiB\), got"):
        envs.check_all()


def test_a_body_limit_under_one_byte_is_refused_and_the_largest_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASERVE_HTTP_MAX_BODY_MB", "1e-7")  # 0.1 byte: every request would get a 413
    with pytest.raises(ValueError, match="^DELTASERVE_HTTP_MAX_BODY_MB must allow at least 1 byte"):
        envs.http_max_body_bytes()
    monkeypatch.setenv("DELTASERVE_HTTP_MAX_BODY_MB", "1048576")
    assert envs.http_max_body_bytes() == 1 << 40


def test_a_whole_number_too_long_for_int_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASERVE_GEMV_MAX_BATCH", "9" * 5000)  # int() itself refuses over 4300 digits, unnamed
    with pytest.raises(ValueError, match=r"^DELTASERVE_GEMV_MAX_BATCH must be a whole number >= 0 .*got '9{40}'$"):
        envs.gemv_max_batch()


def test_choices_and_folders_are_read_as_a_user_means_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spaces around a choice do not matter (as for the flags); `~` in a quoted folder path is the home folder
    (the shell leaves it alone inside quotes); a relative folder is the caller's."""
    monkeypatch.setenv("DELTASERVE_ALL_REDUCE", " nccl ")
    assert envs.all_reduce_impl() == "nccl"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DELTASERVE_CACHE", "~/cache")
    assert envs.cache_dir() == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DELTASERVE_STEP_LOG_DIR", "steps")
    assert envs.step_log_dir() == str(tmp_path / "steps")
    assert not (tmp_path / "~").exists()


def test_folder_variables_reach_the_engine_processes_as_absolute_paths(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher starts its processes in the repository's folder; a relative DELTASERVE_CACHE or
    DELTASERVE_STEP_LOG_DIR means the caller's working directory."""
    monkeypatch.chdir(tmp_path)
    env = {"DELTASERVE_CACHE": "cache", "DELTASERVE_STEP_LOG_DIR": "./steps", "DELTASERVE_API_KEY": "k",
           "OTHER": "x"}
    assert envs.absolute_paths(env) == {**env, "DELTASERVE_CACHE": str(tmp_path / "cache"),
                                        "DELTASERVE_STEP_LOG_DIR": str(tmp_path / "steps")}
    assert envs.absolute_paths({"DELTASERVE_CACHE": "  "}) == {"DELTASERVE_CACHE": "  "}  # blank stays the default


@pytest.mark.parametrize("value", ["-1", "2.5", "1e3", "eight", "\u00b2"])
def test_gemv_max_batch_must_be_a_whole_number(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DELTASERVE_GEMV_MAX_BATCH", value)
    with pytest.raises(ValueError, match=r"DELTASERVE_GEMV_MAX_BATCH must be a whole number >= 0 \(rows; 0 = off\)"):
        envs.gemv_max_batch()


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("Yes", True), ("ON", True),
                                                 ("0", False), ("False", False), ("no", False), ("off", False),
                                                 ("", False)])
def test_check_invariants_takes_the_usual_boolean_spellings(monkeypatch: pytest.MonkeyPatch, value: str,
                                                           expected: bool) -> None:
    monkeypatch.setenv("DELTASERVE_CHECK_INVARIANTS", value)
    assert envs.check_invariants() is expected


@pytest.mark.parametrize("value", ["2", "enabled", "y"])
def test_check_invariants_refuses_other_words_by_name(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DELTASERVE_CHECK_INVARIANTS", value)
    with pytest.raises(ValueError, match="DELTASERVE_CHECK_INVARIANTS must be one of 1/true/yes/on or 0/false/no/off"):
        envs.check_invariants()


@pytest.mark.parametrize(("name", "value"), [("DELTASERVE_ALL_REDUCE", "bogus"),
                                             ("DELTASERVE_CLIENT_SILENCE_S", "0"),
                                             ("DELTASERVE_CHECK_INVARIANTS", "maybe"),
                                             ("DELTASERVE_GEMV_MAX_BATCH", "-1"),
                                             ("DELTASERVE_PROFILE_WITH_STACK", "stacks"),
                                             ("DELTASERVE_EAGER_SAMPLING", "maybe"),
                                             ("DELTASERVE_DECODE_INLINE_COMBINE", "sometimes"),
                                             ("DELTASERVE_PDL", "2")])
def test_a_bad_variable_stops_a_cpu_engine_before_any_process_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     name: str, value: str) -> None:
    """DELTASERVE_ALL_REDUCE is only used by GPU tensor parallelism, but a typo is refused on CPU too."""
    model = write_checkpoint(tmp_path / "m")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        EngineProcesses(EngineConfig(model, device="cpu"))


def test_step_timeout_default_is_an_hour_on_cpu_and_five_minutes_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """One 8k-token prefill chunk of the 135M demo model took 203 s on CPU: 300 s would kill healthy engines."""
    monkeypatch.delenv("DELTASERVE_STEP_TIMEOUT_S", raising=False)
    assert envs.step_timeout_s() == 300.0
    assert envs.step_timeout_s(on_cpu=True) == 3600.0
    monkeypatch.setenv("DELTASERVE_STEP_TIMEOUT_S", "42")
    assert envs.step_timeout_s(on_cpu=True) == envs.step_timeout_s() == 42.0


@pytest.mark.parametrize("value", ["-1", "nan", "later"])
def test_scheduler_timeout_must_be_a_number_at_least_zero(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DELTASERVE_SCHEDULER_TIMEOUT_S", value)
    with pytest.raises(ValueError, match="DELTASERVE_SCHEDULER_TIMEOUT_S must be a finite number >= 0"):
        envs.scheduler_timeout_s()


@pytest.mark.parametrize("name", ["DELTASERVE_STEP_LOG_DIR", "DELTASERVE_CACHE"])
def test_a_folder_variable_that_cannot_be_a_folder_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       name: str) -> None:
    read = envs.step_log_dir if name == "DELTASERVE_STEP_LOG_DIR" else envs.cache_dir
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv(name, str(a_file / "below"))
    with pytest.raises(ValueError, match=f"^{name}=.* cannot be used as a folder"):
        read()
    monkeypatch.setenv(name, str(tmp_path / "new" / "logs"))  # a missing folder is made
    assert read() == str(tmp_path / "new" / "logs")
    assert (tmp_path / "new" / "logs").is_dir()


def test_an_unusable_step_log_dir_or_profile_dir_stops_the_engine_before_any_process_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.config import ConfigError

    model = write_checkpoint(tmp_path / "m")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("DELTASERVE_STEP_LOG_DIR", str(a_file))
    with pytest.raises(ValueError, match="DELTASERVE_STEP_LOG_DIR"):
        EngineProcesses(EngineConfig(model, device="cpu"))
    monkeypatch.delenv("DELTASERVE_STEP_LOG_DIR")
    with pytest.raises(ConfigError, match="profile_dir=.* cannot be used as a folder: it is a file"):
        EngineProcesses(EngineConfig(model, device="cpu", profile_dir=str(a_file)))


def test_pdl_is_on_by_default_and_never_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from gpu_kernels import pdl

    for value, requested in (("", True), ("1", True), ("0", False), ("off", False)):
        monkeypatch.setenv("DELTASERVE_PDL", value)
        pdl._requested.cache_clear()
        assert envs.pdl() is requested and pdl._requested() is requested
        assert pdl.pdl_for(torch.zeros(1)) is False  # the interpreter: no launch option, no griddepcontrol
    pdl._requested.cache_clear()
    assert pdl.launch_options(True) == {"launch_pdl": True} and pdl.launch_options(False) == {}


@pytest.mark.parametrize("value", ["0", "-1", "2.5", "four", "9" * 30, "1025", "999999"])
def test_worker_threads_must_be_a_whole_number_of_at_least_one(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """999999 threads made the worker abort creating them: the count is bounded before start."""
    monkeypatch.setenv("DELTASERVE_WORKER_THREADS", value)
    with pytest.raises(ValueError, match=r"^DELTASERVE_WORKER_THREADS must be a whole number from 1 to 1024 "
                                         r"\(threads\), got"):
        envs.check_all()


def test_worker_threads_unset_or_blank_leaves_the_choice_to_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("", " "):
        monkeypatch.setenv("DELTASERVE_WORKER_THREADS", value)
        assert envs.worker_threads() is None
    monkeypatch.setenv("DELTASERVE_WORKER_THREADS", " 3 ")
    assert envs.worker_threads() == 3
