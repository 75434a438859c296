"""The offline API, with nano-vllm's call shape:

    from deltaserve import LLM, SamplingParams
    llm = LLM("path/to/model", max_model_len=4096)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=64))
    outputs[0]["text"], outputs[0]["token_ids"]
    llm.chat([{"role": "user", "content": "Hi"}])  # through the model's chat template

`LLM` starts the same processes as `launch.py` and talks to them over the same sockets.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import numbers
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any

from tqdm.auto import tqdm

from common.config import ConfigError, EngineConfig
from common.protocol import GenerateRequest, ProfileStatus, RequestOutput
from common.sampling_params import SamplingParams
from frontend.chat_output import read_chat_output
from frontend.client import EngineClient, output_dict, set_prompt
from frontend.launcher import EngineProcesses
from frontend.reasoning_parsers import get_reasoning_parser
from frontend.tool_parsers import TOOL_PARSER_NAMES
from frontend.tools import resolve_tool_choice, tool_constraint

log = logging.getLogger("deltaserve")


class LLM:
    """An engine (frontend, scheduler, workers) owned by this object.

    `model`: a local Hugging Face folder. Keyword arguments are `EngineConfig` fields with vLLM's
    names (max_model_len, max_num_seqs, max_num_batched_tokens, block_size, num_kvcache_blocks,
    gpu_memory_utilization, enforce_eager, dtype, device, seed, tensor_parallel_size,
    reasoning_parser, ...), and `tool_call_parser` (vLLM's `--tool-call-parser`: "hermes" or
    "llama3_json"), which `chat(..., tools=...)` reads calls with when tool_choice is "auto".
    Raises `ConfigError` for bad settings and `EngineStartError` if a process fails to start.
    """

    def __init__(self, model: str, tool_call_parser: str | None = None, **kwargs: Any) -> None:
        if "tp" in kwargs:
            kwargs["tensor_parallel_size"] = kwargs.pop("tp")
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSER_NAMES:
            raise ConfigError(f"tool_call_parser must be one of {TOOL_PARSER_NAMES}, got {tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser
        self.engine = EngineProcesses(EngineConfig(model=model, **kwargs))
        self.config = self.engine.config
        self.info = self.engine.start()
        self.client = EngineClient(self.engine.endpoints.client, liveness=self.engine.check,
                                   curve=self.engine.client_keys())
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

    def get_tokenizer(self) -> Any:
        """The model's tokenizer, the one the engine encodes prompts with (vLLM's `LLM.get_tokenizer`)."""
        return self.tokenizer

    def generate(
        self,
        prompts: str | Mapping[str, Any] | Sequence[str | Sequence[int] | Mapping[str, Any]] | Sequence[int],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Generate for every prompt; returns one dict per prompt, in order.

        A prompt is a text, token ids (a list or a numpy array), or vLLM's dict prompts `{"prompt": text}` and
        `{"prompt_token_ids": ids}`; `prompts` is one prompt or a list of them (`[]` returns `[]`). Each dict has
        `text`, `token_ids` (output ids), `finish_reason` ("stop", "length" or "error") and `stop_reason` (the stop
        string or token id that ended it) of the first sample, `error` (why a request was rejected, else None),
        `num_prompt_tokens`, `num_cached_tokens`, `metrics` (ttft_s, e2e_s, num_preemptions), `outputs` (one dict
        per sample, n of them: index, text, token_ids, finish_reason, stop_reason, logprobs, cumulative_logprob) and
        `prompt_logprobs` (None unless asked for). A rejected request (e.g. empty, longer than max_model_len, a
        token id out of the vocabulary, text with a lone surrogate, sampling parameters out of range) fails alone;
        the others run. `use_tqdm` (keyword only): show a progress bar of finished prompts, with the input and
        output tokens per second. Raises `TypeError` for prompts of the wrong type (bytes included: decode them to
        str; chat messages go to `chat`), and `EngineDeadError` if an engine process dies or after `shutdown()`.
        """
        self.engine.check()  # a dead or shut-down engine: EngineDeadError saying which, not a socket error
        if hasattr(prompts, "tolist"):  # a numpy array or torch tensor of token ids
            prompts = prompts.tolist()
        elif isinstance(prompts, Mapping):
            prompts = [prompts]  # one dict prompt (`set_prompt` says what one must hold)
        elif not isinstance(prompts, (str, bytes, Sequence)):
            if not isinstance(prompts, Iterable) or isinstance(prompts, Set):  # a set has no order
                raise TypeError(f"prompts must be a text, token ids, a dict prompt, or a list of them, got "
                                f"{type(prompts).__name__}")
            prompts = list(prompts)  # a generator or other one-pass iterable of prompts
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]  # type: ignore[list-item]
        requests = []
        for i, prompt in enumerate(prompts):
            req = GenerateRequest(self.client.new_request_id(), stream=False)
            try:
                set_prompt(req, prompt, allow_messages=False)
            except TypeError as exc:  # a programming error, not a bad request: the whole call fails
                raise TypeError(f"prompt {i}: {exc}") from None
            requests.append(req)
        return self._run(requests, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[dict[str, Any]]:
        """Generate a reply to each conversation, rendered by the model's chat template in the engine's
        frontend (vLLM's `LLM.chat`); returns one dict per conversation, in order, as `generate` does, with
        the reply also read as an assistant message (below).

        `messages`: one conversation (a list of {"role": str, "content": str} dicts, and OpenAI's assistant
        messages with `tool_calls` and `role: "tool"` messages with `tool_call_id`) or a list of them; `[]` is no
        conversations and returns `[]`, as `generate([])` does.
        `add_generation_prompt`: end with the opening of the assistant's turn (the default), so the model
        answers; `continue_final_message`: leave the last message (an assistant's) open for the model to
        continue instead; `chat_template_kwargs`: extra template variables, e.g. {"enable_thinking": False}
        for Qwen3. A conversation the template refuses fails alone, with `error` saying why.

        `tools` (OpenAI's `[{"type": "function", "function": {"name", "description", "parameters"}}]`) are
        rendered by the chat template; `tool_choice` and `parallel_tool_calls` mean what they mean in the
        HTTP API (`frontend/tools.py`): "auto" (the default with tools when `tool_call_parser` is set, else
        "none") reads the calls the model writes with that parser, "required" and {"type": "function",
        "function": {"name": ...}} force calls with a grammar (not beside a `structured_outputs`).

        Each result (for sample 0) and each entry of its `outputs` gains the reply read as OpenAI's assistant
        message: `content` (the text that is neither reasoning nor a call; None when they took all of it),
        `reasoning_content` (with `reasoning_parser`: the text inside <think>...</think>, else None) and
        `tool_calls` (a list, empty without calls, of {"id", "type": "function", "function": {"name",
        "arguments": JSON text}}). `text` stays the whole output. Raises `TypeError` for `messages` that are
        not a list (a str included) or a conversation that is not a list of dicts, `ValueError` when both
        `add_generation_prompt` and `continue_final_message` are set or for tools and a tool_choice that cannot
        run (the message names which), and `EngineDeadError` as `generate`.
        """
        self.engine.check()
        if tool_choice is None and tools:
            tool_choice = "auto" if self.tool_call_parser is not None else "none"  # vLLM renders tools alone
        choice = resolve_tool_choice(list(tools) if tools else None, tool_choice, parallel_tool_calls,
                                     self.tool_call_parser, True, "LLM(..., tool_call_parser='hermes' or "
                                                                  "'llama3_json')")
        tool_list = [dict(t) for t in tools] if tools else None
        constraint = tool_constraint(tool_list, choice) if choice is not None and tool_list else None
        if constraint is not None:
            sampling_params = self._with_constraint(sampling_params, constraint, tool_choice)
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true: the first opens "
                             "a new assistant turn, the second continues the last message (pass "
                             "add_generation_prompt=False)")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts (one conversation) or "
                            f"a list of such lists, got {type(messages).__name__}"
                            + ("; a text prompt goes to generate" if isinstance(messages, str) else ""))
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        requests = []
        for i, conversation in enumerate(conversations):
            if (isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence)
                    or not conversation or not all(isinstance(m, Mapping) for m in conversation)):
                raise TypeError(f"conversation {i} must be a non-empty list of {{'role': ..., 'content': ...}} "
                                f"dicts, got {conversation!r:.80}")
            requests.append(GenerateRequest(self.client.new_request_id(), messages=[dict(m) for m in conversation],
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            chat_template_kwargs=dict(chat_template_kwargs or {}), tools=tool_list))
        reasoning = get_reasoning_parser(self.config.reasoning_parser) if self.config.reasoning_parser else None

        def chat_result(i: int, out: RequestOutput) -> dict[str, Any]:
            result = self._result(i, out)
            for sample in result["outputs"]:
                message = read_chat_output(sample["text"], reasoning, out.prompt_reasoning, choice)
                read = {"content": message.content, "reasoning_content": message.reasoning_content,
                        "tool_calls": [c.to_openai() for c in message.tool_calls]}
                sample.update(read)
                if sample["index"] == out.index:  # the sample the top-level fields describe
                    result.update(read)
            return result

        return self._run(requests, sampling_params, use_tqdm, chat_result)

    @staticmethod
    def _with_constraint(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                         constraint: dict[str, Any], tool_choice: Any) -> SamplingParams | list[SamplingParams]:
        """The sampling parameters with the grammar of a forced tool call; raises `ValueError` for parameters
        that have a structured-output constraint of their own."""
        given = sampling_params if sampling_params is not None else SamplingParams()
        params = list(given) if isinstance(given, Sequence) else [given]
        if any(isinstance(sp, SamplingParams) and sp.structured_outputs is not None for sp in params):
            raise ValueError(f"structured_outputs: not with tool_choice {tool_choice!r}, which constrains the output "
                             "to the calls' JSON itself: one constraint per request")
        forced = [dataclasses.replace(sp, structured_outputs=dict(constraint)) if isinstance(sp, SamplingParams)
                  else sp for sp in params]
        return forced if isinstance(given, Sequence) else forced[0]

    def _run(self, requests: list[GenerateRequest], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, result: Callable[[int, RequestOutput], dict[str, Any]] | None = None,
             ) -> list[dict[str, Any]]:
        """Submit `requests` (prompts set, one `SamplingParams` for all or one each), wait until every one
        finishes, and return their `result` dicts in order (default: `_result`)."""
        result = result or self._result
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (str, bytes)):  # a Sequence, but of characters
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        many = isinstance(sampling_params, Sequence)
        params = list(sampling_params) if many else [sampling_params] * len(requests)
        if len(params) != len(requests):
            raise ValueError(f"{len(params)} sampling parameters for {len(requests)} prompts")
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                where = f"sampling_params[{i}]" if many else "sampling_params"
                raise TypeError(f"{where} must be SamplingParams, got {type(sp).__name__}")
        index: dict[str, int] = {}  # request id -> prompt index
        results: list[dict[str, Any] | None] = [None] * len(requests)
        valid = []
        for i, (req, sp) in enumerate(zip(requests, params)):
            try:
                sp.validate()  # again: fields may have been changed since construction
            except ValueError as exc:
                results[i] = result(i, RequestOutput(req.request_id, finished=True, finish_reason="error",
                                                     error=str(exc)))
                continue
            req.sampling = sp.to_dict()
            valid.append(req)
            index[req.request_id] = i
        with self.client.exclusive():  # another thread's generate() now raises instead of taking our outputs
            if valid:
                self.client.submit(valid)
            bar = tqdm(total=len(requests), initial=len(requests) - len(valid), desc="Generating",
                       dynamic_ncols=True, disable=not use_tqdm)
            done = num_input_tokens = num_output_tokens = 0
            t0 = time.perf_counter()
            try:
                while done < len(valid):
                    for out in self.client.recv_outputs():
                        i = index.get(out.request_id)
                        if i is None or not out.finished:
                            continue
                        results[i] = result(i, out)
                        done += 1
                        num_input_tokens += out.num_prompt_tokens
                        num_output_tokens += len(out.token_ids)
                        elapsed = max(time.perf_counter() - t0, 1e-9)
                        bar.set_postfix_str(f"input {num_input_tokens / elapsed:.1f} tok/s, "
                                            f"output {num_output_tokens / elapsed:.1f} tok/s", refresh=False)
                        bar.update(1)
            except BaseException:
                if not self.engine.closed:
                    self.client.abort([r.request_id for r in valid if results[index[r.request_id]] is None])
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

    def start_profile(self, num_steps: int = 0) -> ProfileStatus:
        """Start tracing every engine process at the next step (vLLM's `LLM.start_profile`), for at most
        `num_steps` steps (0: as many as `profile_steps` holds) or until `stop_profile()`. Needs `profile_dir`;
        raises `RuntimeError` with the engine's reason if it refuses."""
        return self.client.start_profile(num_steps)

    def stop_profile(self) -> ProfileStatus:
        """Stop the trace after the last step planned so far; returns once every process's trace is written and
        merged into `<folder>/timeline.json.gz`, with the summary table in `.summary`."""
        return self.client.stop_profile()

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
