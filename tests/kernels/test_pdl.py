"""Programmatic dependent launch (gpu_kernels/pdl.py), compiled for the H100/H200 (sm90) on this CPU machine: with
PDL=True each decode kernel waits for the kernel before it (`griddepcontrol.wait`) and lets the next launch
(`griddepcontrol.launch_dependents`); with PDL=False neither instruction is there. The split decode kernel can
combine its splits in the same launch (an acquire-release arrival counter); without that, and unsplit, it has no
atomics. (The GEMV's variants are checked in test_gemv.py; tests/test_gpu.py runs the decode graphs with PDL on the
GPU, bit for bit.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gpu_kernels.paged_decode import _combine_splits_kernel, _paged_decode_kernel
from gpu_kernels.rope_kv_store import _qk_norm_rope_store_kernel

TYPES = {"k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
         "counter_ptr": "*i32",
         "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "positions_ptr": "*i64", "slot_mapping_ptr": "*i64",
         "cos_sin_ptr": "*fp32", "scale_log2": "fp32", "v_scale": "fp32", "eps": "fp32", "inv_k_scale": "fp32",
         "inv_v_scale": "fp32"}

def count(fn, constexprs):
    sig = {name: "constexpr" if name in constexprs else TYPES.get(name, "*bf16" if name.endswith("_ptr") else "i32")
           for name in fn.arg_names}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    return [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents"),
            ptx.count("atom.global.gpu.acq_rel")]

decode = dict(GROUP=2, GROUP_P2=2, BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=64, NUM_SPLITS=4,
              DOT_PRECISION="tf32", COMBINE=True)
unsplit = dict(decode, NUM_SPLITS=1, COMBINE=False)
two_kernels = dict(decode, COMBINE=False)
combine = dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=4)
rope = dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_HALF=64, HEADS_PER_PROGRAM=4, HAS_NORM=True, FP8=False)
print(json.dumps({f"{name}-{pdl}": count(fn, {**c, "PDL": pdl})
                  for name, fn, c in (("decode", _paged_decode_kernel, decode),
                                      ("unsplit", _paged_decode_kernel, unsplit),
                                      ("two-kernels", _paged_decode_kernel, two_kernels),
                                      ("combine", _combine_splits_kernel, combine),
                                      ("rope", _qk_norm_rope_store_kernel, rope))
                  for pdl in (False, True)}))
"""


def test_the_decode_kernels_wait_for_their_predecessor_only_with_pdl() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    for kernel in ("decode", "unsplit", "two-kernels", "combine", "rope"):
        assert counts[f"{kernel}-False"][:2] == [0, 0], counts
        assert counts[f"{kernel}-True"][0] >= 1 and counts[f"{kernel}-True"][1] >= 1, counts
    assert counts["decode-True"][2] == counts["decode-False"][2] == 1, counts
    assert counts["unsplit-True"][2] == counts["two-kernels-True"][2] == 0, counts
