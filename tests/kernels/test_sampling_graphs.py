"""The processed-sampling graph's static inputs (workers/sampling_graphs.py): a step written into them and read by
`processed_sample` over a padded batch gives, for its real rows, exactly what the eager call over the step's own
inputs gives (tokens, logprobs, ranks, top logprobs), and the padding rows touch no penalty state. On a GPU the
same call is captured in a CUDA graph and replayed for two different steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from common.protocol import SamplingOptions  # noqa: E402
from gpu_kernels.processed_sampling import ProcessedSamplingWorkspace, processed_sample  # noqa: E402
from gpu_kernels.sampling_inputs import (  # noqa: E402
    I_STATE_ROW,
    PenaltyBits,
    ProcessedParams,
    SparseEntries,
    from_processing,  # noqa: E402
)
from workers.input_batch import ReqState  # noqa: E402
from workers.logits_processing import build_processing  # noqa: E402
from workers.sampling_graphs import ProcessedGraphInputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 300
NUM_TOP = 4
SMALL = {"tile_size": 64, "threshold_capacity": 128, "top_capacity": 64}


def _step(seed: int) -> tuple[list[ReqState], np.ndarray]:
    """Five sampling rows: plain, penalties + bias + logprobs, bad words + min_tokens, filters + logprobs, greedy
    with a repetition penalty."""
    rng = np.random.default_rng(seed)
    options = [None, SamplingOptions(repetition_penalty=1.5, frequency_penalty=0.3, logit_bias={4: 3.0}, logprobs=2),
               SamplingOptions(bad_words=[[9], [10, 11]], min_tokens=30, stop_token_ids=[2]),
               SamplingOptions(top_k=20, top_p=0.8, min_p=0.02, logprobs=4), SamplingOptions(repetition_penalty=2.0)]
    temps = np.array([0.9, 0.7, 1.0, 0.6, 0.0], np.float32)
    states = []
    for i, o in enumerate(options):
        st = ReqState(i, float(temps[i]), None, o)
        st.row, st.num_prompt_tokens = i, 5
        st.tokens = rng.integers(0, VOCAB, 12).astype(np.int32)
        st.tokens[11] = 10
        st.num_tokens = st.num_tokens_cpu = 12
        states.append(st)
    return states, temps


def _bits(states: list[ReqState]) -> PenaltyBits:
    bits = PenaltyBits(DEVICE, 8, VOCAB)
    bits.reset_rows([st for st in states if st.penalized])
    return bits


def _graph_call(io: ProcessedGraphInputs, logits: torch.Tensor, seeds: torch.Tensor, ws: ProcessedSamplingWorkspace,
                bits: PenaltyBits, last: torch.Tensor):
    bs = logits.shape[0]
    params = ProcessedParams(io.params.floats[:bs], io.params.ints[:bs])
    sparse = SparseEntries(io.sparse.offsets[: bs + 1], io.sparse.tokens, io.sparse.bias, io.sparse.ban_after,
                           io.sparse.scratch_rows)
    out = processed_sample(logits, params, seeds, workspace=ws, penalties=bits, bitmask=io.bitmask, sparse=sparse,
                           last_sampled=last, num_top=NUM_TOP, chunk_size=128)
    bits.record(params.ints[:, I_STATE_ROW], out.tokens)
    return out


def _eager(states: list[ReqState], temps: np.ndarray, logits: torch.Tensor, seeds: torch.Tensor, last: torch.Tensor):
    h = build_processing(states, temps, VOCAB)
    params, sparse = from_processing(h, temps, VOCAB, DEVICE)
    bits = _bits(states)
    ws = ProcessedSamplingWorkspace(DEVICE, VOCAB, max_scratch_rows=8, **SMALL)
    out = processed_sample(logits, params, seeds, workspace=ws, penalties=bits, sparse=sparse, last_sampled=last,
                           num_top=NUM_TOP, chunk_size=128)
    bits.record(params.ints[:, I_STATE_ROW], out.tokens)
    return h, out, bits


def _assert_same_rows(graph_out, eager_out, b: int) -> None:
    assert torch.equal(graph_out.tokens[:b].cpu(), eager_out.tokens.cpu())
    assert torch.equal(graph_out.ranks[:b].cpu(), eager_out.ranks.cpu())
    torch.testing.assert_close(graph_out.logprobs[:b].cpu(), eager_out.logprobs.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(graph_out.top_logprobs[:b].cpu(), eager_out.top_logprobs.cpu(), rtol=0, atol=0)
    assert torch.equal(graph_out.top_ids[:b].cpu(), eager_out.top_ids.cpu())


def test_a_padded_step_from_the_static_inputs_matches_the_eager_call() -> None:
    states, temps = _step(5)
    b, graph_bs = len(states), 8
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(graph_bs, VOCAB, generator=g) * 2.5).to(torch.bfloat16).to(DEVICE)
    seeds = torch.arange(graph_bs, dtype=torch.int64, device=DEVICE) + 77
    last = torch.full((9,), 10, dtype=torch.int64, device=DEVICE)
    h, eager_out, eager_bits = _eager(states, temps, logits[:b], seeds[:b], last)

    io = ProcessedGraphInputs(16, VOCAB, torch.device(DEVICE), max_entries=64)
    mirror = io.fill(h, temps, graph_bs)
    assert mirror is not None
    io.upload(mirror)
    bits = _bits(states)
    ws = ProcessedSamplingWorkspace(DEVICE, VOCAB, max_scratch_rows=8, **SMALL)
    graph_out = _graph_call(io, logits, seeds, ws, bits, last)
    _assert_same_rows(graph_out, eager_out, b)
    for mine, theirs in zip(bits.tensors(), eager_bits.tensors()):
        assert torch.equal(mine.cpu(), theirs.cpu()), "padding rows must record no penalty state"
    assert not graph_out.logprobs[b:].cpu().any(), "padding rows ask for no logprobs"


def test_too_many_sparse_entries_leave_the_step_to_the_eager_path() -> None:
    states, temps = _step(1)
    states[1].options.logit_bias = {t: 1.0 for t in range(40)}
    h = build_processing(states, temps, VOCAB)
    io = ProcessedGraphInputs(8, VOCAB, torch.device(DEVICE), max_entries=32)
    assert io.fill(h, temps, 8) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: needs a CUDA GPU")
def test_one_captured_graph_replays_two_different_steps() -> None:
    graph_bs = 8
    io = ProcessedGraphInputs(graph_bs, VOCAB, torch.device("cuda"), max_entries=64)
    logits = torch.zeros(graph_bs, VOCAB, dtype=torch.bfloat16, device="cuda")
    seeds = torch.zeros(graph_bs, dtype=torch.int64, device="cuda")
    last = torch.full((9,), 10, dtype=torch.int64, device="cuda")
    ws = ProcessedSamplingWorkspace("cuda", VOCAB, max_scratch_rows=8, **SMALL)
    bits = PenaltyBits("cuda", 8, VOCAB)
    _graph_call(io, logits, seeds, ws, bits, last)  # warm-up: compiles, allocates the workspace's buffers
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = _graph_call(io, logits, seeds, ws, bits, last)
    for seed in (5, 6):
        states, temps = _step(seed)
        b = len(states)
        g = torch.Generator().manual_seed(seed)
        logits.copy_((torch.randn(graph_bs, VOCAB, generator=g) * 2.5).to(torch.bfloat16))
        seeds.copy_(torch.arange(graph_bs) + 1000 * seed)
        h, eager_out, eager_bits = _eager(states, temps, logits[:b], seeds[:b], last)
        bits.reset_rows([st for st in states if st.penalized])
        io.upload(io.fill(h, temps, graph_bs))
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_rows(graph_out, eager_out, b)
        for row in (1, 4):  # the penalized rows were recorded alike
            assert all(torch.equal(m[row], t[row]) for m, t in zip(bits.tensors(), eager_bits.tensors()))


def test_the_same_processed_rows_again_are_written_from_the_last_host_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """`InputBatch` hands a steady decode batch the same `ProcessingInputs` object each step: its host tables are
    computed once, and every mirror still gets them (the two mirrors alternate)."""
    import workers.sampling_graphs as sampling_graphs

    calls = []
    real = sampling_graphs.processing_host
    monkeypatch.setattr(sampling_graphs, "processing_host", lambda *a: calls.append(1) or real(*a))
    states, temps = _step(3)
    h = build_processing(states, temps, VOCAB)
    io = ProcessedGraphInputs(16, VOCAB, torch.device("cpu"), max_entries=64)
    first = {name: view.copy() for name, view in io.fill(h, temps, 8).views.items()}
    second = io.fill(h, temps, 8)
    assert len(calls) == 1
    for name, view in second.views.items():
        assert np.array_equal(view, first[name]), name
    io.fill(build_processing(states, temps, VOCAB), temps, 8)  # another step's rows: computed again
    io.fill(h, temps * 2, 8)
    assert len(calls) == 3
