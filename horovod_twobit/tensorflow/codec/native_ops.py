"""The TensorFlow codec's CPU ops, built on first use: a bucket's "auto" levels, its encode
and its finish, each one op.

What: ``TwoBitSegmentLevels`` (``segment_levels.cc``) reads a flat gradient and residual once per
pass and returns every segment's (threshold, magnitude), the bits of
:func:`horovod_twobit.reference.auto_levels` for the rules "lsq", "mean" and "rms" (with or
without a ``*K`` factor). ``TwoBitBucketEncode`` (``bucket_encode.cc``) and
``TwoBitBucketFinish`` (``bucket_finish.cc``) are a bucket's two passes
(:func:`bucket_passes.encode_body`, :func:`bucket_passes.finish_body`), the same bits.
``TwoBitStatsRow`` (``stats_rows.cc``) is the stats' handover: it copies a step's row into a table
that :class:`StatsRows` reads through ``ctypes``.

Why: on a CPU these passes as TF or XLA ops run without vector instructions (XLA's reductions,
its per-word selects) or as many ops over the bucket (TF); the ops compare and select 4 or 8
values at a time: the levels in about half the time of the XLA reductions, the encode and the
finish in a third to a half of the XLA bodies' (docs/tf_step_cost.md).

Trade-offs: it needs a C++ compiler (``g++``, or ``$CXX``) on first use. The library is compiled
against the installed TensorFlow (about 20 s) and kept in ``ops/`` under
``$HOROVOD_TWOBIT_CACHE`` (default ``~/.cache/horovod-twobit``), keyed by its sources,
TensorFlow's version and flags; ranks that start together take a file lock, so one builds and the
others load. Where the build fails, with a GPU (the ops have no GPU kernels: the codec stays on
the device there), or with ``HOROVOD_TWOBIT_NATIVE=0``, the codec runs as TF and XLA ops as
before, the same bits; the "opt" rule's levels always do.
"""

import ctypes
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import threading
import weakref

import numpy as np
import tensorflow as tf

from horovod_twobit import wire

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(_HERE, f) for f in ("segment_levels.cc", "bucket_encode.cc",
                                             "bucket_finish.cc", "stats_rows.cc")]
HEADERS = [os.path.join(_HERE, "twobit_ops.h")]  # found beside the sources
RULES = ("lsq", "mean", "rms")
FLAGS = ["-shared", "-fPIC", "-O3", "-fno-fast-math", "-ffp-contract=off", "-Wno-psabi"]

_log = logging.getLogger(__name__)
_loaded = {}  # "module": the loaded op library, or None after a failure; "why": the failure
_layout_ints = weakref.WeakKeyDictionary()  # layout -> its static int64 tensors (layout_ints)


