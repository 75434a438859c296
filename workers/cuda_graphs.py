"""The decode CUDA graphs: which batch sizes are captured, their capture, and a step's inputs for a replay.

A decode step of b rows replays the forward graph of the smallest captured batch size of at least b, after one
copy of its inputs into the graphs' static buffer (workers/graph_inputs.py: its layout, and why padding rows can
touch no real request's KV). Where sampling can run in a graph (TP 1, the fused sampler, unless
DELTASERVE_EAGER_SAMPLING), a second graph of that size runs the LM head and the sampler. A step whose rows need
logits processing replays a third graph instead, the LM head and the fused processed-row sampler over static
per-row parameters (workers/sampling_graphs.py; DELTASERVE_PROCESSED_SAMPLER=fused); a step with prompt logprobs,
or with more sparse entries than that graph holds, replays only the forward graph and samples eagerly
(workers/sampling_step.py). Batches larger than the largest graph, and every step with a prefill, run eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from common import envs
from common.config import EngineConfig
from gpu_kernels.processed_sampling import ProcessedSample, processed_sample
from gpu_kernels.sampling_inputs import I_STATE_ROW, ProcessedParams, SparseEntries
from workers.attention.base import AttentionMetadata
from workers.fused_sampling import FusedSampling
from workers.graph_inputs import GraphInputs, decode_input_ids
from workers.input_batch import StepInputs
from workers.parallel import tp_size
from workers.sampling_graphs import GRAPH_NUM_TOP, HostMirror, ProcessedGraphInputs

log = logging.getLogger("deltaserve.worker")


@dataclass
class ProcessedReplay:
    """A decode step's processed-sampling graph, its outputs (`[graph_bs]` rows) and its filled inputs."""

    graph: torch.cuda.CUDAGraph
    out: ProcessedSample
    io: ProcessedGraphInputs
    mirror: HostMirror  # what `ProcessedGraphInputs.fill` wrote, uploaded with the step's inputs

