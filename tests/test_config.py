"""Engine and sampling settings: every invalid value is refused with an error naming the setting;
`resolve()` reads tiny checkpoints written by transformers."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from common.config import SUPPORTED_ARCHITECTURES, ConfigError, EngineConfig
from common.sampling_params import SamplingParams

TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, eos_token_id=7)


def write_checkpoint(path: Path, arch: str = "qwen3", generation_eos: Any = None, **overrides: Any) -> str:
    """A config-only checkpoint folder (config.json, optionally generation_config.json); no weights needed."""
    from transformers import GenerationConfig, LlamaConfig, Qwen3Config

    config_cls, architecture = {"qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
                                "llama": (LlamaConfig, "LlamaForCausalLM")}[arch]
    settings = {**TINY, "architectures": [architecture], **overrides}
    config_cls(**settings).save_pretrained(path)
    if generation_eos is not None:
        GenerationConfig(eos_token_id=generation_eos).save_pretrained(path)
    return str(path)


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    return write_checkpoint(tmp_path / "tiny-qwen3")


# ============================================================================ EngineConfig validation
def test_missing_model_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model folder .* does not exist"):
        EngineConfig(str(tmp_path / "no-such-model"))


def test_relative_model_and_tokenizer_paths_are_kept_as_absolute_ones(model_dir: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's processes start in the repository's folder: a path relative to the caller's must not travel."""
    monkeypatch.chdir(model_dir)
    cfg = EngineConfig(".", tokenizer=".")
    assert cfg.model == cfg.tokenizer == model_dir
    assert EngineConfig.from_json(cfg.to_json()).model == model_dir
    assert cfg.served_model_names == ("tiny-qwen3",)  # the folder's name, not "."


def test_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.safetensors").write_bytes(b"")

    with pytest.raises(ConfigError, match="has no config.json"):
        EngineConfig(str(tmp_path))


SIZES = ["max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kvcache_blocks",
         "kv_cache_memory_gb", "tensor_parallel_size"]


@pytest.mark.parametrize("value", [0, -1, -0.5, True, "16", float("inf"), float("nan")],
                         ids=["zero", "negative", "negative-float", "bool", "str", "inf", "nan"])
@pytest.mark.parametrize("name", SIZES)
def test_non_positive_size_is_refused_naming_the_setting(model_dir: str, name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"^{name} must be a positive (integer|number)"):
        EngineConfig(model_dir, **{name: value})


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"])
def test_required_sizes_cannot_be_none(model_dir: str, name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name} "):
        EngineConfig(model_dir, **{name: None})


@pytest.mark.parametrize(("name", "value"), [("block_size", 16.5), ("max_num_seqs", 2.5), ("max_model_len", 100.5),
                                             ("tensor_parallel_size", 1.5), ("num_kvcache_blocks", 3.5)])
def test_fractional_counts_are_refused(model_dir: str, name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=name):
        EngineConfig(model_dir, **{name: value})


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, 2.0, math.nan])
def test_gpu_memory_utilization_outside_zero_to_one_is_refused(model_dir: str, value: float) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        EngineConfig(model_dir, gpu_memory_utilization=value)


@pytest.mark.parametrize("value", [0, 5, -1, 2.0, True, "3", None])
def test_max_steps_in_flight_outside_1_to_4_is_refused(model_dir: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=r"max_steps_in_flight must be an integer in \[1, 4\]"):
        EngineConfig(model_dir, max_steps_in_flight=value)
    assert [EngineConfig(model_dir, max_steps_in_flight=k).max_steps_in_flight for k in (1, 4)] == [1, 4]


@pytest.mark.parametrize("value", [1.0, 0.05, 0.9])
def test_gpu_memory_utilization_in_zero_to_one_is_accepted(model_dir: str, value: float) -> None:
    assert EngineConfig(model_dir, gpu_memory_utilization=value).gpu_memory_utilization == value


@pytest.mark.parametrize(("name", "value"), [("dtype", "fp8"), ("dtype", "float64"), ("device", "tpu"),
                                             ("device", "cuda:0"), ("attention_backend", "xformers"),
                                             ("attention_backend", ""), ("kv_cache_dtype", "fp8_e5m2"),
                                             ("kv_cache_dtype", "int8"),
                                             ("structured_outputs_backend", "guidance"),
                                             ("structured_outputs_backend", "outlines")])
