"""Micro-benchmark of the Triton paged-attention and sampling kernels on one GPU (Qwen3-0.6B shapes).

    python benchmarks/kernel_bench.py              # attention, then sampling
    python benchmarks/kernel_bench.py sampling     # only the sampler: batch 256 and 1, T=0.6, greedy, mixed
    python benchmarks/kernel_bench.py sweep [fp8]  # the decode kernel's launch configurations (fp8: that cache only)

Sampling rows time `gpu_kernels.sampling.sample_candidates` (both stages) on bf16 logits of the whole
151,936-entry vocabulary, as device time: the median of `triton.testing.do_bench_cudagraph`, which replays
the call in a CUDA graph (as the engine runs it), so host launch overhead is not counted. "greedy" is every
row at T=0 through the same kernel (no noise evaluated); "mixed" is half the rows at T=0; "torch argmax"
is the floor a greedy step pays in the engine (workers/sampler.py takes it when every row is greedy). The
GB/s column is logits bytes read over the time (about 4.25 TB/s is the H200's copy bandwidth).

Decode is memory bound: its figure of merit is KV-cache bytes read per second (TB/s), against
about 4.25 TB/s of copy bandwidth on an H200 and 2.9 TB/s measured for FlashAttention-4 decode at
batch 256, contexts 100..2000, page 256. Prefill is compute bound: TFLOP/s counts the
multiply-adds of q.k and p.v over causally visible pairs only (4 * head_dim FLOPs per pair and
query head). Times are medians of `triton.testing.do_bench`, which flushes the L2 cache between
runs. The error column is ||out - ref|| / ||ref|| against a float32 torch reference. The "fp8 KV" rows read
an e4m3 cache (1 byte an element, with scales) and are checked against the dequantized cache.
"""

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from triton.testing import do_bench

# The repository root must come before benchmarks/, where this file would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_kernels import choose_num_splits, paged_attention_decode, paged_attention_prefill  # noqa: E402
from gpu_kernels.sampling import choose_chunk_size, sample_candidates  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, NUM_Q_HEADS, HEAD_DIM]
    k_cache: torch.Tensor  # [num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    q_lens: list[int]
    seq_lens_host: list[int]
    k_scale: float = 1.0  # an fp8 cache's dequantization scales
    v_scale: float = 1.0


FP8_SCALE = 2.0**-5  # randn / 2^-5 spans e4m3's range without saturating


def make_batch(q_lens: list[int], seq_lens: list[int], block_size: int, fp8: bool = False) -> PagedBatch:
    """Random q and cache; each sequence gets its blocks from a shuffled pool, as after churn."""
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    if fp8:
        k_cache = (k_cache.float() / FP8_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / FP8_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn)
    pool = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    block_tables = torch.full((len(seq_lens), max(blocks_needed)), -1, device="cuda", dtype=torch.int32)
    start = 0
    for b, count in enumerate(blocks_needed):
        block_tables[b, :count] = pool[start:start + count]
        start += count
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    return PagedBatch(
        q=torch.randn(cu[-1], NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start_loc=torch.tensor(cu, device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, device="cuda", dtype=torch.int32),
        q_lens=q_lens,
        seq_lens_host=seq_lens,
        k_scale=FP8_SCALE if fp8 else 1.0,
        v_scale=FP8_SCALE if fp8 else 1.0,
    )


def reference(batch: PagedBatch) -> torch.Tensor:
    """Causal attention in float32, one sequence at a time, keys gathered through the block table."""
    block_size = batch.k_cache.shape[1]
    group = NUM_Q_HEADS // NUM_KV_HEADS
    outputs = []
    for b, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens_host, strict=True)):
        start = int(batch.query_start_loc[b])
        positions = torch.arange(seq_len, device="cuda")
        slots = batch.block_tables[b].long()[positions // block_size] * block_size + positions % block_size
        k = batch.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].float().repeat_interleave(group, dim=1)
        v = batch.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].float().repeat_interleave(group, dim=1)
        k, v = k * batch.k_scale, v * batch.v_scale
        q = batch.q[start:start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        q_pos = torch.arange(seq_len - q_len, seq_len, device="cuda")
        scores = scores.masked_fill(positions[None, :] > q_pos[:, None], float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outputs)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def kv_bytes(batch: PagedBatch) -> int:
    """Bytes of K and V the attention must read: every cached token of every sequence, once."""
    return sum(batch.seq_lens_host) * 2 * NUM_KV_HEADS * HEAD_DIM * batch.k_cache.element_size()


def causal_flops(batch: PagedBatch) -> int:
    pairs = sum(q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2
                for q_len, seq_len in zip(batch.q_lens, batch.seq_lens_host, strict=True))
    return 4 * HEAD_DIM * NUM_Q_HEADS * pairs


def bench_decode(name: str, seq_lens: list[int], block_size: int, splits: list[int | None], fp8: bool = False) -> None:
    batch = make_batch([1] * len(seq_lens), seq_lens, block_size, fp8)
    ref = reference(batch)
    auto = choose_num_splits(len(seq_lens), NUM_KV_HEADS, batch.block_tables.shape[1], block_size)
    for num_splits in splits:
        def run(num_splits: int | None = num_splits) -> torch.Tensor:
            return paged_attention_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                          batch.seq_lens, SCALE, num_splits=num_splits, k_scale=batch.k_scale,
                                          v_scale=batch.v_scale)

        error = relative_error(run(), ref)
        ms = do_bench(run, return_mode="median")
        label = f"auto={auto}" if num_splits is None else str(num_splits)
        print(f"{name:<34} {block_size:>5} {label:>7} {ms * 1e3:>9.1f} {kv_bytes(batch) / 1e9:>8.3f} "
              f"{kv_bytes(batch) / ms / 1e9:>8.2f} {'':>8} {error:>9.1e}")


