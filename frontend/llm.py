"""The offline API, with nano-vllm's call shape:

    from deltaserve import LLM, SamplingParams
    llm = LLM("path/to/model", max_model_len=4096)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=64))
    outputs[0]["text"], outputs[0]["token_ids"]

`LLM` starts the same processes as `launch.py` and talks to them over the same sockets.
"""

from __future__ import annotations

import atexit
import logging
import numbers
import weakref
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any

from tqdm.auto import tqdm

from common.config import EngineConfig
from common.protocol import GenerateRequest, RequestOutput
from common.sampling_params import SamplingParams
from frontend.client import EngineClient, output_dict, set_prompt
from frontend.launcher import EngineProcesses

log = logging.getLogger("deltaserve")


class LLM:
    """An engine (frontend, scheduler, workers) owned by this object.

    `model`: a local Hugging Face folder. Keyword arguments are `EngineConfig` fields with vLLM's
    names (max_model_len, max_num_seqs, max_num_batched_tokens, block_size, num_kvcache_blocks,
    gpu_memory_utilization, enforce_eager, dtype, device, seed, tensor_parallel_size, ...).
    Raises `ConfigError` for bad settings and `EngineStartError` if a process fails to start.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        if "tp" in kwargs:
            kwargs["tensor_parallel_size"] = kwargs.pop("tp")
        self.engine = EngineProcesses(EngineConfig(model=model, **kwargs))
        self.config = self.engine.config
        self.info = self.engine.start()
        self.client = EngineClient(self.engine.endpoints.client, liveness=self.engine.check)
        self._finalizer = weakref.finalize(self, _shutdown, self.engine, self.client)
        atexit.register(self._finalizer)
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (loaded on first use, in this process)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or self.config.model)
        return self._tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Generate for every prompt (texts, or token-id lists); returns one dict per prompt, in order.

        Each dict has `text`, `token_ids` (output ids), `finish_reason` ("stop", "length" or
        "error") and `stop_reason` (the stop string or token id that ended it) of the first sample,
        `error` (why a request was rejected, else None), `num_prompt_tokens`, `num_cached_tokens`,
        `metrics` (ttft_s, e2e_s, num_preemptions), `outputs` (one dict per sample, n of them: index,
        text, token_ids, finish_reason, stop_reason, logprobs, cumulative_logprob) and
        `prompt_logprobs` (None unless asked for). A rejected request (e.g. empty, longer
        than max_model_len, a token id out of the vocabulary or past 64 bits, text with a lone
        surrogate, sampling parameters out of range) fails alone; the others run. Token ids may be
        numpy arrays. Raises `TypeError` for prompts of the wrong type (bytes included: decode them
        to str), and `EngineDeadError` if an engine process dies or after `shutdown()`.
        """
        self.engine.check()  # a dead or shut-down engine: EngineDeadError saying which, not a socket error
        if hasattr(prompts, "tolist"):  # a numpy array or torch tensor of token ids
            prompts = prompts.tolist()
        elif not isinstance(prompts, (str, bytes, Sequence)):
            if not isinstance(prompts, Iterable) or isinstance(prompts, (Mapping, Set)):  # no order, or a message
                raise TypeError(f"prompts must be a text, token ids, or a list of them, got {type(prompts).__name__}")
            prompts = list(prompts)  # a generator or other one-pass iterable of prompts
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling parameters for {len(prompts)} prompts")
        requests = []
        index: dict[str, int] = {}  # request id -> prompt index
        results: list[dict[str, Any] | None] = [None] * len(prompts)
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
            req = GenerateRequest(self.client.new_request_id(), stream=False)
            try:
                set_prompt(req, prompt, allow_messages=False)
            except TypeError as exc:  # a programming error, not a bad request: the whole call fails
                raise TypeError(f"prompt {i}: {exc}") from None
            try:
                sp.validate()  # again: fields may have been changed since construction
            except ValueError as exc:
                results[i] = self._result(i, RequestOutput(req.request_id, finished=True, finish_reason="error",
                                                           error=str(exc)))
                continue
            req.sampling = sp.to_dict()
            requests.append(req)
            index[req.request_id] = i
        with self.client.exclusive():  # another thread's generate() now raises instead of taking our outputs
            if requests:
                self.client.submit(requests)
            bar = tqdm(total=len(prompts), initial=len(prompts) - len(requests), desc="Generating",
                       dynamic_ncols=True, disable=not use_tqdm)
            done = 0
            try:
                while done < len(requests):
                    for out in self.client.recv_outputs():
                        i = index.get(out.request_id)
                        if i is None or not out.finished:
                            continue
                        results[i] = self._result(i, out)
                        done += 1
                        bar.update(1)
            except BaseException:
                if not self.engine.closed:
                    self.client.abort([r.request_id for r in requests if results[index[r.request_id]] is None])
                raise
            finally:
                bar.close()
        return results  # type: ignore[return-value]

    @staticmethod
    def _result(i: int, out: RequestOutput) -> dict[str, Any]:
        """The dict `generate` returns for prompt `i`, from its final output."""
        if out.error:
            log.warning("prompt %d failed: %s", i, out.error)
        return output_dict(out)

    def shutdown(self) -> None:
        """Stop the engine's processes (also done at exit and when the object is collected)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _shutdown(engine: EngineProcesses, client: EngineClient) -> None:
    client.close()
    engine.shutdown()