def cache_dir():
    root = os.environ.get("HOROVOD_TWOBIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "horovod-twobit")
    return os.path.join(root, "ops")


def library_path():
    """Where the library built from these sources, for this TensorFlow, lives."""
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            key.update(f.read())
    for part in [tf.__version__, sys.platform] + FLAGS + tf.sysconfig.get_compile_flags() + \
            tf.sysconfig.get_link_flags():
        key.update(part.encode() + b"\0")
    return os.path.join(cache_dir(), "twobit_ops-%s.so" % key.hexdigest()[:16])


def build(path):
    """Compiles the ops into ``path`` (atomically: a finished library or none)."""
    tmp = "%s.%d.tmp" % (path, os.getpid())
    cmd = ([os.environ.get("CXX", "g++")] + FLAGS + SOURCES + ["-o", tmp]
           + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags())
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError("%s: %s" % (cmd[0], e)) from None
    if out.returncode != 0:
        raise RuntimeError("%s failed:\n%s" % (" ".join(cmd), out.stderr[-2000:]))
    os.replace(tmp, path)


def module():
    """The ops' library, built if needed; None where it cannot be had (the reason is logged
    once, and kept in :func:`unavailable_reason`)."""
    if "module" in _loaded:
        return _loaded["module"]
    mod = None
    if os.environ.get("HOROVOD_TWOBIT_NATIVE", "1") == "0":
        _loaded["why"] = "HOROVOD_TWOBIT_NATIVE=0"
    else:
        try:
            path = library_path()
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path + ".lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together: one builds
                    if not os.path.exists(path):
                        build(path)
            mod = tf.load_op_library(path)
            _loaded["path"] = path
        except (OSError, RuntimeError, tf.errors.OpError) as e:
            _loaded["why"] = str(e)
            _log.warning("horovod_twobit: the TensorFlow codec's CPU ops are not available, so "
                         "it runs as TF and XLA ops (the same values, slower): %s. Install a C++ "
                         "compiler (g++) to have them, or set HOROVOD_TWOBIT_NATIVE=0 to silence "
                         "this.", e)
    _loaded["module"] = mod
    return mod


def unavailable_reason():
    return _loaded.get("why")


def usable(rule):
    """Whether the levels of ``rule`` come from the op: a rule it knows, no GPU, the op built."""
    return wire.parse_rule(rule)[0] in RULES and codec_usable()


def codec_usable():
    """Whether a bucket's encode and finish run as the ops: no GPU, the library built."""
    return not tf.config.list_logical_devices("GPU") and module() is not None


def segment_levels(g, b, starts, lengths, rule):
    """(thresholds, magnitudes), float32, of the segments ``[starts[i], starts[i] + lengths[i])``
    (static: sequences, or int64 tensors as :func:`layout_ints` gives them) of the flat float32
    ``b + g``; only where :func:`usable`."""
    name, k = wire.parse_rule(rule)
    factor = tf.constant(float(k) if k else 0.0, tf.float64)  # 0: none
    starts, lengths = (x if tf.is_tensor(x) else _ints(x) for x in (starts, lengths))
    return module().two_bit_segment_levels(
        g, b, starts, lengths, tf.constant(wire.OPT_MULTIPLES, tf.float64), factor, rule=name)


def _ints(values):
    return tf.constant(np.asarray(values, np.int64))


def layout_ints(lay):
    """(member words, segment words, segment starts, segment lengths) of layout ``lay`` as int64
    tensors, made once per layout outside any trace: an exchange that is not traced (eager
    ``hvd.allreduce``) would otherwise copy them from NumPy at every call (about 65 us each for
    the MLP's 1 671 segments). Segment words are empty for a numeric threshold."""
    got = _layout_ints.get(lay)
    if got is None:
        with tf.init_scope():
            got = _layout_ints[lay] = tuple(_ints(v) for v in (
                lay.member_words, lay.seg_words if lay.auto else [], lay.seg_starts,
                lay.seg_lengths))
    return got


def bucket_encode(lay, head, g, b, thresholds, magnitudes):
    """The payload of a bucket of layout ``lay`` (not single): ``head``, its static header words;
    ``g``, ``b`` its flat gradient and residual; ``thresholds`` and ``magnitudes``: one value
    each (a numeric threshold, twice) or, "auto", one per segment. Only where
    :func:`codec_usable`."""
    members, segments = layout_ints(lay)[:2]
    return module().two_bit_bucket_encode(g, b, thresholds, magnitudes, members, segments,
                                          tf.constant(head, tf.int32), mags_at=lay.head_words,
                                          body_at=lay.body)


def bucket_finish(lay, average, scale, rows, checked, count, g, before, thresholds, magnitudes,
                  want_norms):
    """(flat result, flat new residual, whether any member is NaN, the new residual's norms) of a
    bucket: ``rows``, the gathered payloads (nranks, payload words); the rest as
    :func:`bucket_passes.finish_body` takes them, the levels as :func:`bucket_encode`'s; the norms
    (:func:`codec.norms`: the sum of squares as float64 sums of float32 squares, computed in the
    finish's own pass) when the 0-d bool ``want_norms`` is True, else NaN. Only where
    :func:`codec_usable`."""
    members, segments = layout_ints(lay)[:2]
    return module().two_bit_bucket_finish(
        rows, checked, count, g, before, thresholds, magnitudes, members, segments, want_norms,
        mags_at=lay.head_words, body_at=lay.body, average=bool(average), scale=float(scale))


def stats_row(row, key):
    """An op that keeps the float64 vector ``row`` as slot ``key``'s row in the library's table
    (the stats' handover, read by :class:`StatsRows`); a 0-d bool. Only where
    :func:`codec_usable`."""
    return module().two_bit_stats_row(row, key=int(key))


def _rows_lib():
    lib = _loaded.get("ctypes")
    if lib is None:  # the library TensorFlow loaded: dlopen of the same path shares its table
        lib = ctypes.CDLL(_loaded["path"])
        lib.twobit_stats_rows.restype = ctypes.c_int64
        lib.twobit_stats_forget.restype = None
        _loaded["ctypes"] = lib
    return lib


class StatsRows:
    """Reads the rows that :func:`stats_row` kept for the slot numbers ``keys``, ``width``
    values each, with no TensorFlow call: ``read()`` -> a list of rows (lists of floats), a row
    NaN where its slot has not stepped. The buffers are made once; reads from several threads
    take turns."""

    def __init__(self, keys, width):
        self.n, self.width = len(keys), int(width)
        self._lock = threading.Lock()
        keys = (ctypes.c_int64 * max(self.n, 1))(*keys)
        out = (ctypes.c_double * max(self.n * self.width, 1))()
        # the call's arguments made once, the rows taken through a view of its buffer: right
        # after a step (caches cold) 16 us a read against 33 us with arguments made per call
        self._args = (keys, ctypes.c_int64(self.n), ctypes.c_int64(self.width), out)
        self._view = memoryview(out).cast("B").cast("d")
        self._fn = _rows_lib().twobit_stats_rows

    def read(self):
        with self._lock:  # one buffer: a read must not see another's half-written copy
            self._fn(*self._args)
            flat = self._view.tolist()
        w = self.width
        return [flat[i * w:(i + 1) * w] for i in range(self.n)]


def forget_stats_rows(keys):
    """Drops the rows of ``keys`` from the table."""
    keys = list(keys)
    if keys and "path" in _loaded:
        _rows_lib().twobit_stats_forget((ctypes.c_int64 * len(keys))(*keys),
                                        ctypes.c_int64(len(keys)))
