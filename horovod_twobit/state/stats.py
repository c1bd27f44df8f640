"""What a compressor did, for ``TwoBitCompressor.stats()``: framework-free bookkeeping.

Each bucket step (one encode and its collectives) is recorded when it is launched
(:meth:`StatsLog.sent`: its exchange, the bytes this rank hands to the collectives, and a
*reader*, a function that gives the step's code counts and levels) and when it is finished
(:meth:`StatsLog.finished`: whether a member held NaN or Inf). Recording is a few dictionary
updates on the host, with no host-device synchronisation. Code counts, levels and residual norms
are computed from the last step's payload and the current residuals, when
:meth:`StatsLog.snapshot` is called or (once the stats were read, in PyTorch) by the step itself.

The snapshot is a plain dict (see :meth:`StatsLog.snapshot`) that a logger can write as it is:
``horovod_twobit.state.stats.scalars(snapshot)`` flattens it to ``{"twobit/...": number}``.
"""

import threading

import numpy as np

EXCHANGES = ("allgather", "scatter", "plain")  # plain: the fallback, uncompressed


def _high_bits(words):
    """How many 2-bit codes in ``words`` (uint32) have their high bit set (10 or 11: sent): a
    bit count of the odd bits, by halves, nibbles and bytes (no table lookups)."""
    x = (words >> np.uint32(1)) & np.uint32(0x55555555)
    x = (x & np.uint32(0x33333333)) + ((x >> np.uint32(2)) & np.uint32(0x33333333))
    x = (x + (x >> np.uint32(4))) & np.uint32(0x0F0F0F0F)
    return int(((x * np.uint32(0x01010101)) >> np.uint32(24)).sum(dtype=np.int64))


def payload_counts(layout, payload, threshold):
    """(values sent as +-level, sum of the levels, number of levels) of one rank's payload
    (int32 words, NumPy) for a bucket of ``layout``: the codes 10 and 11 (high bit set) in its
    packed words; the magnitudes it carries with "auto", else the numeric threshold."""
    payload = np.ascontiguousarray(payload, dtype=np.int32).reshape(-1)
    sent = _high_bits(payload[layout.body:].view(np.uint32))
    if not layout.auto:
        return sent, float(threshold), 1
    mags = payload[layout.head_words:layout.body] if layout.mag_words else payload[4:5]
    return sent, float(mags.view(np.float32).astype(np.float64).sum()), mags.size


class Step:
    """One bucket step: its tensors, exchange, bytes handed to the collectives, a reader of its
    payload (see :meth:`StatsLog.sent`), its number of real values, and optionally ``norms``, a
    function giving the bucket's residual (sum of squares, max |r|) at once, or None when it
    cannot (then they are read per tensor)."""
    __slots__ = ("names", "exchange", "nbytes", "reader", "values", "norms")

    def __init__(self, names, exchange, nbytes, reader, values, norms=None):
        self.names, self.exchange, self.nbytes = list(names), exchange, int(nbytes)
        self.reader, self.values, self.norms = reader, int(values), norms