def test_unknown_choice_is_refused_naming_the_setting_and_the_choices(model_dir: str, name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name} must be one of"):
        EngineConfig(model_dir, **{name: value})


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_kv_cache_is_refused_with_the_flash_attn_backend_and_accepted_with_the_others(
        model_dir: str, kv_cache_dtype: str) -> None:
    with pytest.raises(ConfigError, match="flash-attn backend does not read an fp8 KV cache"):
        EngineConfig(model_dir, kv_cache_dtype=kv_cache_dtype, attention_backend="flash-attn")
    for backend in ("auto", "triton", "torch"):
        assert EngineConfig(model_dir, kv_cache_dtype=kv_cache_dtype, attention_backend=backend).kv_cache_dtype == \
            kv_cache_dtype


@pytest.mark.parametrize("sizes", [(), [], (0, 8), (-1,)])
def test_empty_or_non_positive_cuda_graph_sizes_are_refused(model_dir: str, sizes: Any) -> None:
    with pytest.raises(ConfigError, match="cuda_graph_sizes"):
        EngineConfig(model_dir, cuda_graph_sizes=sizes)


def test_cuda_graph_sizes_are_sorted_and_deduplicated(model_dir: str) -> None:
    assert EngineConfig(model_dir, cuda_graph_sizes=[8, 1, 8, 4]).cuda_graph_sizes == (1, 4, 8)


@pytest.mark.parametrize(("name", "value"), [("gpu_memory_utilization", "0.9"), ("gpu_memory_utilization", None),
                                             ("cuda_graph_sizes", ["a"]), ("cuda_graph_sizes", 8), ("model", None)])
def test_mistyped_setting_raises_config_error_naming_it(model_dir: str, name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=name):
        EngineConfig(**{"model": model_dir, name: value})


def test_config_is_frozen(model_dir: str) -> None:
    config = EngineConfig(model_dir)

    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32  # type: ignore[misc]


# ============================================================================ JSON
def test_json_round_trip_keeps_every_setting(model_dir: str) -> None:
    config = EngineConfig(model_dir, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512, block_size=32,
                          num_kvcache_blocks=40, gpu_memory_utilization=0.5, kv_cache_memory_gb=0.25,
                          enforce_eager=True, cuda_graph_sizes=(1, 2, 8), dtype="bfloat16", device="cpu", seed=3,
                          attention_backend="torch", kv_cache_dtype="fp8", enable_prefix_caching=False,
                          log_level="DEBUG")

    assert EngineConfig.from_json(config.to_json()) == config


def test_json_round_trip_keeps_resolved_fields(model_dir: str) -> None:
    config = EngineConfig(model_dir).resolve()

    restored = EngineConfig.from_json(config.to_json())

    assert restored == config
    assert restored.eos_token_ids == (7,) and isinstance(restored.eos_token_ids, tuple)


def test_field_names_are_the_user_settings_only() -> None:
    names = EngineConfig.field_names()

    assert "model" in names and "block_size" in names
    assert not {"architecture", "vocab_size", "eos_token_ids"} & set(names)


# ============================================================================ resolve()
def test_resolve_fills_architecture_vocab_eos_and_max_model_len(model_dir: str) -> None:
    config = EngineConfig(model_dir, block_size=16)

    resolved = config.resolve()

    assert resolved.architecture == "Qwen3ForCausalLM"
    assert resolved.vocab_size == 1024
    assert resolved.eos_token_ids == (7,)
    assert resolved.max_model_len == 2048  # max_position_embeddings
    assert resolved.max_blocks_per_seq == 2048 // 16
    assert config.architecture == "" and config.max_model_len is None  # resolve returns a new config


def test_resolve_prefers_generation_config_eos_ids(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "tiny-llama", arch="llama", generation_eos=[128001, 128009])

    resolved = EngineConfig(model, max_model_len=1000, block_size=16).resolve()

    assert resolved.architecture == "LlamaForCausalLM"
    assert resolved.eos_token_ids == (128001, 128009)
    assert resolved.max_model_len == 1000
    assert resolved.max_blocks_per_seq == 63  # ceil(1000 / 16)


def test_resolve_without_any_eos_gives_no_eos_ids(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "no-eos", eos_token_id=None)

    assert EngineConfig(model).resolve().eos_token_ids == ()


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], ["Qwen3MoeForCausalLM"], None])
def test_resolve_rejects_an_unsupported_architecture(tmp_path: Path, architectures: Any) -> None:
    model = write_checkpoint(tmp_path / "other", architectures=architectures)

    with pytest.raises(ConfigError, match="supported: " + ", ".join(SUPPORTED_ARCHITECTURES)) as info:
        EngineConfig(model).resolve()
    assert str(architectures or []) in str(info.value)


