"""A decode step's graph path on CPU: `ModelRunner.execute` with stand-ins for the CUDA graphs that run the
captured functions again at replay (the forward from the static inputs, then the LM head and the fused sampler
under the Triton interpreter). Greedy tokens must equal the eager path's, step after step, pipelined as the
worker runs them (so each step's ids come from the device, gathered by the graph from `last_sampled`), with a
batch padded up to the graph's size. tests/test_gpu.py checks the real graphs on a GPU."""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import EngineConfig
from common.protocol import NewRequest, SamplingOptions, StepPlan, i32
from tests.conftest import synthetic_prompt
from workers.model_runner import ModelRunner


class ReplayAgain:
    """Stands in for a captured CUDA graph: `replay()` calls the captured function again."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class CountingSampler:
    def __init__(self, sampler) -> None:
        self.sampler, self.calls = sampler, 0

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.sampler(*args, **kwargs)


def with_graph_stand_ins(runner: ModelRunner, sizes: list[int]) -> ModelRunner:
    graphs = runner.cuda_graphs
    graphs.make_graph_inputs(max(sizes))
    for bs in sizes:
        out = torch.zeros(bs, runner.hf_config.hidden_size, dtype=runner.dtype)
        graphs.graphs[bs] = (ReplayAgain(lambda bs=bs, out=out: out.copy_(graphs.forward(bs))), out)
        graphs.sample_graphs[bs] = ReplayAgain(lambda bs=bs, out=out: graphs.sample(out, bs))
    return runner


def make_runner(cfg: EngineConfig) -> ModelRunner:
    runner = ModelRunner(cfg, 0, "tcp://127.0.0.1:0")
    runner.allocate_kv_cache(12)
    return runner


def run(runner: ModelRunner, plans: list[StepPlan], graph_steps: list[int] | None = None) -> list[list[int]]:
    tokens, pending = [], None
    for plan in plans:  # step N+1 is launched before step N is finalized, as in the worker
        step = runner.execute(plan)
        if graph_steps is not None and step.timings["graph"]:
            graph_steps.append(plan.step_id)
        if pending is not None:
            tokens.append(runner.finalize(pending).tolist())
        pending = step
    tokens.append(runner.finalize(pending).tolist())
    return tokens


def test_the_graph_path_decodes_the_tokens_of_the_eager_path(tiny_qwen3: Path) -> None:
    cfg = EngineConfig(model=str(tiny_qwen3), device="cpu", dtype="float32", block_size=16, max_model_len=128,
                       max_num_seqs=8).resolve()
    prompts = [synthetic_prompt(n, seed=n) for n in (5, 17, 30)]
    plans = [StepPlan(0, new_requests=[NewRequest(i, i32(p), 0.0, None, i32(range(4 * i, 4 * i + 4)), 0, len(p))
                                       for i, p in enumerate(prompts)])]
    plans += [StepPlan(s, decode_seq_ids=i32(range(3))) for s in range(1, 7)]
    with torch.inference_mode():
        eager = run(make_runner(cfg), plans)
        runner = with_graph_stand_ins(make_runner(cfg), [4])
        runner.sampling.sampler = CountingSampler(runner.sampling.sampler)
        graph_steps: list[int] = []
        graphed = run(runner, plans, graph_steps)
    assert graph_steps == [1, 2, 3, 4, 5, 6]
    assert runner.sampling.sampler.calls == 1  # the prefill's: the rest in "graphs"
    assert graphed == eager
    # The padding row sampled into scratch.
    assert runner.cuda_graphs.graph_inputs["sampling_rows"][3] == cfg.max_num_seqs


def test_rows_with_logits_processing_sample_eagerly_after_the_forward_graph(tiny_qwen3: Path) -> None:
    """A step with a processed row (here a repetition penalty, and logprobs) replays only the forward graph and
    samples on the eager path, from the graph's hidden states and the static inputs' index views: the tokens
    and logprobs of a run without graphs."""
    cfg = EngineConfig(model=str(tiny_qwen3), device="cpu", dtype="float32", block_size=16, max_model_len=128,
                       max_num_seqs=8).resolve()
    prompts = [synthetic_prompt(n, seed=n) for n in (9, 21)]
    options = [SamplingOptions(repetition_penalty=1.3, logprobs=2), None]
    plans = [StepPlan(0, new_requests=[NewRequest(i, i32(p), 0.0, None, i32(range(4 * i, 4 * i + 4)), 0, len(p),
                                                  options[i]) for i, p in enumerate(prompts)])]
    plans += [StepPlan(s, decode_seq_ids=i32(range(2))) for s in range(1, 6)]
    with torch.inference_mode():
        eager_runner = make_runner(cfg)
        eager = run(eager_runner, plans)
        runner = with_graph_stand_ins(make_runner(cfg), [2])
        runner.sampling.sampler = CountingSampler(runner.sampling.sampler)
        graph_steps: list[int] = []
        graphed = run(runner, plans, graph_steps)
    assert graph_steps == [1, 2, 3, 4, 5] and runner.sampling.sampler.calls == 6  # every step sampled eagerly
    assert graphed == eager