class StatsLog:
    """Running statistics of one compressor (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last = {}  # bucket key -> Step of its last launch
        self.reset()

    def reset(self):
        """Clears the running sums (totals, non-finite count); the last step stays readable."""
        with self._lock:
            self._bytes_total = dict.fromkeys(EXCHANGES, 0)
            self._steps = dict.fromkeys(EXCHANGES, 0)
            self._nonfinite = 0

    def sent(self, key, names, exchange, nbytes, reader, values, norms=None):
        """A bucket step was launched: ``nbytes`` handed to the collectives with ``exchange``;
        ``reader()`` -> (codes sent as +-level, sum of the levels in use, number of levels) of
        this rank's payload, evaluated only by :meth:`snapshot`; ``values``: the real values;
        ``norms``: see :class:`Step`."""
        with self._lock:
            self._last[key] = Step(names, exchange, nbytes, reader, values, norms)
            self._bytes_total[exchange] += int(nbytes)
            self._steps[exchange] += 1

    def finished(self, nonfinite):
        """A bucket step was finished; ``nonfinite``: some member held NaN or Inf on some rank
        (its result is NaN everywhere: a loss scaler skips that step)."""
        if nonfinite:
            with self._lock:
                self._nonfinite += 1

    def snapshot(self, residual_norms, threshold, per_tensor=False):
        """The statistics as a dict: see :func:`summarize`."""
        with self._lock:
            last = dict(self._last)
            totals = (dict(self._bytes_total), dict(self._steps), self._nonfinite)
        return summarize(last, *totals, residual_norms, threshold, per_tensor)


def summarize(last, bytes_total, steps, nonfinite, residual_norms, threshold, per_tensor=False):
    """The statistics as a dict, from each bucket's last step (``last``: {key: Step}) and the
    running sums:

    - ``bytes_last_step`` / ``bytes_total``: {exchange: bytes this rank handed to the
      collectives}, at every bucket's last step / since the start or the last reset;
    - ``bucket_steps``: {exchange: bucket steps since then};
    - ``fraction_sent``: the fraction of values this rank sent as +-level at the last step;
    - ``threshold``: the numeric threshold, or with "auto" the mean of the levels (magnitudes)
      this rank sent at the last step;
    - ``nonfinite_steps``: bucket steps whose result was NaN (a member held NaN or Inf);
    - ``buckets``: {bucket key: {tensors, exchange, values, bytes_last_step, fraction_sent,
      level_mean, residual_l2, residual_max}};
    - ``tensors`` (``per_tensor=True``): {name: {residual_l2, residual_max}}.

    ``residual_norms(names)`` -> {name: (sum of squares, max |r|)} of the current residuals."""
    out = {"bytes_total": dict(bytes_total), "bucket_steps": dict(steps),
           "nonfinite_steps": int(nonfinite), "bytes_last_step": dict.fromkeys(EXCHANGES, 0)}
    buckets, sent, values, level_sum, level_count = {}, 0, 0, 0.0, 0
    whole = {} if per_tensor else {k: s.norms() for k, s in last.items() if s.norms}
    norms = residual_norms([n for k, s in last.items() if whole.get(k) is None for n in s.names])
    for key, s in sorted(last.items()):
        nonzero, lsum, lcount = s.reader()
        out["bytes_last_step"][s.exchange] += s.nbytes
        sent, values = sent + nonzero, values + s.values
        level_sum, level_count = level_sum + lsum, level_count + lcount
        if whole.get(key) is not None:  # the bucket's norms at once
            sq, mx = whole[key]
        else:
            sq = sum(norms[n][0] for n in s.names if n in norms)
            mx = max([norms[n][1] for n in s.names if n in norms], default=0.0)
        buckets[key] = bucket_entry(s.names, s.exchange, s.values, s.nbytes, nonzero, lsum,
                                    lcount, sq, mx)
    out["fraction_sent"], out["threshold"] = overall(sent, values, level_sum, level_count,
                                                     threshold)
    out["buckets"] = buckets
    if per_tensor:
        out["tensors"] = {n: {"residual_l2": q ** 0.5, "residual_max": m}
                          for n, (q, m) in sorted(norms.items())}
    return out


def bucket_entry(names, exchange, values, nbytes, nonzero, lsum, lcount, sq, mx):
    """A bucket's entry in the stats' ``buckets``: its step's counts (values sent, sum and
    number of levels) and its residual's (sum of squares, max |r|)."""
    return {"tensors": list(names), "exchange": exchange, "values": values,
            "bytes_last_step": nbytes, "fraction_sent": nonzero / max(values, 1),
            "level_mean": lsum / lcount if lcount else float("nan"),
            "residual_l2": sq ** 0.5, "residual_max": mx}


def overall(sent, values, level_sum, level_count, threshold):
    """(the fraction of values sent, the threshold or with "auto" the mean of the levels) over
    the buckets' last steps."""
    if threshold == "auto":
        threshold = level_sum / level_count if level_count else float("nan")
    return (sent / values if values else 0.0), float(threshold)


def scalars(snapshot, prefix="twobit/"):
    """A snapshot flattened to {name: number} for a logger (TensorBoard, Keras ``logs``): the
    totals, the fraction sent, the threshold, the non-finite count, and per bucket its fraction
    sent and residual norms."""
    out = {prefix + "fraction_sent": snapshot["fraction_sent"],
           prefix + "threshold": snapshot["threshold"],
           prefix + "nonfinite_steps": snapshot["nonfinite_steps"]}
    for ex in EXCHANGES:
        out[prefix + "bytes_last_step/" + ex] = snapshot["bytes_last_step"][ex]
        out[prefix + "bytes_total/" + ex] = snapshot["bytes_total"][ex]
    for key, b in snapshot["buckets"].items():
        k = key.replace(" ", "").replace("(", "_").replace(")", "")
        for f in ("fraction_sent", "residual_l2", "residual_max"):
            out["%sbucket/%s/%s" % (prefix, k, f)] = b[f]
    return out
