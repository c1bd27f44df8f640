"""Horovod's own PyTorch entry points, as they were before the router wrapped them.

The router (:mod:`horovod_twobit.torch.router`) keeps the originals here when it installs its
wrappers; the exchanges call them directly where a tensor is known not to be TwoBit's (a plain
step's members, their polls and waits), instead of going through the wrappers once more: a
plain step of many small members pays that per member."""

import horovod.torch.mpi_ops as mpi_ops

originals = {}  # name -> Horovod's function, while the router is installed


def own(name):
    """Horovod's own ``mpi_ops.<name>``, whether or not the router is installed."""
    return originals.get(name) or getattr(mpi_ops, name)
