"""PyTorch binding: ``encode`` / ``decode`` (the codec) and ``TwoBitCompressor`` (Horovod's
``Compressor`` interface, with a residual registry keyed by tensor name).

Importing this module installs the router around Horovod's allreduce entry points (so that
``hvd.allreduce(t, compression=TwoBitCompressor(0.5))``, where ``hvd.allreduce`` is looked up before
the compressor exists, is routed too); :func:`uninstall` removes it, :func:`install` puts it back.
"""

from .codec import decode, encode
from .compressor import TwoBitCompressor
from ._routing import install, installed, uninstall
from .elastic import TwoBitStateHandler, register as _register_elastic
from ..wire import PayloadMismatchError

__all__ = ["encode", "decode", "TwoBitCompressor", "install", "uninstall", "installed",
           "PayloadMismatchError", "TwoBitStateHandler"]

install()
_register_elastic()