class CUDAGraphRunner:
    """The decode graphs of one worker and their static inputs.

    `graphs`: batch size -> (forward graph, its output: the last hidden states `[bs, hidden]`);
    `sample_graphs`: batch size -> the LM head and sampler graph; `processed_graphs`: batch size -> (the LM head
    and processed-row sampler graph, its outputs), over `processed_io`; `graph_inputs`: the static inputs by name
    (`GraphInputs.views`, `block_tables`, `query_start_loc`, `tokens`), made by `make_graph_inputs`.
    `last_sampled`: the runner's `[max_num_seqs + 1]` int64 device tensor of each batch row's latest token (and
    the padding rows' scratch entry), which the forward graphs read and the sampling graphs write.
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module, last_sampled: torch.Tensor,
                 device: torch.device, rank: int) -> None:
        self.config = config
        self.model = model
        self.last_sampled = last_sampled
        self.device = device
        self.rank = rank
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> (forward, hidden)
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> LM head + sampler
        self.processed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, ProcessedSample]] = {}
        self.processed_io: ProcessedGraphInputs | None = None
        self.fused: FusedSampling | None = None
        self.graph_io: GraphInputs | None = None
        self.graph_inputs: dict[str, torch.Tensor] = {}

    def batch_sizes(self) -> list[int]:
        """The batch sizes captured, ascending: `cuda_graph_sizes`, or 1, 2, 4, 8, the multiples of 16 and
        `max_num_seqs`; none above `max_num_seqs`."""
        cfg = self.config
        sizes = cfg.cuda_graph_sizes or (1, 2, 4, 8, *range(16, cfg.max_num_seqs + 1, 16))
        return sorted({s for s in sizes if s <= cfg.max_num_seqs} | ({cfg.max_num_seqs} if not cfg.cuda_graph_sizes
                                                                      else set()))

    @torch.inference_mode()
    def capture(self, fused_sampler: bool, processed: FusedSampling | None = None) -> None:
        """Capture one decode graph per batch size, largest first, sharing one memory pool: the forward (from the
        token ids, gathered on the device, to the last hidden states), and where sampling can run in a graph
        (TP 1, `fused_sampler`, unless DELTASERVE_EAGER_SAMPLING) a second one: LM head, sampler, and the
        tokens into `last_sampled`; with `processed` (the worker's fused processed-row sampler) a third one, the
        same with every row's processing. Inputs: `workers/graph_inputs.py`, `workers/sampling_graphs.py`. CUDA
        only.

        Padding rows of a replay get slot -1 (no KV write) and sequence length 0 (no KV read),
        so they can neither write into nor read from real requests' blocks.
        """
        t0 = time.perf_counter()
        sizes = self.batch_sizes()
        max_bs, dev = max(sizes), self.device
        self.make_graph_inputs(max_bs)
        sample = fused_sampler and tp_size() == 1 and not envs.eager_sampling()
        if sample and processed is not None:
            self.fused = processed
            self.processed_io = ProcessedGraphInputs(max_bs, processed.vocab_size, dev)
        pool = None
        for bs in reversed(sizes):
            self.forward(bs)  # warm-up (kernel compilation)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
            if sample:
                self.sample(out, bs)  # warm-up
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.sample(out, bs)
                self.sample_graphs[bs] = graph
            if self.processed_io is not None:
                self.sample_processed(out, bs)  # warm-up: allocates the workspace's buffers for bs rows
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    result = self.sample_processed(out, bs)
                self.processed_graphs[bs] = (graph, result)
        self.last_sampled.zero_()  # the warm-ups wrote the scratch entry and row 0
        torch.cuda.synchronize(dev)
        log.info("rank %d captured %d CUDA graphs (batch %d..%d%s) in %.1f s", self.rank, len(sizes), min(sizes),
                 max_bs, (", sampling in graphs" + (" (processed rows too)" if self.processed_graphs else ""))
                 if sample else "", time.perf_counter() - t0)

    def make_graph_inputs(self, max_bs: int) -> None:
        """The static inputs of the decode graphs up to batch `max_bs` (`GraphInputs`), as `graph_inputs`."""
        io = self.graph_io = GraphInputs(max_bs, self.config.max_blocks_per_seq, self.config.max_num_seqs, self.device)
        self.graph_inputs = {**io.views, "block_tables": io.block_tables, "query_start_loc": io.query_start_loc,
                             "tokens": io.tokens}

    def forward(self, bs: int) -> torch.Tensor:
        """What a forward graph runs: the step's token ids from the graph inputs (`decode_input_ids`), then the
        model. Returns the last hidden states `[bs, hidden]`."""
        g = self.graph_inputs
        ids = decode_input_ids(g["input_ids"][:bs], g["src_rows"][:bs], self.last_sampled)
        return self.model(ids, g["positions"][:bs], self.metadata(bs))

    def sample(self, hidden: torch.Tensor, bs: int) -> None:
        """What a sampling graph runs: the LM head on `hidden` `[bs, hidden]`, the fused sampler with the graph
        inputs' temperatures and seeds (temperature 0: argmax), the tokens into `last_sampled` (padding rows into
        its scratch entry) and into `graph_inputs["tokens"]`."""
        from gpu_kernels.sampling import sample_candidates

        g = self.graph_inputs
        logits = self.model.compute_logits(hidden)
        _, tokens = sample_candidates(logits, g["temperatures"][:bs], g["seeds"][:bs])
        self.last_sampled.index_copy_(0, g["sampling_rows"][:bs], tokens)
        g["tokens"][:bs].copy_(tokens)

    def sample_processed(self, hidden: torch.Tensor, bs: int) -> ProcessedSample:
        """What a processed-sampling graph runs: the LM head on `hidden` `[bs, hidden]`, `processed_sample` over
        the static parameters, sparse entries and bitmask of `processed_io` with the graph inputs' seeds, the
        penalty state's update, and the tokens into `last_sampled` and `graph_inputs["tokens"]`. Returns the
        sampler's outputs (`GRAPH_NUM_TOP` top logprobs a row)."""
        io, fused, g = self.processed_io, self.fused, self.graph_inputs
        assert io is not None and fused is not None
        logits = self.model.compute_logits(hidden)
        params = ProcessedParams(io.params.floats[:bs], io.params.ints[:bs])
        sparse = SparseEntries(io.sparse.offsets[: bs + 1], io.sparse.tokens, io.sparse.bias, io.sparse.ban_after,
                               io.sparse.scratch_rows)
        out = processed_sample(logits, params, g["seeds"][:bs], workspace=fused.workspace, penalties=fused.penalties,
                               bitmask=io.bitmask, sparse=sparse, last_sampled=self.last_sampled,
                               num_top=GRAPH_NUM_TOP, chunk_size=fused.chunk_size)
        fused.penalties.record(params.ints[:, I_STATE_ROW], out.tokens)
        self.last_sampled.index_copy_(0, g["sampling_rows"][:bs], out.tokens)
        g["tokens"][:bs].copy_(out.tokens)
        return out

    def processed_for(self, inputs: StepInputs, graph_bs: int) -> ProcessedReplay | None:
        """The processed-sampling graph of a decode step with processed rows, its inputs written to a pinned
        mirror (uploaded by `upload`); None when there is none of size `graph_bs` or the step's sparse entries do
        not fit it (it samples eagerly)."""
        if self.processed_io is None or graph_bs not in self.processed_graphs or inputs.processing is None:
            return None
        mirror = self.processed_io.fill(inputs.processing, inputs.temperatures, graph_bs)
        if mirror is None:
            return None
        graph, out = self.processed_graphs[graph_bs]
        return ProcessedReplay(graph, out, self.processed_io, mirror)

    def metadata(self, bs: int) -> AttentionMetadata:
        """The attention metadata of a decode graph of batch `bs`: views of the graph inputs, one token a row."""
        g = self.graph_inputs
        return AttentionMetadata(
            slot_mapping=g["slot_mapping"][:bs], query_start_loc=g["query_start_loc"][: bs + 1],
            seq_lens=g["seq_lens"][:bs], block_tables=g["block_tables"][:bs], max_query_len=1,
            max_seq_len=self.config.max_model_len, is_decode=True)

    def size_for(self, inputs: StepInputs) -> int | None:
        """The batch size of the graph a step replays: the smallest captured one that holds its rows; None for a
        step with a prefill, a batch larger than every graph, or no graphs."""
        if not self.graphs or not inputs.is_decode:
            return None
        b = len(inputs.rows)
        return next((s for s in sorted(self.graphs) if s >= b), None)

    def upload(self, inputs: StepInputs, block_table: np.ndarray, graph_bs: int, seeds: np.ndarray | None,
               processed: ProcessedReplay | None = None) -> tuple[torch.cuda.Event | None, dict[str, torch.Tensor]]:
        """Copy a decode step's inputs into the graphs' static buffer (`GraphInputs`: one copy, and one on the
        device for the block table), and `processed`'s filled mirror into its inputs. `block_table`: the batch's
        `[max_num_seqs, max_blocks]` int32 table; `seeds`: `[b]` int64 noise seeds of a step that samples in a
        graph, else None. Returns the step's start event (CUDA) and the index inputs' device views."""
        io = self.graph_io
        assert io is not None
        b = len(inputs.rows)
        staging, nbytes, width = io.fill(inputs, block_table, graph_bs, seeds)
        started = None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        io.upload(staging, nbytes, b, width)
        if processed is not None:
            processed.io.upload(processed.mirror)
        g = self.graph_inputs
        return started, {name: g[name][:b] for name in ("logits_indices", "sampling_rows", "temperatures")}
