"""The worker's fused sampling step (workers/fused_sampling.py) over several steps, against the torch path it
replaces (workers/logits_processing.py + the plain sampler): the same greedy tokens under penalties, bias, bans and
a grammar, the penalty state carried from step to step on the device, plain rows untouched by processed neighbours,
and the logprobs of the rows that asked mapped back to their sampling rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from common.protocol import SamplingOptions  # noqa: E402
from gpu_kernels.sampling import sample_candidates  # noqa: E402
from workers.fused_sampling import FusedSampling  # noqa: E402
from workers.input_batch import ReqState  # noqa: E402
from workers.logits_processing import LogitsProcessor, build_processing, token_logprobs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 320
SMALL = {"tile_size": 64, "threshold_capacity": 128, "top_capacity": 64}


def _state(row: int, temperature: float, options: SamplingOptions | None, rng: np.random.Generator) -> ReqState:
    st = ReqState(row, temperature, None, options)
    st.row, st.num_prompt_tokens = row, 6
    st.tokens = np.zeros(64, np.int32)
    st.tokens[:8] = rng.integers(0, VOCAB, 8)
    st.num_tokens = st.num_tokens_cpu = 8
    return st


def _allowed_bitmask(rows: int, allowed: np.ndarray) -> torch.Tensor:
    """`[rows, ceil(VOCAB / 32)]` int32 with the bits of `allowed` (token ids) set in every row."""
    words = np.zeros(-(-VOCAB // 32), np.uint32)
    np.bitwise_or.at(words, allowed >> 5, np.uint32(1) << (allowed & 31).astype(np.uint32))
    return torch.from_numpy(np.tile(words.view(np.int32), (rows, 1))).to(DEVICE)


def test_three_greedy_steps_give_the_torch_paths_tokens_and_logprobs() -> None:
    """Greedy rows with every kind of processing (so both paths pick the argmax of the same processed logits),
    beside an unprocessed plain row at T=0.8, over three steps whose tokens feed the penalties of the next."""
    rng = np.random.default_rng(3)
    options = [SamplingOptions(repetition_penalty=2.0, logprobs=3),
               SamplingOptions(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={5: 4.0, 9: -2.0}),
               None,  # plain, T = 0.8
               SamplingOptions(bad_words=[[11], [12, 13]], min_tokens=4, stop_token_ids=[1, 2], logprobs=0),
               SamplingOptions(top_k=5, top_p=0.5, logprobs=2)]
    temps = np.array([0.0, 0.0, 0.8, 0.0, 0.0], np.float32)
    states = [_state(i, float(temps[i]), o, rng) for i, o in enumerate(options)]
    allowed = np.arange(0, VOCAB, 2)
    fused = FusedSampling(torch.device(DEVICE), len(states), VOCAB, **SMALL)
    torch_path = LogitsProcessor(torch.device("cpu"), len(states), VOCAB)
    penalized = [st for st in states if st.penalized]
    fused.penalties.reset_rows(penalized)
    torch_path.penalties.reset_rows(penalized)
    last = torch.zeros(len(states) + 1, dtype=torch.int64)
    for step in range(3):
        h = build_processing(states, temps, VOCAB)
        assert h is not None and h.rows.tolist() == [0, 1, 3, 4]
        h.grammar_rows = np.array([3])  # processed row 3 (batch row 4) keeps to even ids; no matcher is needed
        bitmask = _allowed_bitmask(1, allowed)
        g = torch.Generator().manual_seed(100 + step)
        logits = (torch.randn(len(states), VOCAB, generator=g) * 3).to(torch.bfloat16)
        seeds = np.arange(len(states), dtype=np.int64) + 1000 * step
        tokens, lp = fused.sample(logits.to(DEVICE), temps, seeds, h, bitmask, last.to(DEVICE))
        tokens = tokens.cpu()

        d = torch_path.upload(h)
        d.bitmask = bitmask.cpu()
        x = torch_path.apply(logits[h.rows].float(), d, last)
        want = x.argmax(dim=-1)
        assert tokens[h.rows].tolist() == want.tolist(), f"step {step}"
        plain = sample_candidates(logits[2:3].to(DEVICE), torch.tensor([0.8], device=DEVICE),
                                  torch.tensor([seeds[2]], device=DEVICE))[1]
        assert tokens[2].item() == plain.item(), "a plain row's token must not depend on its neighbours"
        assert int(tokens[4]) % 2 == 0, "the grammar row keeps to its bitmask"
        assert lp is not None
        asked = h.logprob_rows  # processed rows 0, 2, 3 -> sampling rows 0, 3, 4
        want_lp, want_rank, want_top, want_ids = token_logprobs(x[asked], tokens[h.rows[asked]], 3)
        torch.testing.assert_close(lp.token_logprobs.cpu(), want_lp, rtol=0, atol=1e-3)
        assert lp.ranks.cpu().tolist() == want_rank.tolist()
        for j, n in enumerate(h.logprob_counts):
            assert lp.top_token_ids[j, :n].cpu().tolist() == want_ids[j, :n].tolist()
            torch.testing.assert_close(lp.top_logprobs[j, :n].cpu(), want_top[j, :n], rtol=0, atol=1e-3)

        torch_path.record_sampled(d, tokens)
        for st, t in zip(states, tokens.tolist()):
            st.tokens[st.num_tokens] = t
            st.num_tokens += 1
            st.num_tokens_cpu += 1
        last[: len(states)] = tokens
    seen, output, counts = (t.cpu() for t in fused.penalties.tensors())
    assert torch.equal(counts[:2], torch_path.penalties.output_counts[:2].cpu()), "the same output counts"
    for row in (0, 1):
        seen_ids = [t for t in range(VOCAB) if (int(seen[row, t // 32]) >> (t % 32)) & 1]
        assert seen_ids == torch.nonzero(torch_path.penalties.seen[row]).flatten().tolist(), "the same seen tokens"
