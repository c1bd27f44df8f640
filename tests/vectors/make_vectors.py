"""Writes tests/vectors/twobit.json, the test vectors both bindings are checked against, from the
NumPy reference (horovod_twobit.reference).

    python tests/vectors/make_vectors.py           # rewrite the file
    python tests/vectors/make_vectors.py --check   # exit 1 if the file is not what this script makes

Every float is a float32 value written as the shortest decimal that reads back to the same float32
bits through a double (so JSON keeps it exactly); ``words`` are signed int32 values; ``bytes`` is
the payload in memory order (little-endian words), as hex. Each case starts from a zero residual and
applies ``steps`` in order: ``encode(grad, residual, threshold)`` must return ``words`` and leave
``residual``; ``decode(words, numel, threshold)`` must return ``decoded``.

``auto_cases`` are the same for ``threshold="auto"``: each step first chooses
``threshold, magnitude = auto_levels(residual + grad, rule)`` (``threshold_bits`` and
``magnitude_bits``: their float32 bits; the magnitude is the header's word 4, and equals the
threshold for every rule but ``lsq``), then encodes with both and decodes with the magnitude.
"""

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from horovod_twobit import reference as ref  # noqa: E402
from horovod_twobit import wire  # noqa: E402

PATH = os.path.join(HERE, "twobit.json")


def _floats(a):
    return [float(x) for x in np.asarray(a, dtype=np.float32).reshape(-1)]


def _case(name, threshold, grads, note=""):
    n = len(grads[0])
    r = np.zeros(n, np.float32)
    steps = []
    for g in grads:
        g = np.asarray(g, dtype=np.float32)
        words = ref.encode(g, r, threshold)
        steps.append({
            "grad": _floats(g),
            "words": [int(w) for w in words],
            "bytes": words.astype("<i4").tobytes().hex(),
            "residual": _floats(r),
            "decoded": _floats(ref.decode(words, n, threshold)),
        })
    return {"name": name, "threshold": threshold, "numel": n, "note": note, "steps": steps}


def _auto_case(name, rule, grads, note=""):
    n = len(grads[0])
    r = np.zeros(n, np.float32)
    steps = []
    for g in grads:
        g = np.asarray(g, dtype=np.float32)
        t, v = (np.float32(y) for y in ref.auto_levels(r + g, rule))
        words = ref.encode(g, r, t, v)
        steps.append({
            "grad": _floats(g),
            "threshold": float(t),
            "threshold_bits": int(t.view(np.int32)),
            "magnitude_bits": int(v.view(np.int32)),
            "words": [int(w) for w in words],
            "residual": _floats(r),
            "decoded": _floats(ref.decode(words, n, v)),
        })
    return {"name": name, "threshold": "auto", "rule": rule, "numel": n, "note": note,
            "steps": steps}


def build():
    cases = [
        _case("layout_0xE3", 0.5, [[0.5, -0.5, 0.0, 0.7]],
              "codes 11,10,00,11 fill the first byte high bits first: 0xE3; 0.7 leaves 0.2"),
        _case("exact_threshold", 0.25, [[0.25, -0.25, 0.2499999, -0.2499999, 0.0, -0.0, 1.0, -1.0]] * 2,
              "r >= t and r <= -t are inclusive; values far above send one t per step"),
        _case("error_feedback", 0.5, [[0.3] * 5, [0.3] * 5, [0.3] * 5, [-0.9] * 5],
              "0.3 + 0.3 crosses 0.5 on the second step and leaves 0.1"),
    ]
    rng = np.random.default_rng(20240601)
    for n, t in [(0, 0.5), (1, 0.5), (15, 0.1), (16, 0.5), (17, 1e-3), (100, 0.1)]:
        grads = [(rng.standard_normal(n) * t * rng.choice([0.1, 0.7, 3.0], n)).astype(np.float32)
                 for _ in range(3)]
        cases.append(_case("random_n%d_t%g" % (n, t), t, grads))
    auto = [_auto_case("auto_zeros", "mean", [[0.0] * 5],
                       "all zeros: the smallest normal float32, so nothing is sent"),
            _auto_case("auto_empty", "mean", [[]], "an empty tensor: 1.0")]
    for rule in ("opt", "mean", "rms", "lsq"):
        for n in (1, 17, 100):
            grads = [(rng.standard_normal(n) * rng.choice([0.001, 0.1, 3.0], n)).astype(np.float32)
                     for _ in range(3)]
            auto.append(_auto_case("auto_%s_n%d" % (rule, n), rule, grads))
    return {"format_version": wire.FORMAT_VERSION, "values_per_word": wire.VALUES_PER_WORD,
            "generator": "tests/vectors/make_vectors.py (horovod_twobit.reference)",
            "cases": cases, "auto_cases": auto}


def dumps(data):
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def main(path=PATH, make=None, script="make_vectors.py"):
    """Writes ``path`` from ``make()`` (default: :func:`build`), or with ``--check`` exits 1 if
    the file is not what it makes."""
    text = dumps((make or build)())
    if "--check" in sys.argv[1:]:
        with open(path) as f:
            same = f.read() == text
        print("%s is %s" % (path, "up to date" if same else "STALE: run %s" % script))
        sys.exit(0 if same else 1)
    with open(path, "w") as f:
        f.write(text)
    print("wrote %s" % path)


if __name__ == "__main__":
    main()
