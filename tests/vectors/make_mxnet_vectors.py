"""Writes tests/vectors/mxnet_2bit.json: what MXNet 1.9.1's own 2-bit gradient compression computes,
recorded once so that the tests can hold the NumPy reference and both bindings to it
(tests/test_mxnet_fixture.py). MXNet is not a dependency of this project: run this script with a
Python that has it, in a virtual environment of its own:

    python3 -m venv /tmp/mxvenv
    /tmp/mxvenv/bin/pip install mxnet==1.9.1 numpy==1.23.5
    /tmp/mxvenv/bin/python tests/vectors/make_mxnet_vectors.py           # rewrite the file
    /tmp/mxvenv/bin/python tests/vectors/make_mxnet_vectors.py --check   # exit 1 if it differs

Two of MXNet's paths are recorded.

``cases``: MXNet's compression object itself, ``mxnet::kvstore::GradientCompression`` of
libmxnet.so, set up with ``SetTwoBitCompression(threshold)`` and driven through its exported
``Quantize(grad, &compressed, &residual, priority)`` and ``Dequantize(compressed, &out, priority)``
(the calls every kvstore push with ``set_gradient_compression({'type': '2bit', ...})`` makes,
reached with ctypes on CPU NDArrays, since MXNet's Python API does not expose them). One residual
per case, zero at first, carried from step to step by MXNet. Each step records the gradient, the
compressed array (MXNet's float32 container, read back through a uint32 bit view: ``words``, and
its bytes in memory order: ``bytes``), the residual MXNet left, and MXNet's dequantized values.

``sender_cases``: ``mx.kv.create('device')`` with ``set_gradient_compression({'type': '2bit',
'threshold': t})``; each step pushes one gradient per sender (one CPU context each) under one key
and pulls the key: MXNet quantizes every sender's gradient with that sender's residual,
dequantizes each and sums them (``sum``). The senders' ``words`` and ``residual`` are the same
gradients run through the compression object above, one residual per sender, and this script
checks that they decode to the kvstore's sum, so the two paths agree.

``edge_cases``: as ``cases``, through the compression object, for subnormal gradients and
residuals, a subnormal threshold (1e-40), and NaN and infinities.

Every float is a float32, written as its bit pattern in 8 hex digits (``3f000000`` is 0.5), so
comparisons are bit for bit; ``words`` are the uint32 values of the packed words. The gradients are
made with a seeded NumPy generator, some of them chosen from MXNet's residual so that residual +
gradient lands exactly on +t or -t.
"""

import ctypes
import json
import os
import re
import sys

import numpy as np
import mxnet as mx

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "mxnet_2bit.json")
COMMAND = ("python3 -m venv /tmp/mxvenv && /tmp/mxvenv/bin/pip install mxnet==1.9.1 numpy==1.23.5"
           " && /tmp/mxvenv/bin/python tests/vectors/make_mxnet_vectors.py")

THRESHOLDS = (0.5, 0.05, 0.3)
SIZES = (1, 15, 17, 100)
STEPS = 4
SEED = 20240917

_LIB = mx.base._LIB
_SYM = "_ZN5mxnet7kvstore19GradientCompression"