def bench_prefill(name: str, q_lens: list[int], seq_lens: list[int], block_size: int, fp8: bool = False) -> None:
    batch = make_batch(q_lens, seq_lens, block_size, fp8)
    ref = reference(batch)

    def run() -> torch.Tensor:
        return paged_attention_prefill(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                       batch.query_start_loc, batch.seq_lens, max(q_lens), SCALE,
                                       k_scale=batch.k_scale, v_scale=batch.v_scale)

    error = relative_error(run(), ref)
    ms = do_bench(run, return_mode="median")
    print(f"{name:<34} {block_size:>5} {'-':>7} {ms * 1e3:>9.1f} {kv_bytes(batch) / 1e9:>8.3f} "
          f"{kv_bytes(batch) / ms / 1e9:>8.2f} {causal_flops(batch) / ms / 1e9:>8.1f} {error:>9.1e}")


VOCAB = 151936


def bench_sampling_batch(batch: int, num_sms: int) -> None:
    from triton.testing import do_bench_cudagraph

    logits = torch.randn(batch, VOCAB, device="cuda").to(DTYPE) * 3
    seeds = torch.randint(0, 2**62, (batch,), device="cuda")
    mixed = torch.full((batch,), 0.6, device="cuda")
    mixed[::2] = 0.0
    cases = {"T=0.6": torch.full((batch,), 0.6, device="cuda"),
             "greedy (kernel, T=0)": torch.zeros(batch, device="cuda"),
             "mixed (half T=0.6, half T=0)": mixed}
    gigabytes = logits.numel() * logits.element_size() / 1e9
    chunk = choose_chunk_size(batch, VOCAB, num_sms)
    for name, temps in cases.items():
        us = do_bench_cudagraph(lambda t=temps: sample_candidates(logits, t, seeds), return_mode="median") * 1e3
        print(f"{name:<34} {batch:>5} {chunk:>7} {us:>9.1f} {gigabytes / us * 1e6:>8.0f}")
    us = do_bench_cudagraph(lambda: logits.argmax(dim=-1), return_mode="median") * 1e3
    print(f"{'torch argmax (greedy floor)':<34} {batch:>5} {'-':>7} {us:>9.1f} {gigabytes / us * 1e6:>8.0f}")


def bench_sampling() -> None:
    print(f"{'sampling, vocab ' + str(VOCAB) + ', bf16':<34} {'batch':>5} {'chunk':>7} {'time us':>9} {'GB/s':>8}")
    for batch in (256, 1):
        bench_sampling_batch(batch, torch.cuda.get_device_properties(0).multi_processor_count)


