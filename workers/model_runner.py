"""The device side of a worker: model, KV cache, step execution, sampling, CUDA graphs.

`execute(plan)` applies a step plan to the persistent batch, copies the step's inputs to the
device (pinned host buffers, non-blocking copies), runs the model (a captured CUDA graph for
decode batches, eagerly otherwise), samples (in a second graph for a decode step of plain rows at TP 1,
workers/graph_inputs.py), and starts copying the sampled tokens back. It
returns without waiting for the device; `finalize` waits for the copy. The worker launches step
N+1 before it finalizes step N, so the device never waits for Python.

Rows whose requests set filters, penalties, logit bias or logprobs go through
workers/logits_processing.py between the LM head and the sampler; their logprobs, and the prompt
logprobs of prefill chunks that asked, are copied back with the tokens (pinned memory, same event).
Forked samples (n > 1) get their copy of the parent's last partial prompt block right after the
forward that wrote it.

Structured outputs (workers/structured_output.py): a step with constrained rows launches its forward,
then `receive`s the previous step's tokens (the one wait for the device this adds, while the forward
runs), advances those rows' matchers, fills their bitmask on the host and uploads it, then processes and
samples. `finalize` of that previous step then finds its tokens already received.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from common import envs
from common.config import EngineConfig, load_hf_config
from common.errors import ExplainedError
from common.profiling import PhaseRecorder
from common.protocol import GrammarCompiled, Logprobs, StepPlan, f32, i32
from common.units import count, format_bytes
from workers.attention import create_attention_backend
from workers.attention.base import AttentionMetadata
from workers.graph_inputs import TORCH_DTYPES, GraphInputs, aligned, decode_input_ids
from workers.input_batch import InputBatch, ReqState, StepInputs
from workers.kv_cache import kv_cache_torch_dtype, prepare_fp8_kv_cache
from workers.layers.fused import enable_compilation
from workers.loader import load_weights
from workers.logits_processing import (
    PROMPT_LOGPROBS_CHUNK,
    LogitsProcessor,
    gather_vocabulary,
    to_device,
    token_logprobs,
    worst_case_inputs,
)
from workers.models import MODEL_REGISTRY
from workers.models.llama import head_dim_of
from workers.parallel import init_tensor_parallel, tp_size
from workers.sampler import ProcessedRows, Sampler
from workers.structured_output import StructuredOutputManager, bitmask_width, default_threads

log = logging.getLogger("deltaserve.worker")
# Per-row index inputs of a step, uploaded beside the model inputs (HostBuffers and StepInputs fields of these names)
GiB = 1 << 30


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_device(name: str, rank: int) -> torch.device:
    """"auto" -> cuda:<rank mod device count> when CUDA is available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ExplainedError("device 'cuda' was requested but CUDA is not available")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(name: str, hf_config: object, device: torch.device) -> torch.dtype:
    """"auto": the checkpoint's 16-bit dtype on GPUs (bfloat16 if it declares none), float32 on CPU."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    declared = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    declared = getattr(torch, declared) if isinstance(declared, str) else declared
    return declared if declared in (torch.float16, torch.bfloat16) else torch.bfloat16


@dataclass
class LogprobsOnHost:
    """Logprobs of a step on their way to the host (pinned tensors), and how to read them."""

    rows: np.ndarray  # [r] int32: sampling-row indices (sampled tokens) or seq ids (prompt tokens)
    counts: np.ndarray  # [r] positions per row
    num_top: np.ndarray  # [r] top entries asked by each row
    token_logprobs: torch.Tensor  # [P] float32
    ranks: torch.Tensor  # [P] int64
    top_logprobs: torch.Tensor  # [P, N] float32, N >= every num_top
    top_token_ids: torch.Tensor  # [P, N] int64

    def to_wire(self) -> Logprobs:
        """The `Logprobs` struct; top entries of logprob -inf (tokens a filter removed) are left out."""
        top_lp = self.top_logprobs.numpy()
        top_ids = self.top_token_ids.numpy()
        want = np.repeat(self.num_top, self.counts)  # [P]
        keep = (np.arange(top_lp.shape[1])[None, :] < want[:, None]) & np.isfinite(top_lp)
        per_position = keep.sum(axis=1)
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        if len(per_position) and (per_position != np.repeat(per_position[starts], self.counts)).any():
            # Rows whose positions keep different numbers of finite entries: one row per position.
            rows, counts = np.repeat(self.rows, self.counts), np.ones(len(per_position), np.int32)
            num_top = per_position
        else:
            rows, counts, num_top = self.rows, self.counts, per_position[starts] if len(starts) else per_position
        return Logprobs(i32(rows), i32(counts), i32(num_top), f32(self.token_logprobs.numpy()),
                        i32(self.ranks.numpy()), i32(top_ids[keep]), f32(top_lp[keep]))


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

    def ready(self) -> bool:
        return self.event is None or self.event.query()


# A step's inputs, in the order and dtype they are packed for the device (`HostBuffers.pack`).
_UPLOADS = (("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64),
            ("query_start_loc", np.int32), ("seq_lens", np.int32), ("block_tables", np.int32),
            ("gpu_token_index", np.int64), ("gpu_token_rows", np.int64), ("logits_indices", np.int64),
            ("sampling_rows", np.int64), ("temperatures", np.float32))
_INDEX_INPUTS = ("gpu_token_index", "gpu_token_rows", "logits_indices", "sampling_rows", "temperatures")


class HostBuffers:
    """Pinned host staging memory for one step's inputs (two sets alternate between steps, so a step
    never overwrites memory whose copy to the device may not have run yet).

    All of a step's inputs are packed into one byte buffer and go to the device in one copy: at batch 1
    a step's eleven separate copies cost more host time than the device spends on them."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        capacity = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                    "query_start_loc": max_seqs + 1, "seq_lens": max_seqs, "block_tables": max_seqs * max_blocks,
                    "gpu_token_index": max_tokens, "gpu_token_rows": max_tokens, "logits_indices": max_seqs,
                    "sampling_rows": max_seqs, "temperatures": max_seqs}
        nbytes = sum(aligned(capacity[name] * np.dtype(dtype).itemsize) for name, dtype in _UPLOADS)
        self.packed = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._packed_np = self.packed.numpy()
        self.sampled = torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin)
        self.copied: torch.cuda.Event | None = torch.cuda.Event() if pin else None

    def pack(self, arrays: dict[str, np.ndarray]) -> tuple[int, dict[str, tuple[int, int, np.dtype]]]:
        """Write `arrays` (every name of `_UPLOADS`, any integer/float dtype, cast to the listed one) into the
        packed buffer. Returns (bytes used, name -> (byte offset, element count, dtype))."""
        layout = {}
        offset = 0
        for name, dtype in _UPLOADS:
            arr = arrays[name]
            count = arr.size
            np.copyto(self._packed_np[offset: offset + count * np.dtype(dtype).itemsize].view(dtype),
                      arr.reshape(-1), casting="same_kind")
            layout[name] = (offset, count, np.dtype(dtype))
            offset += aligned(count * np.dtype(dtype).itemsize)
        return offset, layout