def _fn(name, restype, *argtypes):
    f = getattr(_LIB, _SYM + name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


_P = ctypes.c_void_p
_ctor = _fn("C1Ev", None, _P)
_set_two_bit = _fn("20SetTwoBitCompressionEf", None, _P, ctypes.c_float)
_get_type = _fn("8get_typeEv", ctypes.c_int, _P)
_compressed_size = _fn("17GetCompressedSizeEl", ctypes.c_int64, _P, ctypes.c_int64)
_quantize = _fn("8QuantizeERKNS_7NDArrayEPS2_S5_i", None, _P, _P, _P, _P, ctypes.c_int)
_dequantize = _fn("10DequantizeERKNS_7NDArrayEPS2_i", None, _P, _P, _P, ctypes.c_int)


class Compression:
    """An ``mxnet::kvstore::GradientCompression`` set to 2-bit with ``threshold``."""

    def __init__(self, threshold):
        # room for the object (a vtable pointer, the type and the threshold) and more; never freed
        # by MXNet, only by Python, and it owns nothing
        self._mem = (ctypes.c_uint64 * 32)()
        self.ptr = ctypes.cast(self._mem, _P)
        _ctor(self.ptr)
        _set_two_bit(self.ptr, threshold)
        assert _get_type(self.ptr) != 0, "SetTwoBitCompression left the type at kNone"

    def words(self, numel):
        return int(_compressed_size(self.ptr, numel))

    def quantize(self, grad, compressed, residual):
        """MXNet's Quantize: residual += grad, compressed = codes, residual -= sent values."""
        _quantize(self.ptr, grad.handle, compressed.handle, residual.handle, 0)

    def dequantize(self, compressed, out):
        _dequantize(self.ptr, compressed.handle, out.handle, 0)


def _hex(a):
    return ["%08x" % int(x) for x in np.asarray(a, dtype=np.float32).reshape(-1).view(np.uint32)]


def _bits(x):
    return int(np.float32(x).view(np.uint32))


class Sender:
    """One residual on MXNet's side, zero at first; ``step`` quantizes and dequantizes a gradient."""

    def __init__(self, threshold, numel):
        self.gc = Compression(threshold)
        self.numel = numel
        self.residual = mx.nd.zeros((numel,), dtype="float32")
        assert self.gc.words(numel) == -(-numel // 16)

    def step(self, g):
        grad = mx.nd.array(g, dtype="float32")
        compressed = mx.nd.zeros((self.gc.words(self.numel),), dtype="float32")
        out = mx.nd.zeros((self.numel,), dtype="float32")
        self.gc.quantize(grad, compressed, self.residual)
        self.gc.dequantize(compressed, out)
        mx.nd.waitall()
        container = compressed.asnumpy()
        assert container.dtype == np.float32
        return {
            "grad": _hex(g),
            "words": [int(w) for w in container.view(np.uint32)],
            "bytes": container.tobytes().hex(),
            "residual": _hex(self.residual.asnumpy()),
            "decoded": _hex(out.asnumpy()),
        }, out.asnumpy()


def _special(t, n):
    """The first gradient's first values: exactly +-t, the float32 neighbours of t, zeros of both
    signs, multiples of t (sent over several steps). Subnormals are in ``edge_cases``."""
    t = np.float32(t)
    below, above = np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(np.inf))
    vals = [t, -t, below, -below, above, -above, np.float32(0.0), np.float32(-0.0),
            2 * t, -3 * t, np.float32(0.5) * t]
    return np.array(vals, dtype=np.float32)[:n]


def _grad(rng, t, n, step, residual):
    """A gradient for ``step``: normal values of a scale that changes with the step, the special
    values first on step 0, and on later steps a few values that make residual + gradient exactly
    +t or -t (in float32, as MXNet adds)."""
    scale = (0.8, 0.3, 2.5, 1.0)[step % 4]
    g = (rng.standard_normal(n) * np.float32(t * scale)).astype(np.float32)
    if step == 0:
        s = _special(t, n)
        g[:s.size] = s
    else:
        t32 = np.float32(t)
        for k, i in enumerate(range(step % 3, n, 5)):
            target = t32 if k % 2 == 0 else -t32
            cand = np.float32(target - residual[i])
            if np.float32(residual[i] + cand) == target:
                g[i] = cand
    return g


def single_case(rng, t, n):
    sender = Sender(t, n)
    steps = []
    for step in range(STEPS):
        g = _grad(rng, t, n, step, sender.residual.asnumpy())
        steps.append(sender.step(g)[0])
    return {"name": "n%d_t%g" % (n, t), "numel": n, "threshold": t, "threshold_bits": _bits(t),
            "steps": steps}


def edge_case(name, t, grads):
    sender = Sender(t, len(grads[0]))
    steps = [sender.step(np.array(g, dtype=np.float32))[0] for g in grads]
    return {"name": name, "numel": len(grads[0]), "threshold": t, "threshold_bits": _bits(t),
            "steps": steps}


def edge_cases():
    """Subnormal gradients and residuals, a subnormal threshold, NaN and infinities."""
    tiny = np.float32(np.finfo(np.float32).tiny)  # the smallest normal float32, 2^-126
    sub = [1e-45, -1e-45, 1e-40, -1e-40, 1.1754942e-38, -5e-41]
    subnormal = [
        sub + [1.5 * tiny, 0.7, -0.3, 0.0],
        sub + [-tiny, -0.7, 0.3, -0.0],      # 2^-127 left in the residual; 0.7 - 0.7 = 0
        sub + [0.0, 0.5, -0.5, 1e-45],
    ]
    small_t = [0.0, -0.0, 1e-40, -1e-40, 5e-41, -5e-41, 2e-40, 1e-45, 0.25, -0.25,
               np.nextafter(np.float32(1e-40), np.float32(0)), 1e-39, -3e-40, 1e-38, 0.0, 1e-40,
               -1e-40]
    nonfinite = [
        [np.nan, np.inf, -np.inf, 0.7, -0.7, 0.2, 0.0],
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, np.nan],
        [0.1, -np.inf, np.inf, 0.1, 0.1, 0.4, 0.0],
    ]
    return [
        edge_case("subnormal_grads_t0.5", 0.5, subnormal),
        edge_case("subnormal_threshold_t1e-40", 1e-40, [small_t, small_t[::-1]]),
        edge_case("nonfinite_t0.5", 0.5, nonfinite),
    ]


