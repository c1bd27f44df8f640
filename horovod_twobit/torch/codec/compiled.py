"""When a codec body runs compiled: the registry of bodies (``BODIES``: plain torch functions, added
by :mod:`.kernels`, :mod:`.levels`, the scatter codecs and the stats) and the choice, per call,
between a body's ``torch.compile``d form and the body itself.

A call on at least ``COMPILE_MIN_NUMEL`` values (``HOROVOD_TWOBIT_COMPILE_MIN_NUMEL``, default
65 536) runs compiled (Inductor fuses a body into one vectorized loop), a smaller one eagerly;
within :func:`sized_as` a call decides as if it held that many values. ``HOROVOD_TWOBIT_COMPILE=0``
turns compilation off, and so does the first compilation that fails (with one warning): both forms
give the same bits, the eager one more slowly. Compilations are dynamic in the tensors' lengths,
once per (body, dtype, device)."""

import contextlib
import os
import re
import threading
import types
import warnings

import torch

COMPILE_MIN_NUMEL = int(os.environ.get("HOROVOD_TWOBIT_COMPILE_MIN_NUMEL", 1 << 16))
BODIES = {}
_lock = threading.Lock()
_compiled = {}
disabled = os.environ.get("HOROVOD_TWOBIT_COMPILE", "1") == "0"


def _fn(name, key=None):
    """The compiled body, or the eager one when compilation is off or failed. ``key`` separates
    compilations (the number of ranks' rows: guards on list lengths are not reliable in Dynamo)."""
    body = BODIES[name]
    if disabled:
        return body
    with _lock:
        fn = _compiled.get((name, key))
        if fn is None:
            if key is not None:  # a code object of its own: Dynamo caches per code object
                code = body.__code__.replace(co_name="%s_%s" % (body.__name__, key))
                body = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__,
                                          body.__closure__)
            fn = _compiled[(name, key)] = torch.compile(
                body, dynamic=True, options=_EXACT_DIVISION if exact_division() else None)
    return fn


_EXACT_DIVISION = {"eager_numerics.division_rounding": True}
_exact = []


def exact_division():
    """Whether this torch's Inductor can divide float32 correctly rounded in Triton (its option
    ``eager_numerics.division_rounding``; Triton's own division is approximate, up to 2 ulp).
    Every compilation then asks for it; on a CPU it changes nothing."""
    if not _exact:
        try:
            from torch._inductor import config
            _exact.append(all(k in config.get_config_copy() for k in _EXACT_DIVISION))
        except Exception:  # no Inductor: no compiled path either
            _exact.append(False)
    return _exact[0]


def run(name, *args):
    """Body ``name`` on ``args``, compiled (once per body, and per length of a list as its first
    argument) unless compilation is off or fails."""
    global disabled
    if not disabled:
        try:
            return _fn(name, len(args[0]) if isinstance(args[0], list) else None)(*args)
        except Exception as e:  # no compiler, unsupported device, ...: same bits, eagerly
            disabled = True
            warnings.warn("horovod-twobit: torch.compile is unavailable (%s: %s); using the eager "
                          "codec, which gives the same results more slowly" % (type(e).__name__, e))
    return BODIES[name](*args)


_sized = threading.local()


@contextlib.contextmanager
def sized_as(numel):
    """Within it, this thread's calls choose compiled or eager bodies as if their tensors held at
    least ``numel`` values. The scatter exchange works a bucket in N chunks: a bucket of 262 K
    values among 8 ranks has chunks of 32 K values, below COMPILE_MIN_NUMEL, whose eager owner
    sum and finish cost 3-4x the compiled ones (0.96 against 0.35 ms, 1.67 against 0.38 ms on
    one CPU thread)."""
    old = getattr(_sized, "numel", 0)
    _sized.numel = max(old, numel)
    try:
        yield
    finally:
        _sized.numel = old


def compiles(numel):
    """Whether a call on ``numel`` values runs its compiled body: from COMPILE_MIN_NUMEL values
    (counting :func:`sized_as`), unless compilation is off or unavailable."""
    return max(numel, getattr(_sized, "numel", 0)) >= COMPILE_MIN_NUMEL and not disabled


def call(name, numel, *args):
    """The compiled body where :func:`compiles`, else the eager one."""
    if compiles(numel):
        return run(name, *args)
    return BODIES[name](*args)


# ----------------------------------------------------------------- the Triton kernels (CUDA)
# HOROVOD_TWOBIT_TRITON: "1" (default) the Triton kernels (.triton_kernels) run the codec's passes
# on CUDA tensors where Triton imports; "0" never (the compiled bodies above run there, as on a
# CPU); "force" on every device (the suite runs them on CPU tensors under TRITON_INTERPRET=1).
TRITON = os.environ.get("HOROVOD_TWOBIT_TRITON", "1")
_triton = []


# The oldest Triton the kernels compile with: 3.3 cannot index a tuple of constexprs inside a
# kernel; 3.4, 3.5, 3.6 and 3.7 give the reference's bits through the interpreter and compile
# for sm_80 and sm_90 (docs/codec_speed.md, "Triton versions")
TRITON_MIN = (3, 4)


def triton_supported(version):
    """Whether Triton ``version`` (e.g. "3.6.0", "3.4.0+git1234") runs the codec's kernels."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return m is not None and (int(m.group(1)), int(m.group(2))) >= TRITON_MIN


def triton_path(device):
    """The :mod:`.triton_kernels` module where it runs the passes for tensors on ``device``, else
    None. Imported on first use only, so the codec needs no Triton where it never runs them."""
    if TRITON == "0" or (device.type != "cuda" and TRITON != "force"):
        return None
    if not _triton:
        try:
            import triton
            version = getattr(triton, "__version__", "")
            if not triton_supported(version):
                least = "%d.%d" % TRITON_MIN
                warnings.warn("horovod-twobit: Triton %s is older than %s, the oldest the codec's "
                              "kernels compile with (torch 2.8 and later ship one); the codec "
                              "runs its compiled torch ops on %s. Upgrade torch, or pip install "
                              "'triton>=%s'" % (version, least, device.type, least))
                triton_kernels = None
            else:
                from horovod_twobit.torch.codec import triton_kernels
        except ImportError as e:  # a torch built without Triton: the compiled bodies
            warnings.warn("horovod-twobit: Triton does not import (%s); the codec runs its "
                          "compiled torch ops on %s" % (e, device.type))
            triton_kernels = None
        _triton.append(triton_kernels)
    return _triton[0]

