"""A kernel that applies the codec's ``_at_least`` to a vector (tests/workers/triton_codec.py's
``at_least`` case; a module of its own, since the suite imports triton_codec without Triton)."""

import triton
import triton.language as tl

from horovod_twobit.torch.codec import triton_kernels as tk


@triton.jit
def at_least_kernel(t_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tk._at_least(tl.load(t_ptr + i)))
