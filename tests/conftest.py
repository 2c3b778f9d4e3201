"""Test-wide setup: run Triton kernels through the interpreter when there is no GPU."""
import os

import torch

if not torch.cuda.is_available():
    # must be set before triton is first imported, so that @triton.jit kernels run on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")
