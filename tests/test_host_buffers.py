"""The model runner packs a step's inputs into one buffer for one copy to the device: every input must come
back from the packed bytes with its values, in its dtype, at a 16-byte aligned offset (Triton compiles a kernel
variant per pointer alignment: views aligned differently at different batch sizes compiled kernels mid-run)."""

import numpy as np
import torch

from workers.host_buffers import UPLOADS, HostBuffers


def test_packed_inputs_read_back_exactly_in_their_dtypes() -> None:
    host = HostBuffers(max_tokens=64, max_seqs=8, max_blocks=4, device=torch.device("cpu"))
    rng = np.random.default_rng(0)
    arrays = {name: rng.integers(-2**31, 2**31 - 1, size=n).astype(np.int64 if dtype == np.int64 else np.int32)
              for (name, dtype), n in zip(UPLOADS, (5, 5, 5, 4, 3, 12, 0, 0, 3, 3, 3), strict=True)}
    arrays["temperatures"] = np.array([0.0, 0.7, 1.5], np.float32)
    arrays["input_ids"] = np.array([1, 2, 3, 4, 5], np.int32)  # an int32 array into an int64 slot is widened
    nbytes, layout = host.pack(arrays)
    packed = host.packed[:nbytes]
    for name, dtype in UPLOADS:
        offset, count, packed_dtype = layout[name]
        assert offset % 16 == 0 and packed_dtype == np.dtype(dtype)
        back = packed[offset: offset + count * packed_dtype.itemsize].numpy().view(dtype)
        np.testing.assert_array_equal(back, arrays[name].astype(dtype))
    assert nbytes <= host.packed.numel()


def test_a_full_step_fits_the_buffer() -> None:
    host = HostBuffers(max_tokens=16, max_seqs=4, max_blocks=3, device=torch.device("cpu"))
    sizes = {"input_ids": 16, "positions": 16, "slot_mapping": 16, "query_start_loc": 5, "seq_lens": 4,
             "block_tables": 12, "gpu_token_index": 16, "gpu_token_rows": 16, "logits_indices": 4,
             "sampling_rows": 4, "temperatures": 4}
    arrays = {name: np.ones(sizes[name], dtype) for name, dtype in UPLOADS}
    nbytes, _ = host.pack(arrays)
    assert nbytes <= host.packed.numel()


def test_every_view_is_16_byte_aligned_whatever_the_sizes() -> None:
    host = HostBuffers(max_tokens=300, max_seqs=40, max_blocks=9, device=torch.device("cpu"))
    rng = np.random.default_rng(1)
    for _ in range(200):
        rows = int(rng.integers(1, 41))
        tokens = int(rng.integers(rows, 301))
        sizes = {"input_ids": tokens, "positions": tokens, "slot_mapping": tokens, "query_start_loc": rows + 1,
                 "seq_lens": rows, "block_tables": rows * int(rng.integers(1, 10)),
                 "gpu_token_index": int(rng.integers(0, rows + 1)), "gpu_token_rows": 0, "logits_indices": rows,
                 "sampling_rows": rows, "temperatures": rows}
        sizes["gpu_token_rows"] = sizes["gpu_token_index"]
        _, layout = host.pack({name: np.zeros(sizes[name], dtype) for name, dtype in UPLOADS})
        assert all(offset % 16 == 0 for offset, _, _ in layout.values()), layout
