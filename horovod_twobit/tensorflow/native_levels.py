"""The "auto" levels of many segments as one TensorFlow op on the CPU, built on first use.

What: ``TwoBitSegmentLevels`` (``segment_levels.cc``) reads a flat gradient and residual once per
pass and returns every segment's (threshold, magnitude), the bits of
:func:`horovod_twobit.reference.auto_levels` for the rules "lsq", "mean" and "rms" (with or
without a ``*K`` factor).

Why: the "lsq" rule needs, per segment, a float64 mean and then 9 float64 counts and sums. As TF
or XLA ops on a CPU these are reductions without vector instructions (XLA) or a broadcast
comparison nine times the gradient's size (TF); the op compares 4 values at a time and sums per
bin, in about half the time of the XLA reductions (docs/tf_step_cost.md).

Trade-offs: it needs a C++ compiler (``g++``, or ``$CXX``) on first use. The library is compiled
against the installed TensorFlow (about 10 s) and kept in ``ops/`` under
``$HOROVOD_TWOBIT_CACHE`` (default ``~/.cache/horovod-twobit``), keyed by its source, TensorFlow's
version and flags; ranks that start together take a file lock, so one builds and the others
load. Where the build fails, with a GPU (the op has no GPU kernel: the levels stay beside the rest
of the codec there), for the "opt" rule, or with ``HOROVOD_TWOBIT_NATIVE=0``, the levels are
computed with TF ops as before, the same bits.
"""

import fcntl
import hashlib
import logging
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from .. import wire

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "segment_levels.cc")
RULES = ("lsq", "mean", "rms")
FLAGS = ["-shared", "-fPIC", "-O3", "-fno-fast-math", "-ffp-contract=off"]

_log = logging.getLogger(__name__)
_loaded = {}  # "module": the loaded op library, or None after a failure; "why": the failure


def cache_dir():
    root = os.environ.get("HOROVOD_TWOBIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "horovod-twobit")
    return os.path.join(root, "ops")


def library_path():
    """Where the library built from this source, for this TensorFlow, lives."""
    key = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        key.update(f.read())
    for part in [tf.__version__, sys.platform] + FLAGS + tf.sysconfig.get_compile_flags() + \
            tf.sysconfig.get_link_flags():
        key.update(part.encode() + b"\0")
    return os.path.join(cache_dir(), "segment_levels-%s.so" % key.hexdigest()[:16])


def build(path):
    """Compiles the op into ``path`` (atomically: a finished library or none)."""
    tmp = "%s.%d.tmp" % (path, os.getpid())
    cmd = ([os.environ.get("CXX", "g++")] + FLAGS + [SOURCE, "-o", tmp]
           + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags())
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError("%s: %s" % (cmd[0], e)) from None
    if out.returncode != 0:
        raise RuntimeError("%s failed:\n%s" % (" ".join(cmd), out.stderr[-2000:]))
    os.replace(tmp, path)


def module():
    """The op library, built if needed; None where it cannot be had (the reason is logged once,
    and kept in :func:`unavailable_reason`)."""
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
        except (OSError, RuntimeError, tf.errors.OpError) as e:
            _loaded["why"] = str(e)
            _log.warning("horovod_twobit: the CPU op for the \"auto\" levels is not available, so "
                         "they are computed with TF ops (the same values, slower): %s. Install a "
                         "C++ compiler (g++) to have it, or set HOROVOD_TWOBIT_NATIVE=0 to "
                         "silence this.", e)
    _loaded["module"] = mod
    return mod


def unavailable_reason():
    return _loaded.get("why")


def usable(rule):
    """Whether the levels of ``rule`` come from the op: a rule it knows, no GPU, the op built."""
    return (wire.parse_rule(rule)[0] in RULES and not tf.config.list_logical_devices("GPU")
            and module() is not None)


def segment_levels(g, b, starts, lengths, rule):
    """(thresholds, magnitudes), float32, of the segments ``[starts[i], starts[i] + lengths[i])``
    (static) of the flat float32 ``b + g``; only where :func:`usable`."""
    name, k = wire.parse_rule(rule)
    factor = tf.constant(float(k) if k else 0.0, tf.float64)  # 0: none
    return module().two_bit_segment_levels(
        g, b, tf.constant(np.asarray(starts, np.int64)), tf.constant(np.asarray(lengths, np.int64)),
        tf.constant(wire.OPT_MULTIPLES, tf.float64), factor, rule=name)
