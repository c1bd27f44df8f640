"""Writes tests/vectors/owner3.json, the test vectors of the scatter exchange's "auto" phase 2
(the owner's 3-bit re-encoding, :func:`horovod_twobit.reference.scatter.owner_quantize`), from
the NumPy reference.

    python tests/vectors/make_owner_vectors.py           # rewrite the file
    python tests/vectors/make_owner_vectors.py --check   # exit 1 if the file is not what this makes

Each case is one owner's chunk of ``words`` packed words (``nvalues`` values) cut into
``pieces`` (segment, member, first value, values, words). Its owner residual starts at zero and
each step, with the chunk's sum ``S`` (float32 as in twobit.json) and the members' NaN/Inf flags
``bad``, must give the pieces' ``scale_bits`` (float32 bits), the ``body`` words after the
header (scales, then the codes k + 3 in count planes), the ``residual`` after the step and the
``decoded`` values k * a.
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from horovod_twobit.reference import scatter as rs  # noqa: E402
from horovod_twobit.wire import scatter as sw  # noqa: E402

sys.path.insert(0, HERE)
import make_vectors  # noqa: E402

PATH = os.path.join(HERE, "owner3.json")
TINY = np.finfo(np.float32).tiny


def _floats(a):
    return [float(x) for x in np.asarray(a, dtype=np.float32).reshape(-1)]


def _case(name, pieces, words, sums, bad=None, note=""):
    n = max(p[2] + p[3] for p in pieces)
    e = np.zeros(n, np.float32)
    members = max(p[1] for p in pieces) + 1
    steps = []
    for i, S in enumerate(sums):
        S = np.zeros(n, np.float32) + np.asarray(S, np.float32)
        flags = list(bad[i]) if bad else [False] * members
        scales, k = rs.owner_quantize(S, e, pieces, flags)
        steps.append({
            "sum": _floats(S), "bad": flags,
            "scale_bits": [int(b) for b in scales.view(np.int32)],
            "body": [int(w) for w in rs.owner_payload(scales, k, words)],
            "residual": _floats(e),
            "decoded": _floats(rs.owner_values(scales, k, pieces)),
        })
    return {"name": name, "pieces": [list(p) for p in pieces], "words": words, "nvalues": n,
            "note": note, "steps": steps}


def _padded(rng, pieces, n, scale):
    S = np.zeros(n, np.float32)
    for _, _, s, length, _ in pieces:
        S[s:s + length] = rng.standard_normal(length) * scale * rng.choice([0.05, 1.0, 20.0], length)
    return S


def build():
    ties = [[3.0, 1.5, 0.5, -1.5, 2.5, -2.5, -0.5, -3.0, 0.0, 1.0, -1.0, 2.0, 0.25, 0.75, 1.25, 0]]
    cases = [
        _case("ties_half_to_even", [(0, 0, 0, 16, 1)], 1, ties,
              note="a = 1: x / a on halves rounds to even (1.5 -> 2, 0.5 -> 0, 2.5 -> 2)"),
        _case("zeros", [(0, 0, 0, 5, 1)], 1, [[0.0] * 5],
              note="all zeros: the smallest normal float32 as scale, every code 0"),
        _case("tiny", [(0, 0, 0, 4, 1)], 1, [np.array([2, -2, 1, 0], np.float32) * TINY],
              note="max / 3 below the smallest normal: the scale is the smallest normal (values "
                   "and residuals stay normal or zero: TensorFlow's CPU kernels flush subnormals)"),
        _case("huge", [(0, 0, 0, 3, 1)], 1, [[3e38, -1e38, 5e37]],
              note="3 * a stays finite: a is rounded down"),
    ]
    rng = np.random.default_rng(20250101)
    pieces = [(0, 0, 0, 40, 3), (1, 0, 48, 48, 3), (2, 1, 96, 33, 3), (3, 2, 144, 1, 1)]
    n = 145
    sums = [_padded(rng, pieces, n, 1.0) for _ in range(4)]
    cases.append(_case("pieces_error_feedback", pieces, 10, sums,
                       note="four pieces of three members, padding between them; four steps"))
    bad = [[False, False, False], [False, True, False], [False, False, False]]
    sums = [_padded(rng, pieces, n, 0.1) for _ in range(3)]
    sums[1][96:129] = np.nan
    cases.append(_case("nonfinite_member", pieces, 10, sums, bad,
                       note="member 1 held NaN or Inf at step 1: scale 0, codes 0, residual kept"))
    one = [(0, 0, 0, 200, 13)]
    cases.append(_case("one_piece_n200", one, 13, [_padded(rng, one, 200, 3.0) for _ in range(3)]))
    return {"format_version": sw.FORMAT_VERSION, "owner_levels": sw.OWNER_LEVELS,
            "generator": "tests/vectors/make_owner_vectors.py (horovod_twobit.reference.scatter)",
            "cases": cases}


def dumps(data):
    return make_vectors.dumps(data)


if __name__ == "__main__":
    make_vectors.main(PATH, build, "make_owner_vectors.py")
