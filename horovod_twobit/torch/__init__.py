"""PyTorch binding: ``encode`` / ``decode`` (the codec) and ``TwoBitCompressor`` (Horovod's
``Compressor`` interface, over a :class:`~horovod_twobit.torch.state.TwoBitState`).

Importing this module installs the router around Horovod's allreduce entry points (so that
``hvd.allreduce(t, compression=TwoBitCompressor(0.5))``, where ``hvd.allreduce`` is looked up before
the compressor exists, is routed too); :func:`uninstall` removes it, :func:`install` puts it back.

Without Horovod the codec (:mod:`horovod_twobit.torch.codec`) and the state
(:mod:`horovod_twobit.torch.state`) still import; the Horovod names then raise the ImportError
that says so.
"""

from horovod_twobit.torch.codec import decode, encode
from horovod_twobit.wire import PayloadMismatchError

__all__ = ["encode", "decode", "TwoBitCompressor", "install", "uninstall", "installed",
           "PayloadMismatchError", "TwoBitStateHandler"]

try:
    import horovod.torch  # noqa: F401
except ImportError as e:  # the codec and the state work without Horovod
    _NO_HOROVOD = e
else:
    _NO_HOROVOD = None
    from horovod_twobit.torch.compressor import TwoBitCompressor
    from horovod_twobit.torch.router import install, installed, uninstall
    from horovod_twobit.torch.elastic import TwoBitStateHandler, register as _register_elastic

    install()
    _register_elastic()


def __getattr__(name):
    if _NO_HOROVOD is not None and name in __all__:
        raise ImportError("horovod_twobit.torch.%s needs Horovod built with PyTorch (pip install "
                          "horovod, or bash scripts/setup.sh): importing horovod.torch failed: %s"
                          % (name, _NO_HOROVOD)) from _NO_HOROVOD
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