def test_resolve_rejects_max_model_len_beyond_the_model_positions(model_dir: str) -> None:
    with pytest.raises(ConfigError, match="max_model_len 4096 exceeds the model's max_position_embeddings 2048"):
        EngineConfig(model_dir, max_model_len=4096).resolve()


def test_resolve_accepts_max_model_len_equal_to_the_model_positions(model_dir: str) -> None:
    assert EngineConfig(model_dir, max_model_len=2048).resolve().max_model_len == 2048


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 3), (4, 4, 8), (6, 6, 4)])
def test_resolve_rejects_tensor_parallel_size_not_dividing_the_heads(
    tmp_path: Path, heads: int, kv_heads: int, tp: int
) -> None:
    model = write_checkpoint(tmp_path / "m", num_attention_heads=heads, num_key_value_heads=kv_heads)

    with pytest.raises(ConfigError, match=f"tensor_parallel_size {tp} does not divide num_attention_heads {heads}"):
        EngineConfig(model, tensor_parallel_size=tp).resolve()


def test_resolve_rejects_kv_heads_and_tensor_parallel_size_that_do_not_divide_each_other(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3)

    with pytest.raises(ConfigError, match="tensor_parallel_size 2 and num_key_value_heads 3"):
        EngineConfig(model, tensor_parallel_size=2).resolve()


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(8, 2, 4), (8, 1, 8), (4, 4, 2), (4, 2, 2)])
def test_resolve_accepts_tensor_parallel_size_dividing_the_heads(
    tmp_path: Path, heads: int, kv_heads: int, tp: int
) -> None:
    """KV heads fewer than ranks are replicated, so 2 KV heads on 4 ranks is fine."""
    model = write_checkpoint(tmp_path / "m", num_attention_heads=heads, num_key_value_heads=kv_heads)

    assert EngineConfig(model, tensor_parallel_size=tp).resolve().tensor_parallel_size == tp


def test_resolve_rejects_tensor_parallel_size_not_dividing_the_intermediate_size(tmp_path: Path) -> None:
    """SmolLM2-135M's shape: 9 heads and 3 KV heads split over 9 ranks, but its MLP (3072) does not."""
    model = write_checkpoint(tmp_path / "m", arch="llama", num_attention_heads=9, num_key_value_heads=3,
                             hidden_size=576, head_dim=64, intermediate_size=3072)

    with pytest.raises(ConfigError, match="cannot be split over 9 tensor-parallel ranks: tensor_parallel_size 9 "
                                          "does not divide intermediate_size 3072$"):
        EngineConfig(model, tensor_parallel_size=9).resolve()
    assert EngineConfig(model, tensor_parallel_size=3).resolve().tensor_parallel_size == 3


def test_resolve_names_every_dimension_that_cannot_be_split(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3, intermediate_size=102)

    with pytest.raises(ConfigError, match="num_attention_heads 6; .*num_key_value_heads 3.*; .*intermediate_size 102"):
        EngineConfig(model, tensor_parallel_size=4).resolve()


def test_resolve_rejects_a_vocabulary_too_small_to_give_every_rank_a_slice(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", vocab_size=10, num_attention_heads=8, num_key_value_heads=8,
                             eos_token_id=1)

    with pytest.raises(ConfigError, match="vocab_size 10 is too small for 8 ranks"):
        EngineConfig(model, tensor_parallel_size=8).resolve()
    assert EngineConfig(model, tensor_parallel_size=2).resolve().vocab_size == 10


def test_resolve_reports_an_unreadable_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")

    with pytest.raises(ConfigError, match="cannot read"):
        EngineConfig(str(tmp_path)).resolve()


@pytest.mark.parametrize(("name", "value"), [("num_attention_heads", 0), ("num_key_value_heads", 0),
                                             ("hidden_size", -64), ("intermediate_size", 0), ("vocab_size", 0),
                                             ("num_hidden_layers", "2"), ("head_dim", 0)])
def test_resolve_rejects_a_size_in_config_json_that_is_not_a_positive_integer(tmp_path: Path, name: str,
                                                                              value: Any) -> None:
    settings = {**TINY, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], name: value}
    (tmp_path / "config.json").write_text(json.dumps(settings))

    with pytest.raises(ConfigError, match=f"config.json: {name} must be a positive integer, got {value!r}"):
        EngineConfig(str(tmp_path)).resolve()


