"""Device profiles of the step-time model (:mod:`horovod_twobit.model.steptime`): loading them, and the
seconds of one codec call they give.

A profile's ``codec`` holds, per call (:data:`CODEC_KEYS`), ``[c0, c1, a, b]``: seconds
``c0 + c1 N + n (a + b N)`` for a bucket of ``n`` values among ``N`` ranks. A measured profile
may also hold ``codec_by_size`` (written by :mod:`horovod_twobit.advisor.calibrate`): the per-value rate
measured at several bucket sizes, because a call that fits in the cache runs faster per value than
one that does not::

    "codec_by_size": {"sizes": [65536, ..., 16777216],
                      "keys": {"encode": {"fixed": [c0, c1], "per_value": [[a, b], ...]}, ...}}

There, a call costs ``c0 + c1 N + n (a(n) + b(n) N)`` with ``a(n)``, ``b(n)`` interpolated
linearly in log n between the measured sizes and held at the end points' values beyond them. A
profile without it (older files, the bounds) costs as ``codec`` says. A measured profile may also
hold ``codec_members`` (:func:`horovod_twobit.advisor.calibrate.calibrate` times a bucket of many
members against one tensor of as many values): ``{"keys": {key: [m0, m1]}, ...}``, the seconds
per member beyond the first, ``m0 + m1 N``, that a bucket of ``k`` members adds to a call:
``(k - 1) (m0 + m1 N)``. Without it a bucket costs what one tensor of its values costs. Where
it timed an "auto" bucket of T tables against its twin of one, ``codec_tables``: ``{"tables": T,
"keys": {key: [t0, t1]}}``, the seconds per table of the bucket's segments beyond the first
(:meth:`horovod_twobit.wire.layout.Layout.tables`: one reduction call each), ``(t - 1) (t0 + t1 N)``
for t tables; and where it timed one tensor in many blocks against the compressor's few,
``codec_segments``: ``{"keys": {key: [s0, s1]}, ...}``, the seconds per segment (a block with its
own levels), ``s (s0 + s1 N)`` for a bucket's s segments beyond one tensor's of as many values
(:attr:`~horovod_twobit.wire.layout.Layout.extra_segments`).
"""

import bisect
import json
import math
import os

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
CODEC_KEYS = ("encode", "encode_auto", "finish", "finish_auto", "scatter_encode",
              "scatter_encode_auto", "owner", "owner_auto", "scatter_finish", "scatter_finish_auto")


def load_profile(name_or_path):
    """A profile dict: a path to JSON, or the name of one in horovod_twobit/profiles/ ("cpu",
    "h100-bound", ...)."""
    if isinstance(name_or_path, dict):
        return name_or_path
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(PROFILE_DIR, name_or_path + ".json")
    if not os.path.exists(path):
        raise ValueError("no profile %r (a JSON file, or one of %s)" % (
            name_or_path, ", ".join(profile_names())))
    with open(path) as f:
        prof = json.load(f)
    missing = [k for k in CODEC_KEYS if k not in prof.get("codec", {})]
    if missing:
        raise ValueError("profile %s lacks codec entries %s" % (path, missing))
    by_size = prof.get("codec_by_size")
    if by_size:
        sizes = by_size.get("sizes", [])
        bad = [k for k, v in by_size.get("keys", {}).items()
               if len(v.get("per_value", ())) != len(sizes) or len(v.get("fixed", ())) != 2]
        if not sizes or sorted(sizes) != list(sizes) or bad:
            raise ValueError("profile %s: codec_by_size needs ascending sizes and, per key, "
                             "fixed [c0, c1] and one [a, b] per size (bad: %s)" % (path, bad))
    for entry, what in (("codec_members", "[m0, m1]"), ("codec_tables", "[t0, t1]"),
                        ("codec_segments", "[s0, s1]")):
        per = prof.get(entry)
        if per:
            bad = [k for k, v in per.get("keys", {}).items() if len(v) != 2 or min(v) < 0]
            if bad or not per.get("keys"):
                raise ValueError("profile %s: %s needs, per key, %s >= 0 (bad: %s); calibrate "
                                 "again (python -m horovod_twobit.advise calibrate)"
                                 % (path, entry, what, bad or "no keys"))
    return prof


