"""PyTorch binding: ``encode`` / ``decode`` (the codec) and ``TwoBitCompressor`` (Horovod's
``Compressor`` interface, with a residual registry keyed by tensor name).

Importing this module installs the router around Horovod's allreduce entry points (so that
``hvd.allreduce(t, compression=TwoBitCompressor(0.5))``, where ``hvd.allreduce`` is looked up before
the compressor exists, is routed too); :func:`uninstall` removes it, :func:`install` puts it back.
"""

from horovod_twobit.torch.codec import decode, encode
from horovod_twobit.torch.compressor import TwoBitCompressor
from horovod_twobit.torch.router import install, installed, uninstall
from horovod_twobit.torch.elastic import TwoBitStateHandler, register as _register_elastic
from horovod_twobit.wire import PayloadMismatchError

__all__ = ["encode", "decode", "TwoBitCompressor", "install", "uninstall", "installed",
           "PayloadMismatchError", "TwoBitStateHandler"]

install()
_register_elastic()
