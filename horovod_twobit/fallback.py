"""When compression does not pay: the decision behind ``TwoBitCompressor(..., fallback="auto")``.

A bucket is compressed when the model below says its exchange takes less time than Horovod's
ring allreduce of the same values, else it is sent uncompressed as g + r (see the bindings'
plain flights): with error feedback the switch is exact, so the fallback never loses accuracy,
only the bytes it would have saved.

The model (an alpha-beta form): every Horovod collective costs a fixed latency (its negotiation
and cycle, measured by a one-value allreduce) plus its bytes at the link's rate. A ring allreduce
of ``n`` float32 values between N ranks sends 2 (N - 1) / N * 4n bytes per rank in one
collective; the allgather exchange sends the rank's payload to the N - 1 others (one
collective), the scatter exchange its chunks and reduced chunks (two collectives), by the formats'
own counts (:func:`horovod_twobit.scatter_wire.rank_bytes`); the codec costs n values at the
measured codec rate, timed as this rank's whole codec work of a step: one encode and the
decode-sum of N payloads. The link and the codec rate are measured once per number of ranks by
timed collectives and a codec pass of known size, and rank 0's figures are used by every rank,
so every rank decides alike.
"""

import logging

FALLBACKS = (None, "auto", "always")
BIG = 1 << 20  # values of the timed allreduce (4 MB) and of the timed codec pass
SMALL = 1 << 10  # values of the codec pass that tells its fixed cost per bucket
_log = logging.getLogger("horovod_twobit")


def validate_fallback(fallback):
    if fallback not in FALLBACKS:
        raise ValueError("fallback must be None (always compress), \"auto\" (send a bucket "
                         "uncompressed where compression would not pay) or \"always\" (never "
                         "compress), got %r" % (fallback,))
    return fallback


class Link:
    """Measured figures: ``rate`` (bytes/s a rank sends), ``latency`` (seconds per collective),
    ``codec`` (values/s of a step's codec work: one encode and the decode-sum of N payloads) and
    ``codec_fixed`` (seconds that work costs a bucket whatever its size: the calls, the levels'
    reductions, the launches)."""

    def __init__(self, rate, latency, codec, codec_fixed=0.0):
        self.rate, self.latency, self.codec = float(rate), float(latency), float(codec)
        self.codec_fixed = float(codec_fixed)

    def __repr__(self):
        return "Link(%.3g bytes/s, %.3g s/collective, codec %.3g values/s + %.3g s/bucket)" % (
            self.rate, self.latency, self.codec, self.codec_fixed)


def codec_figures(seconds, big=BIG, small=SMALL):
    """(values/s, fixed seconds per bucket) from a codec pass timed on ``big`` and on ``small``
    values (``seconds(n)``)."""
    t_big, t_small = seconds(big), seconds(small)
    rate = big / max(t_big, 1e-12)
    return rate, max(0.0, t_small - small / rate)


def figures(nranks, small, big, codec_seconds):
    """[rate, latency, codec values/s, codec fixed seconds], the :class:`Link` arguments, from a
    timed 1-value allreduce (``small`` s), a timed ``BIG``-value one (``big`` s) and the codec
    pass ``codec_seconds(n)``: what each binding's ``link.measure`` broadcasts from rank 0."""
    N = max(int(nranks), 1)
    moved = 2 * (N - 1) / N * 4 * BIG  # bytes each rank sends in a ring allreduce
    return [moved / max(big - small, 1e-9), small, *codec_figures(codec_seconds)]


def decide(decisions, names, layout, nranks, exchange, fallback, link):
    """Whether the bucket of ``names`` goes uncompressed with ``nranks`` ranks (``fallback``
    "always", or "auto" where ``link()``, the measured :class:`Link`, says compression would not
    pay with ``exchange``). Decided once per bucket and number of ranks, kept in ``decisions``
    ((bucket key, N) -> "compressed" / "plain") and logged once."""
    from .scatter_wire import owner_key
    key = (owner_key(names), nranks)
    got = decisions.get(key)
    if got is None:
        plain = fallback == "always" or not compress_pays(layout, nranks, exchange, link())
        got = decisions[key] = "plain" if plain else "compressed"
        _log.info("horovod-twobit: bucket %s (%d values, %d ranks): %s", key[0],
                  sum(layout.numels), nranks, got)
    return got == "plain"


def times(layout, nranks, exchange, link):
    """(seconds of the compressed exchange, seconds of a plain ring allreduce) for one step of a
    bucket of ``layout`` with ``exchange`` ("allgather" or "scatter", as decided)."""
    from .scatter_wire import rank_bytes
    N, n = int(nranks), sum(layout.numels)
    if N < 2:
        return 0.0, 0.0
    plain = 2 * (N - 1) / N * 4 * n / link.rate + link.latency
    sent = rank_bytes(layout, N, 0, exchange)  # handed to the collectives
    if exchange == "scatter":  # each chunk goes to its owner, each reduced chunk to all others
        wire_bytes, collectives = (N - 1) / N * sent, 2
    else:
        wire_bytes, collectives = (N - 1) * sent, 1
    comp = (wire_bytes / link.rate + collectives * link.latency + n / link.codec
            + link.codec_fixed)
    return comp, plain


def compress_pays(layout, nranks, exchange, link):
    comp, plain = times(layout, nranks, exchange, link)
    return comp < plain
