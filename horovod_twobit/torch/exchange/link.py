"""The fallback's measurements (:mod:`horovod_twobit.state.fallback`), the step-time model's inputs for
its per-bucket decision: the link, by timed allreduces and allgathers of known size through
Horovod, and the codec rate (:func:`.checked.codec_seconds`); rank 0's figures are broadcast, so
every rank decides alike."""

import torch

import horovod.torch.mpi_ops as mpi_ops

from horovod_twobit.state.fallback import BIG, Link, allgather_values, figures
from horovod_twobit.torch.exchange.checked import codec_seconds


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


def measure(process_set, device, threshold):
    """A :class:`Link` of ``process_set`` from rank 0's measurements."""
    N = process_set.size()
    got = figures(N, _allreduce(process_set, device),
                  lambda n: codec_seconds(device, threshold, N, n),
                  allgather=_allgather(process_set, device) if N > 1 else None)
    return Link(*broadcaster(process_set)(got, "twobit.link.figures"))


def broadcaster(process_set):
    """``broadcast(floats, name)``: rank 0's floats on every rank of ``process_set``."""
    def broadcast(values, name):
        return mpi_ops.broadcast(torch.tensor(values, dtype=torch.float64), 0, name=name,
                                 process_set=process_set).tolist()
    return broadcast