def _host_memory_available() -> int | None:
    """Bytes of host memory available to new allocations (MemAvailable of /proc/meminfo), or None
    where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class ModelRunner:
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
        enable_compilation(self.device.type == "cuda" and not config.enforce_eager)
        with torch.device(self.device), default_dtype(self.dtype):
            model = MODEL_REGISTRY[config.architecture](self.hf_config, config.max_model_len)
        model.to(self.device)  # buffers built on the host (rope tables)
        load_weights(model, config.model, self.hf_config)
        self.model = model.eval()
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
        self.sampler = Sampler(self.device, config.seed, head.vocab_size, head.vocab_start)
        self.block_size = config.block_size
        self.max_blocks_per_seq = config.max_blocks_per_seq
        self.structured = StructuredOutputManager(
            config.tokenizer or config.model, head.vocab_size, list(config.eos_token_ids), rank,
            report_grammar or (lambda msg: None), default_threads(config.tensor_parallel_size),
            pin_memory=self.device.type == "cuda", backend=config.structured_outputs_backend)
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, self.max_blocks_per_seq, self.block_size,
                                head.vocab_size, self.structured.new_grammar)
        self.processor = LogitsProcessor(self.device, config.max_num_seqs, head.vocab_size)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.host = [HostBuffers(max_tokens, config.max_num_seqs, self.max_blocks_per_seq, self.device)
                     for _ in range(2)]
        self.step_parity = 0
        # Each batch row's latest sampled token, and past them one scratch entry for a graph's padding rows.
        self.last_sampled = torch.zeros(config.max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self.kv_cache: torch.Tensor | None = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> (forward, hidden)
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> LM head + sampler
        self.graph_io: GraphInputs | None = None
        self.graph_inputs: dict[str, torch.Tensor] = {}
        self._last_step_end: torch.cuda.Event | None = None
        self._last_launched: PendingStep | None = None  # the step launched last: its tokens may not be received
        self._grammar_timings: dict[str, float] = {}  # of the step being launched: its wait and mask times
        self.phases = PhaseRecorder()  # the worker's, while it profiles (common/profiling.py)
        log.info("rank %d: %s on %s, %s, attention backend %s", rank, config.architecture, self.device,
                 self.dtype, self.backend.name)

    # ------------------------------------------------------------------ KV cache
    @property
    def kv_bytes_per_block(self) -> int:
        layer = self.attn_layers[0]
        per_token = 2 * len(self.attn_layers) * layer.num_kv_heads * layer.head_dim * self.kv_cache_dtype.itemsize
        return per_token * self.block_size

    def device_name(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return "cpu"

    def max_num_kv_blocks(self) -> int:
        """Blocks this rank can hold: forced, from a fixed budget, or measured on the GPU.

        On a GPU: a warm-up forward at the largest batch measures peak activation memory; the
        cache gets `gpu_memory_utilization` of the card minus weights, activations and
        memory outside torch (CUDA context, NCCL).
        """
        cfg = self.config
        per_block = self.kv_bytes_per_block
        if self.device.type == "cpu":
            budget = (cfg.kv_cache_memory_gb or 1.0) * GiB
            if not cfg.num_kvcache_blocks and budget < per_block:
                raise ExplainedError(f"one KV block ({count(cfg.block_size, 'token')}, {format_bytes(per_block)}) is "
                                     f"larger than the CPU KV-cache budget of {format_bytes(budget)}: lower "
                                     "--block-size or raise --kv-cache-memory-gb")
            num_blocks = cfg.num_kvcache_blocks or int(budget // per_block)
            available = _host_memory_available()
            if available is not None and num_blocks * per_block > available:
                size = format_bytes(num_blocks * per_block)
                raise ExplainedError(f"a KV cache of {count(num_blocks, 'block')} ({size}) does not fit in this "
                                     f"host's available memory ({format_bytes(available)}): lower "
                                     "--kv-cache-memory-gb or --num-kvcache-blocks")
            return num_blocks
        peak_activations = self._profile_peak_memory()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * GiB
        else:
            budget = total * cfg.gpu_memory_utilization - non_torch - weights - peak_activations
        capacity = max(0, int(budget // per_block))
        log.info("rank %d memory: total %.1f GiB, weights %.2f GiB, peak activations %.2f GiB, other %.2f GiB "
                 "-> room for %d KV blocks", self.rank, total / GiB, weights / GiB, peak_activations / GiB,
                 non_torch / GiB, capacity)
        if cfg.num_kvcache_blocks:
            if cfg.num_kvcache_blocks > capacity:
                raise ExplainedError(f"num_kvcache_blocks {cfg.num_kvcache_blocks} does not fit: this GPU has "
                                     f"room for {count(capacity, 'block')} of {format_bytes(per_block)}")
            return cfg.num_kvcache_blocks
        return capacity

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
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        return max(0, peak)

    @torch.inference_mode()
    def _dummy_step(self, num_tokens: int, seq_len: int) -> None:
        """A forward and a sampling pass over `num_tokens` tokens in sequences of `seq_len`."""
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
        bs = self.block_size
        width = -(-seq_len // bs)
        tables = (np.arange(len(lens))[:, None] * width + np.arange(width)[None, :]).astype(np.int32)
        seq_index = np.repeat(np.arange(len(lens)), lens)
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev), query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(lens), max_seq_len=max(lens), is_decode=False,
            query_start_loc_cpu=qsl, seq_lens_cpu=np.array(lens, dtype=np.int32))
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(dev), meta)
        n = min(self.config.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:n])
        self.sampler(logits, torch.ones(n, device=dev), all_greedy=False)
        # The costliest logits processing too (a whole-row sort, penalties, 20 logprobs), so that the
        # memory it takes is measured and the penalty counts exist before the KV cache is sized; and once
        # for a single row, which torch.compile specializes (no compile stalls a first step later).
        for rows in sorted({n, 1}, reverse=True):
            d = self.processor.upload(worst_case_inputs(rows))
            d.bitmask = torch.full((rows, bitmask_width(self.processor.vocab_size)), -1, dtype=torch.int32, device=dev)
            x = self.processor.apply(gather_vocabulary(logits[:rows], self.processor.vocab_size,
                                                       self.model.lm_head.rows_per_rank), d, self.last_sampled)
            tokens = self.sampler(logits[:rows], torch.ones(rows, device=dev), False, processed=ProcessedRows(
                d.i["rows"], d.host.rows, x, d.f["sample_temperatures"], True))
            self.processor.logprobs(x, d, tokens)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`, sliced per layer."""
        layer = self.attn_layers[0]
        self.kv_cache = torch.zeros(2, len(self.attn_layers), num_blocks, self.block_size, layer.num_kv_heads,
                                    layer.head_dim, dtype=self.kv_cache_dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]
        size = self.kv_cache.numel() * self.kv_cache.element_size()
        log.info("rank %d KV cache: %s x %s = %s, %s of %s", self.rank, count(num_blocks, "block"),
                 count(self.block_size, "token"), count(num_blocks * self.block_size, "token"), format_bytes(size),
                 self.kv_cache_dtype)

    # ------------------------------------------------------------------ CUDA graphs
    def graph_batch_sizes(self) -> list[int]:
        cfg = self.config
        sizes = cfg.cuda_graph_sizes or (1, 2, 4, 8, *range(16, cfg.max_num_seqs + 1, 16))
        return sorted({s for s in sizes if s <= cfg.max_num_seqs} | ({cfg.max_num_seqs} if not cfg.cuda_graph_sizes
                                                                      else set()))

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture one decode graph per batch size, largest first, sharing one memory pool: the forward (from the
        token ids, gathered on the device, to the last hidden states), and where sampling can run in a graph
        (TP 1, the fused sampler, unless DELTASERVE_EAGER_SAMPLING) a second one: LM head, sampler, and the
        tokens into `last_sampled`. Inputs: `workers/graph_inputs.py`.

        Padding rows of a replay get slot -1 (no KV write) and sequence length 0 (no KV read),
        so they can neither write into nor read from real requests' blocks.
        """
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.supports_cuda_graphs:
            return
        t0 = time.perf_counter()
        sizes = self.graph_batch_sizes()
        max_bs, dev = max(sizes), self.device
        self.make_graph_inputs(max_bs)
        sample = self.sampler.fused and tp_size() == 1 and not envs.eager_sampling()
        pool = None
        for bs in reversed(sizes):
            self._graph_forward(bs)  # warm-up (kernel compilation)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._graph_forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
            if sample:
                self._sample_in_graph(out, bs)  # warm-up
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._sample_in_graph(out, bs)
                self.sample_graphs[bs] = graph
        self.last_sampled.zero_()  # the warm-ups wrote the scratch entry and row 0
        torch.cuda.synchronize(dev)
        log.info("rank %d captured %d CUDA graphs (batch %d..%d%s) in %.1f s", self.rank, len(sizes), min(sizes),
                 max_bs, ", sampling in graphs" if sample else "", time.perf_counter() - t0)

    def make_graph_inputs(self, max_bs: int) -> None:
        """The static inputs of the decode graphs up to batch `max_bs` (`GraphInputs`), as `graph_inputs`."""
        io = self.graph_io = GraphInputs(max_bs, self.max_blocks_per_seq, self.config.max_num_seqs, self.device)
        self.graph_inputs = {**io.views, "block_tables": io.block_tables, "query_start_loc": io.query_start_loc,
                             "tokens": io.tokens}

    def _graph_forward(self, bs: int) -> torch.Tensor:
        """What a forward graph runs: the step's token ids from the graph inputs (`decode_input_ids`), then the
        model. Returns the last hidden states `[bs, hidden]`."""
        g = self.graph_inputs
        ids = decode_input_ids(g["input_ids"][:bs], g["src_rows"][:bs], self.last_sampled)
        return self.model(ids, g["positions"][:bs], self._graph_metadata(bs))

    def _sample_in_graph(self, hidden: torch.Tensor, bs: int) -> None:
        """What a sampling graph runs: the LM head on `hidden` `[bs, hidden]`, the fused sampler with the graph
        inputs' temperatures and seeds (temperature 0: argmax), the tokens into `last_sampled` (padding rows into
        its scratch entry) and into `graph_inputs["tokens"]`."""
        from gpu_kernels.sampling import sample_candidates

        g = self.graph_inputs
        logits = self.model.compute_logits(hidden)
        _, tokens = sample_candidates(logits, g["temperatures"][:bs], g["seeds"][:bs])
        self.last_sampled.index_copy_(0, g["sampling_rows"][:bs], tokens)
        g["tokens"][:bs].copy_(tokens)

    @torch.no_grad()
    def compile_sampling(self) -> None:
        """Compile the LM head's batch-1 GEMV and the fused sampler for every batch size now, on CUDA, so that
        no new batch size compiles a kernel mid-run (each held a step 0.4-0.7 s). Draws no seeds."""
        if self.device.type != "cuda":
            return
        hidden = torch.zeros(1, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        self.sampler.compile_kernels(self.config.max_num_seqs, logits.shape[1], logits.dtype)
        torch.cuda.synchronize(self.device)

    def _graph_metadata(self, bs: int) -> AttentionMetadata:
        g = self.graph_inputs
        return AttentionMetadata(
            slot_mapping=g["slot_mapping"][:bs], query_start_loc=g["query_start_loc"][: bs + 1],
            seq_lens=g["seq_lens"][:bs], block_tables=g["block_tables"][:bs], max_query_len=1,
            max_seq_len=self.config.max_model_len, is_decode=True)

    def _graph_size_for(self, inputs: StepInputs) -> int | None:
        if not self.graphs or not inputs.is_decode:
            return None
        b = len(inputs.rows)
        return next((s for s in sorted(self.graphs) if s >= b), None)

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
        penalties = self.processor.penalties
        penalties.reset_rows(self.batch.admitted_penalized)
        forks = self.batch.forks
        penalties.copy_rows([p.row for f, p in forks if f.penalized], [f.row for f, _ in forks if f.penalized])
        inputs = self.batch.prepare(scheduled)
        t1 = time.perf_counter()
        host = self.host[self.step_parity]
        self.step_parity ^= 1
        if host.copied is not None:
            host.copied.synchronize()  # its previous copies (two steps ago) have run
        graph_bs = self._graph_size_for(inputs)
        ended = None
        self.phases.begin("upload", plan.step_id)
        sample_graph = None  # a decode step whose rows need only temperature sampling samples in a graph too
        if graph_bs is not None and inputs.processing is None and inputs.prompt_logprobs is None:
            sample_graph = self.sample_graphs.get(graph_bs)
        if graph_bs is not None:
            seeds = self.sampler.draw_seeds(len(inputs.rows), inputs.temperatures, inputs.seeded_rows) \
                if sample_graph is not None else None
            started, dev_idx = self._upload_graph_step(inputs, graph_bs, seeds)
        else:
            started, (input_ids, positions, meta, dev_idx) = self._upload(inputs, host)
        self.phases.begin("forward" if graph_bs is None else "graph replay", plan.step_id)
        if graph_bs is not None:
            graph, out = self.graphs[graph_bs]
            graph.replay()
            hidden = out[: len(inputs.rows)]
        else:
            hidden = self.model(input_ids, positions, meta)
        if inputs.forks:
            self._copy_fork_blocks(inputs.forks)
        self.phases.begin("sample", plan.step_id)
        if sample_graph is not None:
            sample_graph.replay()
            tokens_host, event = self._tokens_to_host(host, self.graph_inputs["tokens"][: len(inputs.rows)])
            logprobs_host = prompt_logprobs_host = None
        else:
            tokens_host, event, logprobs_host, prompt_logprobs_host = self._sample(inputs, host, hidden, dev_idx)
        if started is not None:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
        self.phases.end()
        t2 = time.perf_counter()
        timings = {"t_start": t0, "prepare_ms": (t1 - t0) * 1e3, "launch_ms": (t2 - t1) * 1e3,
                   "tokens": len(inputs.positions), "rows": len(inputs.rows), "decode": inputs.is_decode,
                   "graph": graph_bs or 0, **self._grammar_timings}
        self._grammar_timings = {}
        step = PendingStep(plan.step_id, inputs.sampling_states, tokens_host, event, timings, started, ended,
                           self._last_step_end, logprobs_host, prompt_logprobs_host)
        self._last_step_end = ended
        self._last_launched = step
        return step

    def _upload_graph_step(self, inputs: StepInputs, graph_bs: int, seeds: np.ndarray | None
                           ) -> tuple[torch.cuda.Event | None, dict[str, torch.Tensor]]:
        """Copy a decode step's inputs into the graphs' static buffer (`GraphInputs`: one copy, and one on the
        device for the block table). Returns the step's start event and the index inputs' device views."""
        io = self.graph_io
        assert io is not None
        b = len(inputs.rows)
        staging, nbytes, width = io.fill(inputs, self.batch.block_table, graph_bs, seeds)
        started = None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        io.upload(staging, nbytes, b, width)
        g = self.graph_inputs
        return started, {name: g[name][:b] for name in ("logits_indices", "sampling_rows", "temperatures")}

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
        arrays = {name: getattr(inputs, name) for name, _ in _UPLOADS if name != "block_tables"}
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
        dev_idx = {name: on_dev[name] for name in _INDEX_INPUTS}
        if host.copied is not None:
            host.copied.record()
        if len(inputs.gpu_token_index):
            input_ids[dev_idx["gpu_token_index"]] = self.last_sampled[dev_idx["gpu_token_rows"]]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=seq_lens, block_tables=block_tables,
            max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len, is_decode=inputs.is_decode,
            query_start_loc_cpu=inputs.query_start_loc, seq_lens_cpu=inputs.seq_lens)
        return started, (input_ids, positions, meta, dev_idx)

    def _copy_fork_blocks(self, forks: list[tuple[ReqState, ReqState]]) -> None:
        """Copy-on-write of n > 1: each fork's copy of its parent's last, partial prompt block gets that
        block's KV (all layers), which the forward just wrote. Full prompt blocks are shared, not copied."""
        bs = self.block_size
        src, dst = [], []
        table = self.batch.block_table
        for fork, parent in forks:
            n = parent.num_prompt_tokens
            if n % bs:
                src.append(int(table[parent.row, n // bs]))
                dst.append(int(table[fork.row, n // bs]))
        if src and self.kv_cache is not None:
            s, d = to_device(np.array(src, np.int64), self.device), to_device(np.array(dst, np.int64), self.device)
            self.kv_cache[:, :, d] = self.kv_cache[:, :, s]

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying `t` to the host (pinned memory on CUDA: read it after the step's event)."""
        if self.device.type != "cuda":
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def _sample(self, inputs: StepInputs, host: HostBuffers, hidden: torch.Tensor, dev_idx: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor | None, torch.cuda.Event | None, LogprobsOnHost | None, LogprobsOnHost | None]:
        """Sample the step's rows (processing those that need it); start copying tokens, logprobs and prompt
        logprobs to the host. Returns them and the event that marks their arrival (None on CPU)."""
        prompt_lp = self._prompt_logprobs(inputs, hidden) if inputs.prompt_logprobs is not None else None
        s = len(inputs.sampling_rows)
        out = event = lp_host = None
        if s:
            logits = self.model.compute_logits(hidden[dev_idx["logits_indices"]])
            all_greedy = not bool((inputs.temperatures > 0).any())
            processed = d = None
            if inputs.processing is not None:
                d = self.processor.upload(inputs.processing)
                if inputs.processing.grammars:
                    d.bitmask = self._grammar_bitmask(inputs.processing.grammars)
                rows = logits if inputs.processing.all_rows else logits[d.i["rows"]]
                x = gather_vocabulary(rows, self.processor.vocab_size, self.model.lm_head.rows_per_rank)
                x = self.processor.apply(x, d, self.last_sampled)
                processed = ProcessedRows(d.i["rows"], inputs.processing.rows, x, d.f["sample_temperatures"],
                                          inputs.processing.all_rows)
            tokens = self.sampler(logits, dev_idx["temperatures"], all_greedy, inputs.seeded_rows, processed)
            if d is not None:
                assert processed is not None
                self.processor.record_sampled(d, tokens)
                # Only rank 0 reports to the scheduler; the others keep the counts but skip the logprobs.
                lp = self.processor.logprobs(processed.logits, d, tokens) if self.rank == 0 else None
                if lp is not None:
                    h = d.host
                    lp_host = LogprobsOnHost(h.rows[h.logprob_rows].astype(np.int32),
                                             np.ones(len(h.logprob_rows), np.int32), h.logprob_counts,
                                             *(self._to_host(t) for t in lp))
            self.last_sampled.index_copy_(0, dev_idx["sampling_rows"], tokens)
            # Its event comes after the copies of the logprobs and prompt logprobs, launched before it.
            out, event = self._tokens_to_host(host, tokens)
        elif prompt_lp is not None and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return out, event, lp_host, prompt_lp

    def _tokens_to_host(self, host: HostBuffers, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying a step's sampled tokens `[s]` int64 into `host.sampled`; returns it and the event that
        marks their arrival (None on CPU, where the copy is done)."""
        out = host.sampled[: len(tokens)]
        if self.device.type != "cuda":
            out.copy_(tokens)
            return out, None
        out.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return out, event

    def _grammar_bitmask(self, grammars: list) -> torch.Tensor:
        """The bitmask of a step's constrained rows on the device. First the previous step's tokens are
        received (the forward of this step already runs on the device), so that every matcher stands at its
        request's last token."""
        t0 = time.perf_counter()
        if self._last_launched is not None:
            self.receive(self._last_launched)
        t1 = time.perf_counter()
        bitmask = self.structured.fill_bitmask(grammars)
        t2 = time.perf_counter()
        self._grammar_timings = {"grammar_wait_ms": (t1 - t0) * 1e3, "grammar_mask_ms": (t2 - t1) * 1e3,
                                 "grammar_rows": len(grammars)}
        return bitmask.to(self.device, non_blocking=True) if self.device.type == "cuda" else bitmask

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> LogprobsOnHost:
        """Raw logprobs (no sampling parameter applied) of the prompt tokens this step's forward predicts,
        with their top-N; the LM head runs on `PROMPT_LOGPROBS_CHUNK` positions at a time."""
        pl = inputs.prompt_logprobs
        assert pl is not None
        dev = self.device
        index = to_device(pl.hidden_index, dev)
        targets = to_device(pl.target_ids, dev)
        num_top = max(pl.num_top)
        parts = []
        for a in range(0, len(pl.hidden_index), PROMPT_LOGPROBS_CHUNK):
            rows = self.model.compute_logits(hidden[index[a: a + PROMPT_LOGPROBS_CHUNK]])
            whole = gather_vocabulary(rows, self.processor.vocab_size, self.model.lm_head.rows_per_rank)
            parts.append(token_logprobs(whole, targets[a: a + PROMPT_LOGPROBS_CHUNK], num_top))
        lp, rank, top_lp, top_ids = (torch.cat(t) for t in zip(*parts))
        return LogprobsOnHost(np.asarray(pl.seq_ids, np.int32), np.asarray(pl.counts, np.int32),
                              np.asarray(pl.num_top, np.int64), self._to_host(lp), self._to_host(rank),
                              self._to_host(top_lp), self._to_host(top_ids))

    def receive(self, step: PendingStep) -> np.ndarray:
        """Wait for a step's sampled tokens, record them in the batch and advance the constrained requests'
        matchers by them (their refusals go to `step.failed`); return them (int32, row order). Once per step:
        a later call returns the same tokens."""
        if step.tokens is None:
            if step.event is not None:
                step.event.synchronize()
            step.tokens = (np.zeros(0, dtype=np.int32) if step.tokens_host is None
                           else step.tokens_host.numpy().astype(np.int32))
            constrained = InputBatch.append_sampled(step.states, step.tokens)
            if constrained:
                errors = self.structured.accept([st.grammar for st, _ in constrained], [t for _, t in constrained])
                step.failed = {constrained[i][0].seq_id: why for i, why in errors.items()}
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
        if self._last_launched is step:
            self._last_launched = None
        return tokens
