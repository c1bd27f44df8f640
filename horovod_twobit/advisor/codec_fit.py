"""The fits of a calibration's timed codec calls (:mod:`horovod_twobit.advisor.calibrate`): per call,
seconds ``c0 + c1 N + n (a + b N)`` (:func:`_fit`), the per-value rate by size
(:func:`_fit_by_size`), the cost per member of a bucket (:func:`_fit_members`) and per table of an
"auto" bucket's segments (:func:`_fit_tables`) and per segment (:func:`_fit_segments`);
:func:`refit` fits a profile's points again.
NumPy only."""


def _nonneg_lstsq(A, y):
    """Least squares of A x = y with every x >= 0 (the most negative one dropped until none)."""
    import numpy as np
    keep = list(range(A.shape[1]))
    while True:
        coef = np.zeros(A.shape[1])
        sol, *_ = np.linalg.lstsq(A[:, keep], y, rcond=None)
        coef[keep] = sol
        neg = [k for k in keep if coef[k] < 0]
        if not neg:
            return [float(c) for c in coef]
        keep.remove(min(neg, key=lambda k: coef[k]))


def _fit(points):
    """Least-squares (c0, c1, a, b) of seconds = c0 + c1 N + n (a + b N), each >= 0."""
    import numpy as np
    A = np.array([[1.0, N, n, n * N] for n, N, _ in points])
    return _nonneg_lstsq(A, np.array([s for _, _, s in points]))


def _fit_by_size(points):
    """The fixed cost ``[c0, c1]`` of the two smallest sizes timed (the :func:`_fit` line through
    them: in cache, where a call's time is c0 + c1 N + n (a + b N)) and, per size timed
    (ascending), the per-value rate ``[a, b]`` of seconds - c0 - c1 N = n (a_n + b_n N), each
    >= 0: the codec's rate at that size over the same fixed cost."""
    import numpy as np
    sizes = sorted({n for n, _, _ in points})
    c0, c1, _, _ = _fit([p for p in points if p[0] in sizes[:2]])
    per_value = []
    for n in sizes:
        at = [(N, secs) for m, N, secs in points if m == n]
        A = np.array([[1.0, N] for N, _ in at])
        y = np.array([(secs - c0 - c1 * N) / n for N, secs in at])
        per_value.append(_nonneg_lstsq(A, y))
    return {"fixed": [c0, c1], "per_value": per_value}


def _fit_members(points, bucket):
    """``{"members", "values", "keys": {key: [m0, m1]}}``: each codec call's seconds per member
    of a bucket beyond the first, ``m0 + m1 N``, each >= 0, from the bucket of
    ``bucket["members"]`` members and ``bucket["values"]`` values timed at each N
    (``bucket["points"]``: {key: [(N, seconds)]}) against one tensor of as many values at the
    same N (``points``, :func:`calibrate`'s): what a call does per member (a member's offsets,
    flags and levels' segments) that a one-tensor call at the same size does not."""
    import numpy as np
    M, n = int(bucket["members"]), int(bucket["values"])
    keys = {}
    for key, timed in bucket["points"].items():
        one = {int(N): secs for m, N, secs in points[key] if int(m) == n}
        at = [(int(N), (secs - one[int(N)]) / (M - 1)) for N, secs in timed if int(N) in one]
        if not at:
            raise ValueError("the bucket of %d members was timed at N = %s, one tensor of %d "
                             "values at none of them" % (M, [N for N, _ in timed], n))
        A = np.array([[1.0, N] for N, _ in at])
        keys[key] = _nonneg_lstsq(A, np.array([d for _, d in at]))
    return {"members": M, "values": n, "keys": keys}


def _per_unit(points, units):
    """{key: [u0, u1]}: seconds per unit, ``u0 + u1 N``, each >= 0, of points ``{key: [(N,
    seconds with more, seconds with fewer)]}`` that differ by ``units`` units."""
    import numpy as np
    keys = {}
    for key, at in points.items():
        A = np.array([[1.0, N] for N, _, _ in at])
        keys[key] = _nonneg_lstsq(A, np.array([(a - b) / units for _, a, b in at]))
    return keys


def _fit_tables(timed):
    """``{"tables", "keys": {key: [t0, t1]}}``: each "auto" codec call's seconds per table of
    segments beyond the first (:meth:`horovod_twobit.wire.layout.Layout.tables`: one reduction call
    each), ``t0 + t1 N``, each >= 0, from ``timed`` = ``{"tables": T, "numels", "points": {key:
    [(N, seconds of a bucket of T tables, seconds of its twin of one table)]}}``: the twin has as
    many members and values, all of one length (:func:`horovod_twobit.advisor.calibrate.table_numels`)."""
    T = int(timed["tables"])
    return {"tables": T, "keys": _per_unit(timed["points"], T - 1)}


def _fit_segments(timed):
    """``{"values", "segments", "keys": {key: [s0, s1]}}``: each "auto" codec call's seconds per
    segment (a block with its own levels), ``s0 + s1 N``, each >= 0, from ``timed`` =
    ``{"values": n, "segments": [many, base], "points": {key: [(N, seconds in many segments,
    seconds in base segments)]}}``: one tensor of n values cut two ways."""
    many, base = (int(k) for k in timed["segments"])
    return {"values": int(timed["values"]), "segments": [many, base],
            "keys": _per_unit(timed["points"], many - base)}


def refit(prof):
    """``prof`` with its ``codec``, ``codec_by_size`` and (where it timed a bucket of members,
    of tables, a tensor in segments) ``codec_members``, ``codec_tables`` and ``codec_segments``
    fitted again from its timed points (a profile written before the fits changed, or with
    points added)."""
    points = {k: [tuple(p) for p in v] for k, v in prof["points"].items()}
    prof = dict(prof, codec={k: _fit(v) for k, v in points.items()})
    prof["codec_by_size"] = {"sizes": sorted({n for v in points.values() for n, _, _ in v}),
                             "keys": {k: _fit_by_size(v) for k, v in points.items()}}
    if prof.get("member_points"):
        prof["codec_members"] = _fit_members(points, prof["member_points"])
    if prof.get("table_points"):
        prof["codec_tables"] = _fit_tables(prof["table_points"])
    if prof.get("segment_points"):
        prof["codec_segments"] = _fit_segments(prof["segment_points"])
    return prof