def sweep_decode(name: str, seq_lens: list[int], fp8: bool, num_splits: int | None = None,
                 block_ns: tuple[int, ...] = (32, 64, 128)) -> None:
    """Time every (BLOCK_N, num_warps, num_stages) of the decode kernel on one batch, fastest first."""
    batch = make_batch([1] * len(seq_lens), seq_lens, 16, fp8)
    ref = reference(batch)
    rows = []
    for block_n in block_ns:
        for num_warps in (2, 4, 8):
            for num_stages in (1, 2, 3, 4):
                def run(config: tuple[int, int, int] = (block_n, num_warps, num_stages)) -> torch.Tensor:
                    return paged_attention_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                                  batch.seq_lens, SCALE, num_splits=num_splits,
                                                  k_scale=batch.k_scale, v_scale=batch.v_scale,
                                                  launch_config=config)
                try:
                    error = relative_error(run(), ref)
                    ms = do_bench(run, return_mode="median")
                except Exception as e:  # a configuration the compiler refuses (e.g. out of shared memory)
                    print(f"{name}: BLOCK_N {block_n} warps {num_warps} stages {num_stages}: {type(e).__name__}")
                    continue
                rows.append((ms, block_n, num_warps, num_stages, error))
    print(f"{name}: {kv_bytes(batch) / 1e9:.3f} GB of KV; BLOCK_N, warps, stages, time us, TB/s, rel err")
    for ms, block_n, num_warps, num_stages, error in sorted(rows):
        print(f"  {block_n:>4} {num_warps:>2} {num_stages:>2} {ms * 1e3:>9.1f} {kv_bytes(batch) / ms / 1e9:>6.2f} "
              f"{error:.1e}")


def sweep(which: str = "all") -> None:
    """The decode kernel's launch configurations at batch 256 (bf16 and fp8 KV) and batch 1, for tuning."""
    rng = random.Random(0)
    batch_256 = [rng.randint(100, 2000) for _ in range(256)]
    if which == "fp8":
        sweep_decode("decode b=256 ctx 100..2000, fp8 KV", batch_256, fp8=True, block_ns=(64, 128, 256))
        return
    sweep_decode("decode b=256 ctx 100..2000", batch_256, fp8=False)
    sweep_decode("decode b=256 ctx 100..2000, fp8 KV", batch_256, fp8=True, block_ns=(64, 128, 256))
    # The engine's CUDA graphs see the block table of max_model_len, so batch 1 gets 16 splits.
    sweep_decode("decode b=1 ctx 600, 16 splits", [600], fp8=False, num_splits=16)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="all", choices=["all", "sampling", "sweep"],
                    help="all: attention then sampling (default); sampling: only the sampler; sweep: time every "
                         "launch configuration of the decode kernel")
    ap.add_argument("sweep_cache", nargs="?", choices=["fp8"], help="with sweep: only the fp8 KV cache")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    if args.mode == "sampling":
        bench_sampling()
        return
    if args.mode == "sweep":
        sweep(args.sweep_cache or "all")
        return
    rng = random.Random(0)
    print(f"{torch.cuda.get_device_name()}, {DTYPE}, {NUM_Q_HEADS} q heads / {NUM_KV_HEADS} kv heads / "
          f"head_dim {HEAD_DIM}")
    print(f"{'case':<34} {'page':>5} {'splits':>7} {'time us':>9} {'KV GB':>8} {'TB/s':>8} {'TFLOP/s':>8} "
          f"{'rel err':>9}")
    batch_256 = [rng.randint(100, 2000) for _ in range(256)]
    for block_size in (16, 256):
        bench_decode("decode b=256 ctx 100..2000", batch_256, block_size, [None, 2, 4])
    bench_decode("decode b=256 ctx 100..2000, fp8 KV", batch_256, 16, [None, 2], fp8=True)
    for block_size in (16, 256):
        bench_decode("decode b=8 ctx 16384 (split-KV)", [16384] * 8, block_size, [None, 1, 4, 16])
    for block_size in (16, 256):
        bench_decode("decode b=1 ctx 32768 (split-KV)", [32768], block_size, [None, 1])
    bench_decode("decode b=8 ctx 16384, fp8 KV", [16384] * 8, 16, [None], fp8=True)
    bench_decode("decode b=1 ctx 32768, fp8 KV", [32768], 16, [None], fp8=True)
    for block_size in (16, 256):
        bench_prefill("prefill 8 x 1024 new tokens", [1024] * 8, [1024] * 8, block_size)
    bench_prefill("prefill 8 x 1024 new tokens, fp8 KV", [1024] * 8, [1024] * 8, 16, fp8=True)
    for block_size in (16, 256):
        bench_prefill("chunked 8 x 512 after 3072 cached", [512] * 8, [3584] * 8, block_size)
    for block_size in (16, 256):
        bench_prefill("mixed 4 x 1024 prefill + 252 decode", [1024] * 4 + [1] * 252,
                      [1024] * 4 + [rng.randint(100, 2000) for _ in range(252)], block_size)
    bench_sampling()


if __name__ == "__main__":
    main()
