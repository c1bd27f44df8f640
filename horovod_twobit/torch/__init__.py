"""PyTorch binding: ``encode`` / ``decode`` (the codec) and ``TwoBitCompressor`` (Horovod's
``Compressor`` interface, with a residual registry keyed by tensor name)."""

from .codec import decode, encode
from .compressor import TwoBitCompressor
from ._routing import install, installed, uninstall
from ..wire import PayloadMismatchError

__all__ = ["encode", "decode", "TwoBitCompressor", "install", "uninstall", "installed",
           "PayloadMismatchError"]
