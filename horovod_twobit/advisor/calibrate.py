"""A device profile for the step-time model (:mod:`horovod_twobit.model.steptime`) measured on this
machine: ``python -m horovod_twobit.advise calibrate``. Each codec call is timed with the
project's own PyTorch codec functions at bucket sizes that span the cache and fitted as
``c0 + c1 N + n (a + b N)``, and as ``c0 + c1 N + n (a(n) + b(n) N)`` with a per-value rate for
each size timed (``codec_by_size``, :mod:`horovod_twobit.model.device`); the other costs
the model takes per value (sums, copies, casts, the optimizer), per byte (the kernel's TCP work)
and per message are timed alike (the clocks and the timed calls:
:mod:`horovod_twobit.advisor.timing`; the fits: :mod:`horovod_twobit.advisor.codec_fit`)."""

import json
import os

from horovod_twobit.wire import layout as _layout
from horovod_twobit import wire as _wire
from horovod_twobit.advisor.timing import (CLOCKS, _Timer, _clock_name, _cpu_name, _median_time,
    _time_codec, _time_network, _time_per_value)
from horovod_twobit.advisor.codec_fit import (_fit, _fit_by_size, _fit_members, _fit_segments,
    _fit_tables, _nonneg_lstsq, refit)
from horovod_twobit.model.steptime import CODEC_KEYS


SIZES = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
MEMBERS = 64  # the bucket whose members' cost is timed: this many members
TABLES = 3  # the "auto" bucket whose cost per table of segments is timed: this many tables
SEGMENT_VALUES = 1 << 16  # the "auto" tensor whose cost per segment is timed: this many values


