"""The fallback's measurements (:mod:`horovod_twobit.state.fallback`), the step-time model's inputs for
its per-bucket decision: the link, by timed allreduces and allgathers of known size through
Horovod, and the codec rate, by one encode and the decode-sum of N payloads of known size on this
device; rank 0's figures are broadcast, so every rank decides alike."""

import time

import torch

import horovod.torch.mpi_ops as mpi_ops

from horovod_twobit.state.fallback import BIG, Link, allgather_values, figures
from horovod_twobit.wire.layout import Layout


def _allreduce(process_set, device):
    """``run(values, i)``: one allreduce of ``values`` zeros (1 or ``BIG``), the ``i``-th."""
    xs = {n: torch.zeros(n, dtype=torch.float32, device=device) for n in (1, BIG)}

    def run(values, i):
        mpi_ops.synchronize(mpi_ops.allreduce_async_(
            xs[values], name="twobit.link.%d.%d" % (values, i), op=mpi_ops.Sum,
            process_set=process_set))
    return run


def _allgather(process_set, device):
    """``run(values, i)``: one allgather of ``values`` zeros per rank (1 or
    :func:`~horovod_twobit.state.fallback.allgather_values`), the ``i``-th."""
    xs = {n: torch.zeros(n, dtype=torch.float32, device=device)
          for n in (1, allgather_values(process_set.size()))}

    def run(values, i):
        mpi_ops.synchronize(mpi_ops.allgather_async(
            xs[values], name="twobit.link.gather.%d.%d" % (values, i), process_set=process_set))
    return run


def _codec_seconds(device, threshold, nranks, values):
    """Seconds of a step's codec work on ``values`` values: one encode, and the decode-sum of
    ``nranks`` payloads (this rank's, repeated, in the place of the gathered ones)."""
    from horovod_twobit.torch import codec
    layout = Layout([values], threshold == "auto")
    g = torch.randn(values, device=device)
    r = torch.zeros(values, device=device)
    payload = torch.empty(layout.payload_words, dtype=torch.int32, device=device)
    best = float("inf")
    for _ in range(3 if values >= BIG else 7):  # the first small one may compile
        g2 = g.clone()
        t0 = time.perf_counter()
        t, v = codec.encode_payload(layout, r, g2, threshold, "lsq", payload)
        codec.finish_payload(layout, payload.repeat(max(nranks, 1)), max(nranks, 1),
                             ["twobit.link"], r, g2, t, v, nranks, 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(process_set, device, threshold):
    """A :class:`Link` of ``process_set`` from rank 0's measurements."""
    N = process_set.size()
    got = figures(N, _allreduce(process_set, device),
                  lambda n: _codec_seconds(device, threshold, N, n),
                  allgather=_allgather(process_set, device) if N > 1 else None)
    got = mpi_ops.broadcast(torch.tensor(got, dtype=torch.float64), 0,
                            name="twobit.link.figures", process_set=process_set)
    return Link(*got.tolist())
