"""Run the Triton kernels under the Triton interpreter (on CPU tensors) when there is no GPU.

`triton.jit` decides between compiling and interpreting when a kernel is defined, so the
variable must be set before `kernels` is first imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
