"""Reading ``TwoBitCompressor.stats()`` in PyTorch cheaply: residual norms in a pass or two over
each residual, on its device, and one host transfer for all of them.

Norms are for watching, not for arithmetic: the sum of squares is a float32 dot product (BLAS or
cuBLAS, about 1e-6 relative), the largest |r| exact (``aminmax``). A bucket's norms come from its
flat residual buffer in one dot and one ``aminmax`` (its padding holds zeros), instead of a pass
per member."""

import torch


def _pair(r):
    """(sum of squares, max |r|) of a 1-D float32 tensor, as two 0-d tensors."""
    if not r.numel():
        z = r.new_zeros(())
        return z, z
    lo, hi = torch.aminmax(r)
    return torch.dot(r, r), torch.maximum(-lo, hi)


def tensor_norms(residuals, names):
    """{name: (sum of squares, max |r|)} of the residuals in ``residuals`` (a registry) under
    ``names`` that exist."""
    found = [(n, r) for n, r in ((n, residuals.lookup(n)) for n in names) if r is not None]
    if not found:
        return {}
    pairs = [_pair(r.detach().reshape(-1)) for _, r in found]
    values = _host([x for p in pairs for x in p])
    return {n: (values[2 * i], values[2 * i + 1]) for i, (n, _) in enumerate(found)}


def bucket_norms(bucket):
    """A function giving (sum of squares, max |r|) of ``bucket``'s current residuals, or None
    when the bucket does not hold them (then the caller reads them per tensor)."""
    def read():
        r = bucket.current_residual()
        return None if r is None else tuple(_host(list(_pair(r.detach().reshape(-1)))))
    return read


def _host(scalars):
    """Python floats of 0-d tensors, with one transfer per device."""
    out, by_dev = [None] * len(scalars), {}
    for i, x in enumerate(scalars):
        by_dev.setdefault(x.device, []).append(i)
    for idx in by_dev.values():
        got = torch.stack([scalars[i].to(torch.float64) for i in idx]).tolist()
        for i, v in zip(idx, got):
            out[i] = v
    return out
