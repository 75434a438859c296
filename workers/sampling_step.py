"""A step's sampling on the eager path: from the last hidden states to tokens, logprobs and prompt logprobs.

The LM head runs on each sampling row's last hidden state. Rows that use only temperature go from it straight to
the sampler (workers/sampler.py: the fused Triton kernel on CUDA). Rows whose requests set filters, penalties,
logit bias, logprobs or a grammar are gathered over the whole vocabulary and go through
workers/logits_processing.py first (`ProcessedRows`); on a GPU at TP 1 a step with processed rows samples all of its
rows in the fused sampler instead (workers/fused_sampling.py: no sort, no float32 copy, a fixed launch sequence).
A step with constrained rows (structured outputs) first receives the previous step's tokens, while its own forward
runs, so that every matcher stands at its request's last token, then fills and uploads their bitmask
(workers/structured_output.py).

The tokens, the logprobs of rows that asked, and the prompt logprobs of prefill chunks that asked (raw: no
sampling parameter applied) are copied to pinned host memory, all read after the tokens' event. A decode step of
plain rows at TP 1 samples in a CUDA graph instead (workers/cuda_graphs.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common import envs
from common.protocol import Logprobs, f32, i32
from gpu_kernels.sampling_inputs import PenaltyBits
from workers.cuda_graphs import ProcessedReplay
from workers.fused_sampling import FusedSampling
from workers.host_buffers import HostBuffers
from workers.input_batch import StepInputs
from workers.logits_processing import (
    PROMPT_LOGPROBS_CHUNK,
    LogitsProcessor,
    PenaltyState,
    gather_vocabulary,
    to_device,
    token_logprobs,
    worst_case_inputs,
)
from workers.parallel import tp_size
from workers.sampler import ProcessedRows, Sampler
from workers.structured_output import StructuredOutputManager, bitmask_width


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
    # [P] int64: positions of the reported rows in the four tensors above, when those hold more rows (a sampling
    # graph's outputs for its whole batch); None: the tensors hold exactly the P positions
    select: np.ndarray | None = None

    def to_wire(self) -> Logprobs:
        """The `Logprobs` struct; top entries of logprob -inf (tokens a filter removed) are left out."""
        tensors = (self.token_logprobs.numpy(), self.ranks.numpy(), self.top_logprobs.numpy(),
                   self.top_token_ids.numpy())
        if self.select is not None:
            tensors = tuple(t[self.select] for t in tensors)
        token_lp, ranks, top_lp, top_ids = tensors
        if len(self.counts) == len(token_lp) and (self.counts == 1).all():  # one position a row (sampled tokens)
            keep = (np.arange(top_lp.shape[1])[None, :] < self.num_top[:, None]) & np.isfinite(top_lp)
            return Logprobs(i32(self.rows), i32(self.counts), i32(keep.sum(axis=1)), f32(token_lp), i32(ranks),
                            i32(top_ids[keep]), f32(top_lp[keep]))
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
        return Logprobs(i32(rows), i32(counts), i32(num_top), f32(token_lp), i32(ranks), i32(top_ids[keep]),
                        f32(top_lp[keep]))


class SamplingStep:
    """The sampler and the logits processor of one worker, and how a step's rows reach them.

    `last_sampled`: the runner's `[max_num_seqs + 1]` int64 device tensor of each batch row's latest token, which
    `sample` updates. `receive_previous`: receives the tokens of the step launched before this one (a no-op when
    they are in); called before a step's grammar bitmask is filled. Only rank 0 copies logprobs to the host.
    """

    def __init__(self, model: torch.nn.Module, structured: StructuredOutputManager, last_sampled: torch.Tensor,
                 device: torch.device, rank: int, seed: int, max_num_seqs: int,
                 receive_previous: Callable[[], None]) -> None:
        head = model.lm_head
        self.sampler = Sampler(device, seed, head.vocab_size, head.vocab_start)
        self.processor = LogitsProcessor(device, max_num_seqs, head.vocab_size)
        # Processed rows on a GPU at TP 1: the fused sampler (workers/fused_sampling.py) instead of the processor.
        self.fused = FusedSampling(device, max_num_seqs, head.vocab_size) \
            if device.type == "cuda" and tp_size() == 1 and envs.processed_sampler() == "fused" else None
        self.model = model
        self.structured = structured
        self.last_sampled = last_sampled
        self.device = device
        self.rank = rank
        self.receive_previous = receive_previous
        self._grammar_timings: dict[str, float] = {}  # of the step being launched: its wait and mask times

    @property
    def penalties(self) -> PenaltyBits | PenaltyState:
        """The penalty state of the batch rows that the active path reads (`reset_rows`, `copy_rows`)."""
        return self.fused.penalties if self.fused is not None else self.processor.penalties

    def take_grammar_timings(self) -> dict[str, float]:
        """The grammar wait and mask times of the step just sampled (empty without constrained rows), once."""
        timings, self._grammar_timings = self._grammar_timings, {}
        return timings

    def sample(self, inputs: StepInputs, host: HostBuffers, hidden: torch.Tensor, dev_idx: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor | None, torch.cuda.Event | None, LogprobsOnHost | None, LogprobsOnHost | None]:
        """Sample the step's rows (processing those that need it); start copying tokens, logprobs and prompt
        logprobs to the host. `hidden`: `[T, hidden]` the forward's last hidden states; `dev_idx`: the step's
        index inputs on the device (`host_buffers.INDEX_INPUTS`). Returns them and the event that marks their
        arrival (None on CPU)."""
        prompt_lp = self._prompt_logprobs(inputs, hidden) if inputs.prompt_logprobs is not None else None
        s = len(inputs.sampling_rows)
        out = event = lp_host = None
        if s:
            logits = self.model.compute_logits(hidden[dev_idx["logits_indices"]])
            all_greedy = not bool((inputs.temperatures > 0).any())
            processed = d = None
            if inputs.processing is not None and self.fused is not None:
                tokens, lp_host = self._sample_fused(inputs, logits)
                self.last_sampled.index_copy_(0, dev_idx["sampling_rows"], tokens)
                out, event = host.tokens_to_host(tokens)
                return out, event, lp_host, prompt_lp
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
            out, event = host.tokens_to_host(tokens)
        elif prompt_lp is not None and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return out, event, lp_host, prompt_lp

    def sample_in_graph(self, inputs: StepInputs, host: HostBuffers, replay: ProcessedReplay
                        ) -> tuple[torch.Tensor, torch.cuda.Event | None, LogprobsOnHost | None]:
        """Sample a decode step with processed rows by replaying its processed-sampling graph (its inputs already
        uploaded: workers/cuda_graphs.py): first the grammar rows' bitmask, then the replay, then the copies of the
        logprobs (every row's, the asking rows picked on the host) and of the tokens. Returns the tokens on their
        way to the host, their event and the logprobs."""
        h = inputs.processing
        assert h is not None
        if h.grammars:
            replay.io.set_bitmask(self._grammar_bitmask(h.grammars))
        replay.graph.replay()
        b, out = len(inputs.sampling_rows), replay.out
        if not (len(h.logprob_rows) and self.rank == 0):
            tokens, event = host.tokens_to_host(out.tokens[:b])  # the graph's outputs cover its padded batch
            return tokens, event, None
        # Tokens and logprobs in one copy (the sampler's outputs share one buffer): at batch 1 each copy is a few
        # microseconds of the step.
        on_host = out.to_host()
        event = torch.cuda.Event()  # processed-sampling graphs exist on CUDA only
        event.record()
        asked = h.rows[h.logprob_rows]
        lp_host = LogprobsOnHost(asked.astype(np.int32), np.ones(len(asked), np.int32), h.logprob_counts,
                                 on_host.logprobs[:b], on_host.ranks[:b], on_host.top_logprobs[:b],
                                 on_host.top_ids[:b], select=asked)
        return on_host.tokens[:b], event, lp_host

    def _sample_fused(self, inputs: StepInputs, logits: torch.Tensor) -> tuple[torch.Tensor, LogprobsOnHost | None]:
        """Every sampling row of a step with processed rows, in the fused sampler; the tokens `[S]` int64 and the
        logprobs of the rows that asked, on their way to the host."""
        assert self.fused is not None and inputs.processing is not None
        h = inputs.processing
        bitmask = self._grammar_bitmask(h.grammars) if h.grammars else None
        seeds = self.sampler.draw_seeds(len(inputs.sampling_rows), inputs.temperatures, inputs.seeded_rows)
        tokens, lp = self.fused.sample(logits, inputs.temperatures, seeds, h, bitmask, self.last_sampled)
        if lp is None:
            return tokens, None
        return tokens, LogprobsOnHost(h.rows[h.logprob_rows].astype(np.int32), np.ones(len(h.logprob_rows), np.int32),
                                      h.logprob_counts, self._to_host(lp.token_logprobs), self._to_host(lp.ranks),
                                      self._to_host(lp.top_logprobs), self._to_host(lp.top_token_ids))

    def dummy_run(self, hidden: torch.Tensor) -> None:
        """The costliest sampling of a step of `n` rows, `hidden` `[n, hidden]`: the LM head and the sampler, then
        the costliest logits processing (a whole-row sort, penalties, 20 logprobs) of all `n` rows and of one.
        For the start-up memory measurement: so that the memory it takes is measured and the penalty counts exist
        before the KV cache is sized; and once for a single row, which torch.compile specializes (no compile
        stalls a first step later)."""
        n, dev = hidden.shape[0], self.device
        logits = self.model.compute_logits(hidden)
        self.sampler(logits, torch.ones(n, device=dev), all_greedy=False)
        if self.fused is not None:
            self.fused.dummy_run(logits)
            return
        for rows in sorted({n, 1}, reverse=True):
            d = self.processor.upload(worst_case_inputs(rows))
            d.bitmask = torch.full((rows, bitmask_width(self.processor.vocab_size)), -1, dtype=torch.int32, device=dev)
            x = self.processor.apply(gather_vocabulary(logits[:rows], self.processor.vocab_size,
                                                       self.model.lm_head.rows_per_rank), d, self.last_sampled)
            tokens = self.sampler(logits[:rows], torch.ones(rows, device=dev), False, processed=ProcessedRows(
                d.i["rows"], d.host.rows, x, d.f["sample_temperatures"], True))
            self.processor.logprobs(x, d, tokens)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying `t` to the host (pinned memory on CUDA: read it after the step's event)."""
        if self.device.type != "cuda":
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def _grammar_bitmask(self, grammars: list) -> torch.Tensor:
        """The bitmask of a step's constrained rows on the device. First the previous step's tokens are
        received (the forward of this step already runs on the device), so that every matcher stands at its
        request's last token, and that step's result is sent (`grammar_wait_ms` covers both)."""
        t0 = time.perf_counter()
        self.receive_previous()
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
