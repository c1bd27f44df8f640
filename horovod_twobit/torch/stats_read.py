"""Reading ``TwoBitCompressor.stats()`` in PyTorch cheaply: residual norms in three reductions
over each residual, on its device, and one host transfer for all of them.

Norms are for watching, not for arithmetic: the sum of squares is a float32 dot product (BLAS or
cuBLAS, about 1e-6 relative), the largest |r| exact (``amax`` and ``amin``: faster than
``aminmax`` on a CPU). A bucket's norms come from its flat residual buffer (its padding holds
zeros), instead of passes per member.

After a ``stats()`` call, each bucket's next step computes them as it finishes (:func:`step_norms`,
kept on the bucket without a host transfer), while the new residual is still in cache: a read
after every step then only fetches them. Reading less often, only that one step per read does the
work, and the read computes the norms of the steps since (the kept ones are stale). Without reads
a step does no stats work."""

import torch


def _pair(r):
    """(sum of squares, max |r|) of a 1-D float32 tensor, as two 0-d tensors."""
    if not r.numel():
        z = r.new_zeros(())
        return z, z
    return torch.dot(r, r), torch.maximum(-torch.amin(r), torch.amax(r))


def step_norms(bucket, residual):
    """At the end of a bucket's first step after a ``stats()`` call: keeps ``residual``'s (the
    bucket's flat residual after the step) norms on the bucket as 0-d tensors, with the registry
    generation and the step they belong to (a reset, a load or a later step makes them stale)."""
    bucket.step_norms = (bucket.compressor.residuals.generation, bucket.steps,
                         _pair(residual.detach().reshape(-1)))


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
        kept = bucket.step_norms
        if kept is not None and kept[:2] == (bucket.compressor.residuals.generation,
                                             bucket.steps):
            return tuple(_host(list(kept[2])))
        r = bucket.current_residual()
        return None if r is None else tuple(_host(list(_pair(r.detach().reshape(-1)))))
    return read


def _host(scalars):
    """Python floats of 0-d tensors: on the CPU each read as it is, elsewhere with one transfer
    per device."""
    out, by_dev = [None] * len(scalars), {}
    for i, x in enumerate(scalars):
        if x.device.type == "cpu":
            out[i] = x.item()
        else:
            by_dev.setdefault(x.device, []).append(i)
    for idx in by_dev.values():
        got = torch.stack([scalars[i].to(torch.float64) for i in idx]).tolist()
        for i, v in zip(idx, got):
            out[i] = v
    return out
