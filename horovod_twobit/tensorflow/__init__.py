"""TensorFlow 2 / Keras binding: ``encode`` / ``decode`` (the codec, in TF ops), ``auto_levels``
(the threshold and magnitude ``threshold="auto"`` chooses) and ``TwoBitCompressor`` (Horovod's ``Compressor``
interface, with ``tf.Variable`` residuals keyed by variable or tensor name, savable with
``tf.train.Checkpoint``).

Importing this package installs the router (:func:`install`; :func:`uninstall` removes it), so that
``hvd.allreduce(t, name='t', compression=TwoBitCompressor(0.5))`` is routed even on the first call:
Python looks ``hvd.allreduce`` up before it builds the compressor. Calls without a TwoBitCompressor
go to Horovod unchanged.
"""

from horovod_twobit.tensorflow.codec import auto_levels, auto_threshold, decode, encode
from horovod_twobit.tensorflow.compressor import TwoBitCompressor
from horovod_twobit.tensorflow.callbacks import TwoBitFallbackCallback, TwoBitStatsCallback
from horovod_twobit.tensorflow.retrace import fallback_function
from horovod_twobit.tensorflow.router import install, installed, uninstall
from horovod_twobit.wire import PayloadMismatchError

install()

__all__ = ["encode", "decode", "auto_levels", "auto_threshold", "TwoBitCompressor",
           "TwoBitStatsCallback", "TwoBitFallbackCallback", "fallback_function", "install", "uninstall", "installed", "PayloadMismatchError"]
