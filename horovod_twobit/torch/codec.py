"""The 2-bit codec in torch ops: quantize with error feedback, pack, unpack. No state, no
communication, no host round trip: the same code runs on CPU and CUDA tensors."""

import torch

from .. import wire

_SHIFTS = {}


def _shifts(device):
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.tensor([6, 4, 2, 0], dtype=torch.uint8, device=device)
    return s


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


def _flat32(grad):
    g = grad.reshape(-1)
    return g if g.dtype == torch.float32 else g.to(torch.float32)


def _codes(x, t):
    """uint8 codes of float32 values: 3 (11) where x >= t, 2 (10) where x <= -t, else 0."""
    pos = x >= t
    return (pos | (x <= -t)).to(torch.uint8).mul_(2).add_(pos.to(torch.uint8))


def pack(codes):
    """Packs 1-D uint8 codes (values 0..3) into int32 words in MXNet's layout."""
    n = codes.numel()
    nw = wire.num_words(n)
    padded = torch.zeros(nw * 16, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    q = padded.view(nw * 4, 4)
    byts = (q[:, 0] << 6) | (q[:, 1] << 4) | (q[:, 2] << 2) | q[:, 3]
    return byts.view(torch.int32)


def unpack(words, numel):
    """uint8 codes of the first ``numel`` values of 1-D int32 ``words``."""
    byts = words.contiguous().view(torch.uint8)
    codes = (byts.unsqueeze(1) >> _shifts(words.device)) & 3
    return codes.reshape(-1)[:numel]


def quantize_pack(grad, residual, threshold):
    """Packed words of ternary(residual + grad) without touching the residual (see :func:`commit`)."""
    x = residual.reshape(-1) + _flat32(grad)
    return pack(_codes(x, float(threshold)))


def commit(grad, residual, threshold):
    """Applies one error-feedback step to ``residual`` in place: r <- (r + g) - q, with q the
    ternary value :func:`quantize_pack` sent for the same (grad, residual). The float32 operations
    are MXNet's, in its order, so the bits are MXNet's."""
    t = float(threshold)
    r = residual.view(-1) if residual.is_contiguous() else None
    x = residual.reshape(-1) + _flat32(grad)
    x = torch.where(x >= t, x - t, torch.where(x <= -t, x + t, x))
    if r is not None:
        r.copy_(x)
    else:
        residual.copy_(x.view_as(residual))


def encode(grad, residual, threshold):
    """Quantizes ``grad`` with error feedback and packs it.

    ``residual`` (float32, any shape with as many values as ``grad``, same device) is updated in
    place: r <- r + g; q = +t where r >= t, -t where r <= -t, else 0; r <- r - q. Returns the
    1-D int32 words, ceil(numel / 16) of them. Gradients of other float dtypes are converted to
    float32 before the add."""
    t = wire.validate_threshold(threshold)
    if t == "auto":
        raise ValueError("encode() takes a numeric threshold; 'auto' is a TwoBitCompressor mode")
    _check(grad, residual)
    words = quantize_pack(grad, residual, t)
    commit(grad, residual, t)
    return words


def decode_into(out, words, threshold):
    """Adds the decoded values of ``words`` (codes for ``out.numel()`` values) to ``out``."""
    t = float(threshold)
    codes = unpack(words, out.numel())
    out.add_(torch.where(codes == wire.CODE_POS, t, torch.where(codes == wire.CODE_NEG, -t, 0.0))
             .to(out.dtype))
    return out


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
    out = torch.zeros(numel, dtype=torch.float32, device=words.device)
    return decode_into(out, words, t)