def profile_names():
    try:
        return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
    except OSError:
        return []


def per_value_at(sizes, per_value, values):
    """``[a, b]`` at ``values`` from the rates measured at ``sizes`` (ascending): linear in
    log(values) between two measured sizes, the nearest end point's beyond them."""
    if values <= sizes[0]:
        return list(per_value[0])
    if values >= sizes[-1]:
        return list(per_value[-1])
    k = bisect.bisect_right(sizes, values)
    lo, hi = sizes[k - 1], sizes[k]
    w = (math.log(values) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return [(1 - w) * p + w * q for p, q in zip(per_value[k - 1], per_value[k])]


def codec_coefficients(prof, key, values):
    """``(c0, c1, a, b)`` of one codec call on a bucket of ``values`` values: the size-dependent
    rate where the profile measured one for ``key``, else its ``codec`` entry."""
    by_size = prof.get("codec_by_size")
    entry = by_size and by_size["keys"].get(key)
    if not entry:
        return tuple(prof["codec"][key])
    a, b = per_value_at(by_size["sizes"], entry["per_value"], values)
    return entry["fixed"][0], entry["fixed"][1], a, b


def codec_s(prof, key, values, nranks, members=1, tables=1, segments=0):
    """Seconds of one codec call on a bucket of ``values`` values in ``members`` tensors among
    ``nranks`` ranks: ``c0 + c1 N + values (a + b N)`` with the profile's coefficients (at that
    size, where it has them by size), plus ``(members - 1) (m0 + m1 N)`` where the profile
    measured a cost per member (``codec_members``), ``(tables - 1) (t0 + t1 N)`` where it
    measured one per table of an "auto" bucket's segments (``codec_tables``) and ``segments (s0
    + s1 N)`` for the ``segments`` beyond one tensor's where it measured one per segment
    (``codec_segments``)."""
    c0, c1, a, b = codec_coefficients(prof, key, values)
    secs = max(0.0, c0 + c1 * nranks + values * (a + b * nranks))
    for entry, count in (("codec_members", members - 1), ("codec_tables", tables - 1),
                         ("codec_segments", segments)):
        per = (prof.get(entry) or {}).get("keys", {}).get(key)
        if per and count > 0:
            secs += count * (per[0] + per[1] * nranks)
    return secs


def bandwidth_bound_profile(name, bytes_per_s, source, call_s=3e-5, message_s=1e-5):
    """A profile whose codec runs at a device's memory bandwidth (``bytes_per_s``): a lower bound
    on its time, not a measurement. Bytes per value: encode reads g and r and writes 2 bits
    (8.25); "auto" reads them once more for its levels (16.25); the finish reads g, r and N
    payloads of 2 bits and writes the result and r (16 + N / 4); the scatter owner reads N chunks
    of 2 bits per value of its chunk and writes the counts; the reductions read two operands and
    write one. ``call_s``: a few kernel launches per call (an assumption, not measured)."""
    s = 1.0 / bytes_per_s
    return {
        "name": name, "kind": "bound", "source": source, "serial": False,
        "note": "memory-bandwidth bound: the codec's bytes per value at %.3g TB/s; not a "
                "measurement" % (bytes_per_s / 1e12),
        "codec": {
            "encode": [call_s, 0, 8.25 * s, 0], "encode_auto": [2 * call_s, 0, 16.25 * s, 0],
            "finish": [call_s, 0, 16 * s, 0.25 * s], "finish_auto": [call_s, 0, 16 * s, 0.25 * s],
            "scatter_encode": [call_s, 0, 8.5 * s, 0], "scatter_encode_auto": [2 * call_s, 0, 16.5 * s, 0],
            "owner": [call_s, 0, 0.5 * s, 0], "owner_auto": [2 * call_s, 0, 8.5 * s, 0],
            "scatter_finish": [call_s, 0, 17 * s, 0], "scatter_finish_auto": [call_s, 0, 16.5 * s, 0]},
        "sum_fp32_s": 12 * s, "sum_fp16_s": 6 * s, "cast_fp16_s": 6 * s, "copy_s_per_byte": 2 * s,
        "optimizer_s": 16 * s, "powersgd_s": 4 * s, "kernel_s_per_byte": 0.0,
        "message_s": message_s,
    }