def calibrate(path=None, sizes=SIZES, ranks=(2, 4, 8), threads=1, compiled=True,
              reps=5, name="cpu", clock="cpu", dilation=1.0, min_wall_s=0.25, device="cpu",
              members=MEMBERS, tables=TABLES, segment_values=SEGMENT_VALUES):
    """Measures this machine's codec rates with the project's own codec functions (PyTorch,
    ``threads`` threads; as a step runs them: eager below the codec's switch to its compiled
    bodies, ``COMPILE_MIN_NUMEL`` values, compiled from there, a size just below the switch
    timed too where ``sizes`` straddle it (:func:`timed_sizes`); every size eager with
    ``compiled=False``; the ones ``horovod_twobit.benchmarks.codec`` times, plus the "auto" and
    scatter ones) and the costs the model takes per value (sums, copies, casts, the optimizer,
    the kernel's TCP work per byte, the software latency of a message). Each codec call is fitted as ``c0 + c1 N + n (a + b N)`` from
    the sizes and rank counts timed, and by size (:func:`_fit_by_size`); its cost per member of
    a bucket from a bucket of ``members`` members (:func:`_fit_members`; 0 or 1: not timed);
    an "auto" call's cost per table of segments from a bucket of ``tables`` tables against its
    twin of one (:func:`table_numels`, :func:`_fit_tables`; 0 or 1: not timed); and its cost
    per segment from one tensor of ``segment_values`` values in blocks of 64 against the same
    tensor as the compressor cuts it (:func:`_fit_segments`; 0: not timed).
    Returns the profile and writes it to ``path`` (JSON).

    ``clock``: "cpu" (default) times each call in this process's CPU seconds, what one core of a
    host spends, which other jobs on a shared machine do not inflate; "wall" in wall seconds
    divided by ``dilation``: inside a virtual cluster's host (a CPU quota, time dilation D, see
    docs/emulation.md) that is the real-host second of the host being stood for, its quota's
    gaps, its neighbours' share of the caches and the timer's granularity included; each reading
    then spans at least ``min_wall_s`` of wall time (:class:`_Timer`).

    ``device``: where the codec's tensors live ("cuda" on a GPU host, with ``clock="wall"``: each
    reading waits for the device). A GPU's profile is not ``serial``: its codec does not share
    a core with the host's collectives. The network figures are the host's TCP either way."""
    import platform
    import torch
    from horovod_twobit.torch.codec import compiled as bodies
    device = torch.device(device)
    if device.type != "cpu" and clock == "cpu":
        raise ValueError("a %s device's codec runs outside this process's CPU time: calibrate "
                         "it with clock=\"wall\" (--clock wall)" % device.type)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("this torch sees no CUDA device (torch.cuda.is_available() is False): "
                         "calibrate on the GPU host with a CUDA build of torch, or with "
                         "--device cpu")
    if segment_values and int(segment_values) <= 64 * 64:
        raise ValueError("segment_values must be more than 4096 (the compressor cuts a tensor "
                         "of up to 4096 values into blocks of 64 already), e.g. %d; 0: not timed, "
                         "got %r" % (SEGMENT_VALUES, segment_values))
    timer = _Timer(clock, dilation, min_wall_s, device)
    torch.set_num_threads(threads)
    old = bodies.COMPILE_MIN_NUMEL
    if not compiled:
        bodies.COMPILE_MIN_NUMEL = 1 << 62
    sizes = timed_sizes(sizes, bodies.COMPILE_MIN_NUMEL)
    try:
        points = {k: [] for k in CODEC_KEYS}
        for n in sizes:
            for N in ranks:
                for key, secs in _time_codec(int(n), int(N), reps, timer, device).items():
                    points[key].append((int(n), int(N), secs))
        codec = {k: _fit(v) for k, v in points.items()}
        by_size = {"sizes": sizes,  # timed_sizes: ascending, no repeats
                   "keys": {k: _fit_by_size(v) for k, v in points.items()}}
        bucket = None
        if members and int(members) > 1:
            n = member_values(sizes, members)
            bucket = {"members": int(members), "values": n, "points": {k: [] for k in CODEC_KEYS}}
            for N in ranks:
                for key, secs in _time_codec(n, int(N), reps, timer, device,
                                             int(members)).items():
                    bucket["points"][key].append((int(N), secs))

        def paired(more, fewer):  # "auto" only, at every N: {key: [(N, seconds, seconds)]}
            points = {}
            for N in ranks:
                a, b = (_time_codec(0, int(N), reps, timer, device, autos=(True,), **kw)
                        for kw in (more, fewer))
                for key in a:
                    points.setdefault(key, []).append((int(N), a[key], b[key]))
            return points
        by_table = by_segment = None
        if tables and int(tables) > 1:
            distinct, equal = table_numels(int(tables))
            by_table = {"tables": int(tables), "numels": distinct,
                        "points": paired({"numels": distinct}, {"numels": equal})}
        if segment_values:
            n, cuts = int(segment_values), ((64, None), _wire.validate_blocks("auto"))
            by_segment = {"values": n, "segments": [
                _layout.Layout([n], True, *c).segments for c in cuts],
                "points": paired(*({"numels": [n], "blocks": c} for c in cuts))}
        per = _time_per_value(1 << 22, reps, timer, device)
    finally:
        bodies.COMPILE_MIN_NUMEL = old
    gpu = device.type != "cpu"
    prof = {"name": name, "kind": "measured", "serial": not gpu,
            "source": "python -m horovod_twobit.advise calibrate on %s (%s, %d thread(s), %s, "
                      "torch %s, %s)" % (platform.node() or "?",
                                         torch.cuda.get_device_name(device) if gpu
                                         else _cpu_name(), threads,
                                         "codec compiled from %d values, eager below" % old
                                         if compiled else "eager codec",
                                         torch.__version__, _clock_name(clock, dilation)),
            "note": ("the codec on one %s device; the network figures are its host's TCP"
                     % device.type if gpu else
                     "one host = one core doing compute, codec and the exchange's CPU work"),
            "codec": codec, "codec_by_size": by_size, "points": points,
            "compile_min_numel": old if compiled else None}
    if bucket:
        prof["member_points"] = bucket
        prof["codec_members"] = _fit_members(points, bucket)
    if by_table:
        prof["table_points"] = by_table
        prof["codec_tables"] = _fit_tables(by_table)
    if by_segment:
        prof["segment_points"] = by_segment
        prof["codec_segments"] = _fit_segments(by_segment)
    prof.update(per)
    prof.update(_time_network(nbytes=(64 << 20) if clock == "cpu" else (256 << 20), timer=timer,
                              dilation=dilation if clock == "wall" else 1.0))
    if path:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            json.dump(prof, f, indent=1, sort_keys=True)
            f.write("\n")
    return prof


def member_values(sizes, members):
    """The size of the bucket :func:`calibrate` times with ``members`` members: the smallest of
    ``sizes`` that gives each member at least 16 values (one word), else the largest."""
    fit = [int(n) for n in sorted(sizes) if int(n) >= 16 * int(members)]
    return fit[0] if fit else int(max(sizes))


def timed_sizes(sizes, switch):
    """``sizes`` (ascending, no repeats) and, where they straddle ``switch`` (the codec's
    ``COMPILE_MIN_NUMEL``: eager below it, compiled from it), the largest size of whole words
    below it, so that the rates by size (:func:`_fit_by_size`) step where the codec does
    rather than blend its eager and compiled rates in between."""
    sizes = sorted({int(n) for n in sizes})
    below = (int(switch) - 1) // 16 * 16
    if below > 0 and sizes[0] < switch <= sizes[-1] and below not in sizes:
        sizes = sorted(sizes + [below])
    return sizes


def table_numels(tables):
    """(distinct, equal): the members of a bucket whose "auto" segments (the compressor's
    blocks, :func:`horovod_twobit.wire.validate_blocks`) make ``tables`` tables
    (:meth:`horovod_twobit.wire.layout.Layout.tables`), and its twin of one table: as many members, of
    one length, as many values. Member j is 64 blocks of 64 x 4^j values: rows too far apart in
    length to share a table."""
    distinct = [64 * 64 * 4 ** j for j in range(int(tables))]
    return distinct, [sum(distinct) // len(distinct)] * len(distinct)
