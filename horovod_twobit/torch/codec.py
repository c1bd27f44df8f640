"""The 2-bit codec in torch ops: quantize with error feedback, pack, unpack. No state, no
communication, no host round trip: the same code runs on CPU and CUDA tensors. The fused kernels
live in :mod:`horovod_twobit.torch.kernels`."""

import torch

from .. import wire
from . import kernels


def _check(grad, residual):
    if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
        raise TypeError("grad must be a floating-point torch.Tensor, got %r"
                        % (getattr(grad, "dtype", type(grad)),))
    if grad.is_sparse:
        raise TypeError("grad is sparse: densify it first (sparse_as_dense=True in hvd.DistributedOptimizer)")
    if residual.dtype != torch.float32:
        raise TypeError("residual must be float32, got %s" % residual.dtype)
    if residual.numel() != grad.numel():
        raise ValueError("residual has %d values, grad has %d" % (residual.numel(), grad.numel()))
    if residual.device != grad.device:
        raise ValueError("residual is on %s, grad on %s: keep them on the same device"
                         % (residual.device, grad.device))


def flat(grad):
    """1-D view (or contiguous copy) of a gradient; float16/bfloat16 stay as they are (the kernels
    convert exactly), float64 is rounded to float32 first."""
    g = grad.reshape(-1)
    return g.to(torch.float32) if g.dtype == torch.float64 else g


def quantize_pack(grad, residual, threshold, out=None):
    """(words, non-finite flag) for ternary(residual + grad), without touching the residual
    (see :func:`commit`). ``residual`` must be contiguous. The words go into ``out`` (1-D int32
    of ceil(numel / 16) words) when given."""
    return kernels.pack(residual.view(-1), flat(grad), threshold, out)


def commit(grad, residual, threshold, magnitude=None):
    """Applies one error-feedback step to ``residual`` in place: r <- (r + g) - q, with q the
    ternary value :func:`quantize_pack` sent for the same (grad, residual): +-``magnitude``
    (default: the threshold) where |r + g| reaches the threshold. The float32 operations
    are MXNet's, in its order, so the bits are MXNet's. ``residual`` must be contiguous (the
    registry's are; :func:`encode` makes a contiguous copy of any other)."""
    kernels.commit(residual.view(-1), flat(grad), threshold, magnitude)


def encode(grad, residual, threshold, magnitude=None):
    """Quantizes ``grad`` with error feedback and packs it.

    ``residual`` (float32, any shape with as many values as ``grad``, same device) is updated in
    place: r <- r + g; q = +v where r >= t, -v where r <= -t, else 0; r <- r - q, with t the
    threshold and v the magnitude (default: t, MXNet's scheme; decode with v). Returns the 1-D
    int32 words, ceil(numel / 16) of them. float64 gradients are rounded to float32 first."""
    t, v = wire.encode_levels(threshold, magnitude)
    _check(grad, residual)
    r = residual if residual.is_contiguous() else residual.contiguous()
    words, _ = quantize_pack(grad, r, t)
    commit(grad, r, t, v)
    if r is not residual:
        residual.copy_(r)
    return words


def decode(words, numel, threshold):
    """float32 values of packed ``words``: +t for code 11, -t for 10, 0 otherwise. 1-D, ``numel``
    long."""
    t = wire.validate_threshold(threshold)
    if t == "auto":
        raise ValueError("decode() takes the numeric threshold the sender used")
    numel = int(numel)
    if words.dtype != torch.int32 or words.dim() != 1:
        raise TypeError("words must be a 1-D int32 tensor, got %s of shape %s"
                        % (words.dtype, tuple(words.shape)))
    if words.numel() != wire.num_words(numel):
        raise ValueError("%d values need %d words, got %d" % (numel, wire.num_words(numel), words.numel()))
    return kernels.decode_sum([words.contiguous()], [t], numel)