def sender_case(rng, t, n, senders):
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": t})
    key = 7
    kv.init(key, mx.nd.zeros((n,), dtype="float32"))
    ctxs = [mx.cpu(i) for i in range(senders)]
    mine = [Sender(t, n) for _ in range(senders)]
    steps = []
    for step in range(STEPS):
        grads = [_grad(rng, t, n, step, s.residual.asnumpy()) for s in mine]
        if step == 0 and senders > 1:  # opposite values on two senders: sums that cancel
            grads[1][:min(n, 4)] = -grads[0][:min(n, 4)]
        kv.push(key, [mx.nd.array(g, ctx=c, dtype="float32") for g, c in zip(grads, ctxs)])
        out = mx.nd.zeros((n,), dtype="float32")
        kv.pull(key, out=out)
        mx.nd.waitall()
        total = out.asnumpy()
        recs = [s.step(g) for s, g in zip(mine, grads)]
        mine_sum = np.zeros(n, np.float32)
        for _, dec in recs:
            mine_sum += dec
        assert mine_sum.view(np.uint32).tolist() == total.view(np.uint32).tolist(), \
            "the compression object and the kvstore disagree (%s, n=%d, step %d)" % (t, n, step)
        steps.append({
            "grads": [r["grad"] for r, _ in recs],
            "words": [r["words"] for r, _ in recs],
            "residual": [r["residual"] for r, _ in recs],
            "sum": _hex(total),
        })
    return {"name": "senders%d_n%d_t%g" % (senders, n, t), "numel": n, "threshold": t,
            "threshold_bits": _bits(t), "senders": senders, "steps": steps}


def build():
    rng = np.random.default_rng(SEED)
    cases = [single_case(rng, t, n) for t in THRESHOLDS for n in SIZES]
    senders = [sender_case(rng, t, n, k) for t, n, k in
               [(0.5, 1, 2), (0.5, 17, 2), (0.3, 100, 3), (0.05, 15, 2)]]
    assert any(int(w) for c in cases for s in c["steps"] for w in s["words"])
    return {
        "mxnet_version": mx.__version__,
        "command": COMMAND,
        "generator": "tests/vectors/make_mxnet_vectors.py",
        "numpy_version": np.__version__,
        "seed": SEED,
        "source": {
            "cases": "mxnet::kvstore::GradientCompression (SetTwoBitCompression, Quantize, "
                     "Dequantize) of libmxnet.so on CPU NDArrays",
            "sender_cases": "mx.kv.create('device').set_gradient_compression({'type': '2bit', "
                            "'threshold': t}); push one gradient per sender (mx.cpu(i)), pull",
        },
        "format": "floats: float32 bit patterns as 8 hex digits; words: uint32 values of MXNet's "
                  "float32 container; bytes: the container in memory order, as hex",
        "cases": cases,
        "sender_cases": senders,
        "edge_cases": edge_cases(),
    }


def dumps(data):
    """JSON with every list of numbers or strings on one line."""
    text = json.dumps(data, indent=1)
    flat = re.compile(r"\[\n\s*([^\[\]{}]*?)\n\s*\]")
    return flat.sub(lambda m: "[" + " ".join(x.strip() for x in m.group(1).split("\n")) + "]",
                    text) + "\n"


def main():
    text = dumps(build())
    if "--check" in sys.argv[1:]:
        with open(PATH) as f:
            same = f.read() == text
        print("%s is %s" % (PATH, "up to date" if same else "STALE"))
        sys.exit(0 if same else 1)
    with open(PATH, "w") as f:
        f.write(text)
    print("wrote %s (%d bytes)" % (PATH, len(text)))


if __name__ == "__main__":
    main()
