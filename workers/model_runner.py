"""The device side of a worker: it builds the model, launches each step and receives the step's tokens.

`execute(plan)` applies a step plan to the persistent batch (workers/input_batch.py), copies the step's inputs to
the device (pinned host buffers, one non-blocking copy: workers/host_buffers.py), runs the model (a captured CUDA
graph for decode batches, workers/cuda_graphs.py; eagerly otherwise), samples (workers/sampling_step.py; in a
second graph for a decode step of plain rows at TP 1), and starts copying the sampled tokens back. It returns
without waiting for the device; `finalize` waits for the copy. The worker launches step N+1 before it finalizes
step N, so the device never waits for Python.

The KV cache (workers/kv_cache.py) is sized once, on a GPU after a warm-up step at the largest batch, and
allocated once. Forked samples (n > 1) get their copy of the parent's last partial prompt block right after the
forward that wrote it.

Structured outputs (workers/structured_output.py): a step with constrained rows launches its forward,
then `receive`s the previous step's tokens (the one wait for the device this adds, while the forward
runs), advances those rows' matchers, fills their bitmask on the host and uploads it, then processes and
samples. `finalize` of that previous step then finds its tokens already received.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from common.config import EngineConfig, load_hf_config
from common.profiling import PhaseRecorder
from common.protocol import GrammarCompiled, Logprobs, StepPlan
from common.units import count, format_bytes
from workers.attention import create_attention_backend
from workers.attention.base import AttentionMetadata
from workers.cuda_graphs import CUDAGraphRunner
from workers.deterministic import set_deterministic
from workers.graph_inputs import TORCH_DTYPES
from workers.host_buffers import INDEX_INPUTS, UPLOADS, HostBuffers
from workers.input_batch import InputBatch, StepInputs
from workers.kv_cache import (
    allocate_kv_cache,
    copy_fork_blocks,
    kv_bytes_per_block,
    kv_cache_torch_dtype,
    num_kv_blocks,
    prefill_batch,
    prepare_fp8_kv_cache,
    release_kv_cache,
)
from workers.layers.fused import enable_compilation
from workers.loader import load_model, resolve_device, resolve_dtype
from workers.models.llama import head_dim_of
from workers.parallel import init_tensor_parallel
from workers.request_state import ReqState
from workers.sampling_step import LogprobsOnHost, SamplingStep
from workers.structured_output import StructuredOutputManager, default_threads

log = logging.getLogger("deltaserve.worker")


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are still on their way to the host."""

    step_id: int
    states: list[ReqState]
    tokens_host: torch.Tensor | None  # pinned or plain host buffer holding the tokens
    event: torch.cuda.Event | None
    timings: dict[str, float] = field(default_factory=dict)
    # Device timing: the step's first and last recorded events, and the previous step's last.
    started: torch.cuda.Event | None = None
    ended: torch.cuda.Event | None = None
    previous_ended: torch.cuda.Event | None = None
    logprobs_host: LogprobsOnHost | None = None
    prompt_logprobs_host: LogprobsOnHost | None = None
    logprobs: Logprobs | None = None  # set by ModelRunner.finalize
    prompt_logprobs: Logprobs | None = None
    tokens: np.ndarray | None = None  # [S] int32 once received (ModelRunner.receive), in row order
    failed: dict[int, str] = field(default_factory=dict)  # seq id -> why its grammar refused its token
    # constrained requests sampling their last token here (`StepPlan.check_grammar_seq_ids`), and once the
    # tokens are received, the seq ids of those whose grammar was then incomplete
    check_grammar: list[ReqState] = field(default_factory=list)
    grammar_incomplete: list[int] = field(default_factory=list)

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class ModelRunner:
    """One rank's model, KV cache and persistent batch, and the parts of a step it holds: `sampling`
    (workers/sampling_step.py), `cuda_graphs` (workers/cuda_graphs.py) and two `HostBuffers`."""

    def __init__(self, config: EngineConfig, rank: int, dist_init: str, dist_listen_fd: int = -1,
                 report_grammar: Callable[[GrammarCompiled], None] | None = None) -> None:
        """`report_grammar`: where the compile thread sends each `GrammarCompiled` (from that thread)."""
        assert config.max_model_len is not None, "the launcher resolves the config first"
        self.config = config
        self.rank = rank
        self.device = resolve_device(config.device, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.hf_config = load_hf_config(config.model)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        init_tensor_parallel(rank, config.tensor_parallel_size, dist_init, self.device, self.dtype, dist_listen_fd)
        torch.manual_seed(config.seed)
        set_deterministic(config.deterministic)
        # The compiled and fused kernels (RMSNorm, QK-norm + RoPE + KV store, the small-batch GEMV) reduce in their
        # own orders: deterministic mode runs the plain layers, whose reductions are batch-invariant kernels.
        enable_compilation(self.device.type == "cuda" and not config.enforce_eager and not config.deterministic)
        self.model = model = load_model(config, self.hf_config, self.device, self.dtype)
        self.attn_layers = model.attention_layers()
        self.backend = create_attention_backend(config.attention_backend, self.device, self.dtype,
                                                head_dim_of(self.hf_config), config.block_size)
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        if self.kv_cache_dtype != self.dtype:  # fp8: every layer's scales, measured once, before any cache exists
            prepare_fp8_kv_cache(model, self.attn_layers, self.backend.name, self.hf_config.vocab_size,
                                 config.max_model_len, config.block_size, self.device, self.dtype, rank)
        head = model.lm_head
        self.block_size = config.block_size
        self.max_blocks_per_seq = config.max_blocks_per_seq
        self.structured = StructuredOutputManager(
            config.tokenizer or config.model, head.vocab_size, list(config.eos_token_ids), rank,
            report_grammar or (lambda msg: None), default_threads(config.tensor_parallel_size),
            pin_memory=self.device.type == "cuda", backend=config.structured_outputs_backend)
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, self.max_blocks_per_seq, self.block_size,
                                head.vocab_size, self.structured.new_grammar)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        # One set per step that may be launched before the oldest one's tokens are read (`max_steps_in_flight`, at
        # least 2): a step's sampled tokens land in its set, which the next steps must not reuse before then.
        self.host = [HostBuffers(max_tokens, config.max_num_seqs, self.max_blocks_per_seq, self.device)
                     for _ in range(max(2, config.max_steps_in_flight))]
        self.next_host = 0
        # Each batch row's latest sampled token, and past them one scratch entry for a graph's padding rows.
        self.last_sampled = torch.zeros(config.max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self.sampling = SamplingStep(model, self.structured, self.last_sampled, self.device, rank, config.seed,
                                     config.max_num_seqs, self._receive_launched)
        self.cuda_graphs = CUDAGraphRunner(config, model, self.last_sampled, self.device, rank)
        self.kv_cache: torch.Tensor | None = None
        self._last_step_end: torch.cuda.Event | None = None
        # The launched steps whose tokens are not received yet, oldest first: tokens are received in launch order,
        # since each step's tokens extend the requests and advance their grammars' matchers.
        self._unreceived: deque[PendingStep] = deque()
        # Called once a constrained step has received the earlier steps' tokens, before it fills its masks: the
        # worker process sends those steps' results from here (see `_receive_launched`).
        self.on_previous_received: Callable[[], None] | None = None
        self.phases = PhaseRecorder()  # the worker's, while it profiles (common/profiling.py)
        log.info("rank %d: %s on %s, %s, attention backend %s", rank, config.architecture, self.device,
                 self.dtype, self.backend.name)

    # ------------------------------------------------------------------ KV cache
    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block on this rank (all layers, keys and values)."""
        return kv_bytes_per_block(self.attn_layers, self.block_size, self.kv_cache_dtype)

    def device_name(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return "cpu"

    def max_num_kv_blocks(self) -> int:
        """Blocks this rank can hold (`kv_cache.num_kv_blocks`): forced, from a fixed budget, or measured on the
        GPU after a warm-up forward at the largest batch (`_profile_peak_memory`)."""
        return num_kv_blocks(self.config, self.kv_bytes_per_block, self.device, self.rank, self._profile_peak_memory)

    def _profile_peak_memory(self) -> int:
        """Peak bytes above the weights during a warm-up step at the largest batch (temp cache excluded)."""
        cfg = self.config
        num_tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        num_blocks = -(-num_tokens // self.block_size) + self.max_blocks_per_seq
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.allocate_kv_cache(num_blocks)
        cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        self._dummy_step(num_tokens, seq_len)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - cache_bytes
        self.kv_cache = None
        release_kv_cache(self.attn_layers)
        return max(0, peak)

    @torch.inference_mode()
    def _dummy_step(self, num_tokens: int, seq_len: int) -> None:
        """A forward and a sampling pass over `num_tokens` tokens in sequences of `seq_len`."""
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        positions, meta = prefill_batch(lens, self.block_size, self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, positions, meta)
        # The sampling of a step of max_num_seqs rows, with the costliest logits processing.
        self.sampling.dummy_run(hidden[: min(self.config.max_num_seqs, num_tokens)])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`, sliced per layer."""
        self.kv_cache = allocate_kv_cache(self.attn_layers, num_blocks, self.block_size, self.kv_cache_dtype,
                                          self.device)
        size = self.kv_cache.numel() * self.kv_cache.element_size()
        log.info("rank %d KV cache: %s x %s = %s, %s of %s", self.rank, count(num_blocks, "block"),
                 count(self.block_size, "token"), count(num_blocks * self.block_size, "token"), format_bytes(size),
                 self.kv_cache_dtype)

    # ------------------------------------------------------------------ CUDA graphs, kernel compilation
    def capture_cuda_graphs(self) -> None:
        """Capture the decode CUDA graphs (`CUDAGraphRunner.capture`) where they run: on CUDA, unless
        `enforce_eager`, with an attention backend that supports them."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.supports_cuda_graphs:
            return
        self.cuda_graphs.capture(self.sampling.sampler.fused, self.sampling.fused)

    @torch.no_grad()
    def compile_sampling(self) -> None:
        """Compile the LM head's batch-1 GEMV and the fused samplers (plain and processed rows) for every batch size
        now, on CUDA, so that no new batch size compiles a kernel mid-run (each held a step 0.4-0.7 s). Draws no
        seeds."""
        if self.device.type != "cuda":
            return
        hidden = torch.zeros(1, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        self.sampling.sampler.compile_kernels(self.config.max_num_seqs, logits.shape[1], logits.dtype)
        if self.sampling.fused is not None:
            self.sampling.fused.compile_kernels(self.config.max_num_seqs, logits.dtype)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def compile_attention(self) -> None:
        """Compile, on CUDA with the Triton backend, each split-KV decode kernel a step can pick, now: the CUDA
        graphs compile only the split counts of their full-width block tables, and an eager decode step of short
        sequences picked another one mid-run (issue 33: "_paged_decode_kernel num_stages=4" at max_num_seqs 100)."""
        if self.device.type != "cuda" or self.backend.name != "triton" or self.kv_cache is None:
            return
        from gpu_kernels.paged_decode import compile_decode_variants, reachable_num_splits

        layer = self.attn_layers[0]
        splits = reachable_num_splits(self.config.max_num_seqs, layer.num_kv_heads, self.batch.block_table.shape[1],
                                      self.block_size)
        q = torch.zeros(1, layer.num_heads, layer.head_dim, dtype=self.dtype, device=self.device)
        compile_decode_variants(q, layer.k_cache, layer.v_cache, splits, layer.scale, layer.k_scale, layer.v_scale)
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> PendingStep | None:
        """Apply `plan` and launch its step; None when the plan schedules nothing (deltas only)."""
        t0 = time.perf_counter()
        self.phases.begin("apply plan", plan.step_id)
        scheduled = self.batch.apply(plan)
        if not scheduled:
            self.phases.end()
            return None
        self.phases.begin("prepare inputs", plan.step_id)
        # Before prepare() advances the requests' counters: a row holds exactly the tokens known so far.
        penalties = self.sampling.penalties
        penalties.reset_rows(self.batch.admitted_penalized)
        forks = self.batch.forks
        penalties.copy_rows([p.row for f, p in forks if f.penalized], [f.row for f, _ in forks if f.penalized])
        inputs = self.batch.prepare(scheduled)
        t1 = time.perf_counter()
        host = self.host[self.next_host]
        self.next_host = (self.next_host + 1) % len(self.host)
        if host.copied is not None:
            host.copied.synchronize()  # its previous copies (len(self.host) steps ago) have run
        graph_bs = self.cuda_graphs.size_for(inputs)
        ended = None
        self.phases.begin("upload", plan.step_id)
        # A decode step samples in a graph too: plain rows only in the sampling graph, any processed row in the
        # processed-sampling graph (when its inputs fit it).
        sample_graph = processed_graph = None
        if graph_bs is not None and inputs.prompt_logprobs is None:
            if inputs.processing is None:
                sample_graph = self.cuda_graphs.sample_graphs.get(graph_bs)
            else:
                processed_graph = self.cuda_graphs.processed_for(inputs, graph_bs)
        if graph_bs is not None:
            in_graph = sample_graph is not None or processed_graph is not None
            seeds = self.sampling.sampler.draw_seeds(len(inputs.rows), inputs.temperatures, inputs.seeded_rows) \
                if in_graph else None
            started, dev_idx = self.cuda_graphs.upload(inputs, self.batch.block_table, graph_bs, seeds,
                                                       processed_graph)
        else:
            started, (input_ids, positions, meta, dev_idx) = self._upload(inputs, host)
        self.phases.begin("forward" if graph_bs is None else "graph replay", plan.step_id)
        if graph_bs is not None:
            graph, out = self.cuda_graphs.graphs[graph_bs]
            graph.replay()
            hidden = out[: len(inputs.rows)]
        else:
            hidden = self.model(input_ids, positions, meta)
        if inputs.forks:
            copy_fork_blocks(self.kv_cache, self.batch.block_table, inputs.forks, self.block_size, self.device)
        self.phases.begin("sample", plan.step_id)
        if sample_graph is not None:
            sample_graph.replay()
            tokens_host, event = host.tokens_to_host(self.cuda_graphs.graph_inputs["tokens"][: len(inputs.rows)])
            logprobs_host = prompt_logprobs_host = None
        elif processed_graph is not None:
            tokens_host, event, logprobs_host = self.sampling.sample_in_graph(inputs, host, processed_graph)
            prompt_logprobs_host = None
        else:
            sampled = self.sampling.sample(inputs, host, hidden, dev_idx)
            tokens_host, event, logprobs_host, prompt_logprobs_host = sampled
        if started is not None:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
        self.phases.end()
        t2 = time.perf_counter()
        timings = {"t_start": t0, "prepare_ms": (t1 - t0) * 1e3, "launch_ms": (t2 - t1) * 1e3,
                   "tokens": len(inputs.positions), "rows": len(inputs.rows), "decode": inputs.is_decode,
                   "graph": graph_bs or 0, **self.sampling.take_grammar_timings()}
        step = PendingStep(plan.step_id, inputs.sampling_states, tokens_host, event, timings, started, ended,
                           self._last_step_end, logprobs_host, prompt_logprobs_host)
        if len(plan.check_grammar_seq_ids):
            step.check_grammar = [self.batch.reqs[seq_id] for seq_id in plan.check_grammar_seq_ids.tolist()]
        self._last_step_end = ended
        self._unreceived.append(step)
        return step

    def _upload(self, inputs: StepInputs, host: HostBuffers
                ) -> tuple[torch.cuda.Event | None,
                           tuple[torch.Tensor, torch.Tensor, AttentionMetadata, dict[str, torch.Tensor]]]:
        """Copy an eager step's inputs to the device. Returns the step's start event (CUDA) with the inputs on
        the device.

        Every host buffer is filled before the start event is recorded and the first copy launched: an idle
        device reaches the event at once, so host work between the two would count as device time in the step
        log (it did: 0.3 ms a step of idle device missing from `idle_ms` against the profiler's trace)."""
        dev = self.device
        b = len(inputs.rows)
        width = max(1, inputs.num_blocks_used)
        arrays = {name: getattr(inputs, name) for name, _ in UPLOADS if name != "block_tables"}
        arrays["block_tables"] = self.batch.block_table[inputs.rows, :width]
        nbytes, layout = host.pack(arrays)
        started = None
        if dev.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        packed = host.packed[:nbytes].to(dev, non_blocking=True)
        on_dev = {name: packed[offset: offset + count * dtype.itemsize].view(TORCH_DTYPES[dtype])
                  for name, (offset, count, dtype) in layout.items()}
        input_ids, positions, slot_mapping = on_dev["input_ids"], on_dev["positions"], on_dev["slot_mapping"]
        qsl, seq_lens = on_dev["query_start_loc"], on_dev["seq_lens"]
        block_tables = on_dev["block_tables"].view(b, width)
        dev_idx = {name: on_dev[name] for name in INDEX_INPUTS}
        if host.copied is not None:
            host.copied.record()
        if len(inputs.gpu_token_index):
            input_ids[dev_idx["gpu_token_index"]] = self.last_sampled[dev_idx["gpu_token_rows"]]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=seq_lens, block_tables=block_tables,
            max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len, is_decode=inputs.is_decode,
            query_start_loc_cpu=inputs.query_start_loc, seq_lens_cpu=inputs.seq_lens)
        return started, (input_ids, positions, meta, dev_idx)

    def _receive_launched(self) -> None:
        """Receive the tokens of every launched step not received yet, oldest first (`SamplingStep`'s wait
        before a grammar bitmask), then call `on_previous_received`. The worker process sends those steps' results
        there, before the masks are filled, not after this step's launch: the scheduler then plans the next step
        while the masks fill, and its plan is waiting when this step's sampling is launched. Sent after the masks,
        the result made the device idle for the scheduler's round trip after every constrained step."""
        if self._unreceived:
            self.receive(self._unreceived[-1])
            if self.on_previous_received is not None:
                phase = self.phases.current
                self.on_previous_received()  # it records phases of its own: resume this step's afterwards
                if phase is not None:
                    self.phases.begin(*phase)

    def receive(self, step: PendingStep) -> np.ndarray:
        """Wait for a step's sampled tokens, record them in the batch and advance the constrained requests'
        matchers by them (their refusals go to `step.failed`, and the requests of `step.check_grammar` whose grammar
        is then incomplete to `step.grammar_incomplete`); return them (int32, row order). The steps launched before
        it are received first, in launch order. Once per step: a later call returns the same tokens."""
        while step.tokens is None and self._unreceived:
            self._receive_one(self._unreceived.popleft())
        return self._receive_one(step)

    def _receive_one(self, step: PendingStep) -> np.ndarray:
        if step.tokens is None:
            if step.event is not None:
                step.event.synchronize()
            step.timings["t_tokens"] = time.perf_counter()  # the tokens are on the host: the result's host work begins
            step.tokens = (np.zeros(0, dtype=np.int32) if step.tokens_host is None
                           else step.tokens_host.numpy().astype(np.int32))
            constrained = InputBatch.append_sampled(step.states, step.tokens)
            if constrained:
                errors = self.structured.accept([st.grammar for st, _ in constrained], [t for _, t in constrained])
                step.failed = {constrained[i][0].seq_id: why for i, why in errors.items()}
            step.grammar_incomplete = [st.seq_id for st in step.check_grammar
                                       if st.grammar is not None and not st.grammar.accepting()]
        return step.tokens

    def finalize(self, step: PendingStep) -> np.ndarray:
        """Wait for a step's sampled tokens (`receive`, if not done yet); return them (int32, row order), with
        the step's timings and logprobs filled in."""
        tokens = self.receive(step)
        if step.ended is not None:
            step.ended.synchronize()
            step.timings["gpu_ms"] = step.started.elapsed_time(step.ended)
            if step.previous_ended is not None:
                # Device idle between the previous step's last operation and this step's first.
                step.timings["idle_ms"] = max(0.0, step.previous_ended.elapsed_time(step.started))
        if step.logprobs_host is not None:
            step.logprobs = step.logprobs_host.to_wire()
        if step.prompt_logprobs_host is not None:
            step.prompt_logprobs = step.prompt_logprobs_host.to_wire()
        return tokens