def test_a_bad_eos_token_id_names_the_file_it_came_from(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))

    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id must be a non-negative integer or "
                                          "a list of them, got 'x'"):
        EngineConfig(model).resolve()
    (tmp_path / "m" / "generation_config.json").write_text("{broken")
    with pytest.raises(ConfigError, match="cannot read .*generation_config.json"):
        EngineConfig(model).resolve()


def test_resolve_reads_config_json_written_by_hand(tmp_path: Path) -> None:
    settings = {**TINY, "model_type": "llama", "architectures": ["MistralForCausalLM"], "eos_token_id": [2, 3]}
    (tmp_path / "config.json").write_text(json.dumps(settings))

    resolved = EngineConfig(str(tmp_path)).resolve()

    assert resolved.architecture == "MistralForCausalLM"
    assert resolved.eos_token_ids == (2, 3)


# ============================================================================ SamplingParams
def test_default_sampling_params_are_valid() -> None:
    params = SamplingParams()

    assert (params.temperature, params.max_tokens, params.seed) == (1.0, 64, None)


def test_temperature_zero_is_accepted_as_greedy() -> None:
    """BR-19 part 1: clients send temperature 0 for greedy decoding."""
    assert SamplingParams(temperature=0).temperature == 0
    assert SamplingParams(temperature=0.0, max_tokens=1).max_tokens == 1


@pytest.mark.parametrize(
    ("name", "value"),
    [("temperature", -0.1), ("temperature", -1), ("temperature", math.nan), ("temperature", math.inf),
     ("temperature", -math.inf), ("temperature", "0.5"), ("temperature", True), ("temperature", None),
     ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "8"),
     ("max_tokens", None), ("max_tokens", 8.0),
     ("seed", 1.5), ("seed", "1"), ("seed", True),
     ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
     ("stop_token_ids", "1,2"), ("stop_token_ids", None), ("stop_token_ids", 5)],
)
def test_invalid_sampling_param_raises_value_error_naming_it(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{name} "):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1])
def test_a_seed_in_0_to_2_63_is_accepted_by_a_request_and_by_the_engine(model_dir: str, seed: int) -> None:
    assert SamplingParams(seed=seed).seed == seed
    assert EngineConfig(model_dir, seed=seed).seed == seed


@pytest.mark.parametrize("seed", [-1, -2**63, 2**63, 2**64 - 1])
def test_a_seed_outside_0_to_2_63_is_refused_by_a_request_and_by_the_engine_naming_the_range(
        model_dir: str, seed: int) -> None:
    """The sampler keys its noise by the seed modulo 2**63: a seed outside [0, 2**63) would repeat
    the samples of one inside, so neither a request nor the engine takes one."""
    with pytest.raises(ValueError, match=re.escape(f"seed must be an integer in [0, 2**63) or None, got {seed}")):
        SamplingParams(seed=seed)
    with pytest.raises(ConfigError, match=re.escape(f"seed must be an integer in [0, 2**63), got {seed}")):
        EngineConfig(model_dir, seed=seed)


def test_seeds_2_63_apart_would_draw_the_same_noise() -> None:
    from workers.sampler import seeded_generator_seed

    assert seeded_generator_seed(5, 17) == seeded_generator_seed(5 + 2**63, 17)
    assert seeded_generator_seed(2**63 - 1, 17) == seeded_generator_seed(-1, 17)


def test_from_dict_rejects_an_unknown_key_naming_it() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameters \\['temprature'\\]"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_from_dict_rejects_a_non_map() -> None:
    with pytest.raises(ValueError, match="must be a map"):
        SamplingParams.from_dict([("temperature", 0.5)])  # type: ignore[arg-type]


def test_from_dict_validates_the_values() -> None:
    with pytest.raises(ValueError, match="^max_tokens "):
        SamplingParams.from_dict({"max_tokens": 0})


def test_from_dict_inverts_to_dict() -> None:
    params = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True, stop_token_ids=[3, 4], seed=11,
                            skip_special_tokens=False)

    assert SamplingParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize("name", ["ignore_eos", "skip_special_tokens"])
def test_non_bool_flag_raises_value_error_naming_it(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_dict({name: "false"})


def test_numpy_numbers_are_accepted_as_settings_and_stored_as_python_ones(model_dir: str) -> None:
    import numpy as np

    config = EngineConfig(model_dir, seed=np.int64(3), max_num_seqs=np.int32(8), cuda_graph_sizes=[np.int64(2), 1],
                          gpu_memory_utilization=np.float64(0.5))
    assert (type(config.seed), type(config.max_num_seqs), config.cuda_graph_sizes) == (int, int, (1, 2))
    assert EngineConfig.from_json(config.to_json()) == config
