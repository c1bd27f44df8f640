"""When compression does not pay: the decision behind ``TwoBitCompressor(..., fallback="auto")``.

A bucket is compressed when the step-time model (:func:`horovod_twobit.model.steptime.bucket_s`, what
the advisor charges a bucket) says its exchange takes less time than Horovod's ring allreduce of
the same values, else it is sent uncompressed as g + r (see the bindings' plain flights): with
error feedback the switch is exact, so the fallback never loses accuracy, only the bytes it would
have saved.

The model's inputs are measured once per number of ranks, and rank 0's figures are used by
every rank, so every rank decides alike (:func:`figures`, each binding's ``link.measure``):

* a one-value allreduce: the model's fixed cost per collective (``Wire.collective_s``), which at
  this N holds the collective's messages, negotiation and cycle wait as well, so the model's
  per-message alpha and cycle are 0 here;
* a ``BIG``-value allreduce beyond it: the seconds per byte a rank sends in a ring allreduce
  (beta), its reduction and copies included (the profile's sum and copy costs are 0 here);
* an allgather that sends each rank as many bytes, beyond a one-value one: the allgather's pace
  against the allreduce's (the profile's ``allgather_pace``; Gloo's allgather between two ranks
  sends, then receives, and takes up to twice as long:
  :func:`horovod_twobit.model.collectives.allgather_pace`);
* a step's codec work on ``BIG`` and on ``SMALL`` values (one encode and the decode-sum of N
  payloads): the codec's seconds per value and its fixed cost per bucket, the profile's codec
  terms (``n a`` and ``c0``).

The collectives' bytes are the formats' own (:mod:`horovod_twobit.wire.scatter`, the allgather
payload), counted by the model.
"""

import logging
import time

from horovod_twobit.model import steptime

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
    """Measured figures: ``rate`` (bytes/s a rank sends in a ring allreduce), ``latency``
    (seconds of a one-value allreduce: the fixed cost of a collective), ``codec`` (values/s of a
    step's codec work: one encode and the decode-sum of N payloads), ``codec_fixed`` (seconds
    that work costs a bucket whatever its size: the calls, the levels' reductions, the
    launches) and ``allgather`` (how many times the allreduce's time per byte an allgather's
    bytes take); :meth:`wire` and :meth:`profile` give them to the step-time model."""

    def __init__(self, rate, latency, codec, codec_fixed=0.0, allgather=1.0):
        self.rate, self.latency, self.codec = float(rate), float(latency), float(codec)
        self.codec_fixed, self.allgather = float(codec_fixed), float(allgather)

    def wire(self, nranks):
        """The step-time model's :class:`~horovod_twobit.model.steptime.Wire` of this link."""
        return steptime.Wire(nranks, alpha=0.0, beta=1.0 / self.rate, collective_s=self.latency)

    def profile(self):
        """The measured codec as a step-time device profile: the encode's entry carries the
        whole pass timed (an encode and the decode-sum of N payloads, at this N), the other
        codec entries are 0, and so are the costs the measured rate already holds; the
        allgather's pace is the measured one."""
        enc, zero = [self.codec_fixed, 0.0, 1.0 / self.codec, 0.0], [0.0] * 4
        return {"name": "fallback", "kind": "measured", "serial": False, "message_s": 0.0,
                "allgather_pace": self.allgather,
                "codec": {k: enc if "encode" in k else zero for k in steptime.CODEC_KEYS},
                **dict.fromkeys(("sum_fp32_s", "sum_fp16_s", "cast_fp16_s", "copy_s_per_byte",
                                 "optimizer_s", "powersgd_s", "kernel_s_per_byte"), 0.0)}

    def __repr__(self):
        return ("Link(%.3g bytes/s, %.3g s/collective, codec %.3g values/s + %.3g s/bucket, "
                "allgather %.2fx)" % (self.rate, self.latency, self.codec, self.codec_fixed,
                                      self.allgather))


def codec_figures(seconds, big=BIG, small=SMALL):
    """(values/s, fixed seconds per bucket) from a codec pass timed on ``big`` and on ``small``
    values (``seconds(n)``)."""
    t_big, t_small = seconds(big), seconds(small)
    rate = big / max(t_big, 1e-12)
    return rate, max(0.0, t_small - small / rate)


def allgather_values(nranks):
    """Values per rank of the timed allgather: each rank then sends as many bytes as in the
    ``BIG``-value ring allreduce, (N - 1) x 2 BIG / N float32 values."""
    return max(1, 2 * BIG // max(int(nranks), 1))


def figures(nranks, allreduce, codec_seconds, rounds=5, allgather=None):
    """[rate, latency, codec values/s, codec fixed seconds, allgather pace], the :class:`Link`
    arguments, from timed allreduces of 1 and ``BIG`` values (``allreduce(values, round)`` runs
    one), allgathers of 1 and :func:`allgather_values` values per rank (``allgather(values,
    round)``; without it, or on one rank, the pace is 1) and the codec pass
    ``codec_seconds(n)``: what each binding's ``link.measure`` broadcasts from rank 0. The
    collectives take turns, ``rounds`` times, and the best of each counts, so that a change in
    the machine's load falls on all alike. The allgather's pace: its time beyond the one-value
    allgather's over the allreduce's beyond the one-value allreduce's, for the same bytes
    sent."""
    N = max(int(nranks), 1)
    gather = allgather is not None and N > 1
    runs = [(allreduce, 1), (allreduce, BIG)]
    if gather:
        runs += [(allgather, 1), (allgather, allgather_values(N))]
    best = [float("inf")] * len(runs)
    for i in range(rounds):
        for k, (run, values) in enumerate(runs):
            t0 = time.perf_counter()
            run(values, i)
            best[k] = min(best[k], time.perf_counter() - t0)
    moved = 2 * (N - 1) / N * 4 * BIG  # bytes each rank sends in a ring allreduce
    small, big = best[0], best[1]
    pace = max(best[3] - best[2], 1e-9) / max(big - small, 1e-9) if gather else 1.0
    return [moved / max(big - small, 1e-9), small, *codec_figures(codec_seconds), pace]


def decide(decisions, names, layout, nranks, exchange, fallback, link):
    """Whether the bucket of ``names`` goes uncompressed with ``nranks`` ranks (``fallback``
    "always", or "auto" where ``link()``, the measured :class:`Link`, says compression would not
    pay with ``exchange``). Decided once per bucket and number of ranks, kept in ``decisions``
    ((bucket key, N) -> "compressed" / "plain") and logged once."""
    from horovod_twobit.wire.scatter import owner_key
    key = (owner_key(names), nranks)
    got = decisions.get(key)
    if got is None:
        plain = fallback == "always"
        if not plain:
            comp, plain_s = modelled(layout, nranks, exchange, link)
            plain = not comp < plain_s
        got = decisions[key] = "plain" if plain else "compressed"
        _log.info("horovod-twobit: bucket %s (%d values, %d ranks): %s", key[0],
                  sum(layout.numels), nranks, got)
    return got == "plain"


def times(layout, nranks, exchange, link):
    """(seconds of the compressed exchange, seconds of a plain ring allreduce) for one step of a
    bucket of ``layout`` with ``exchange`` ("allgather" or "scatter", as decided), by the
    step-time model fed with the measured ``link``."""
    wire, prof = link.wire(nranks), link.profile()
    return (steptime.bucket_s(layout, exchange, nranks, wire, prof),
            steptime.bucket_s(layout, "plain", nranks, wire, prof))


def modelled(layout, nranks, exchange, link):
    """:func:`times`, asking ``link()`` (the measured :class:`Link`, measured on first use) only
    where there is one to cross: on one rank the plain exchange is a copy and the compressed one
    costs its codec for nothing, (inf, 0.0), and nothing is measured. What the decision and the
    bindings' checks ask."""
    if nranks <= 1:
        return float("inf"), 0.0
    return times(layout, nranks, exchange, link())


def compress_pays(layout, nranks, exchange, link):
    comp, plain = times(layout, nranks, exchange, link)
    return comp < plain


# ----------------------------------------------------------------- the checked decision
# The model's pick is a prediction; with fallback="auto" it is then checked on the job's own
# steps. The candidates (the model's per-bucket picks, every bucket compressed, every bucket
# plain: those that differ) take turns of TURN steps, for WARMUP untimed rounds and SAMPLES
# timed ones. Only a turn's last step is timed: its first pays the switch (a plain step after a
# compressed one sends g + r as one bucket, where a steady plain step streams g member by member
# as Horovod would; a first step may compile), which the mode kept would not pay again. Every
# rank runs the same schedule (a function of the step count alone), and rank
# 0's medians decide, broadcast, so every rank keeps the same candidate. A candidate's figure is
# a whole step: from its first gradient handed to the compressor to the next step's (PyTorch), or
# from the start of its traced gradient reduction to the next step's (TensorFlow). Timing only
# the exchanges (first gradient to last result), as before, missed what a mode costs around
# them: on localhost it kept a mode whose steady step was 10-30 % slower.
#
# The check is sequential: after a block of SAMPLES rounds rank 0 asks whether its rounds are
# sure of the pick (:func:`sure`: no other mode faster than the kept one by more than TIE, at
# the CONFIDENCE of a sign test on the paired rounds). If not, and fewer than BLOCKS blocks ran,
# the schedule goes on for another block and decides on all its rounds after it; after the last
# block the medians decide as they stand. Modes far apart are decided after the first block;
# modes close together, where 7 noisy rounds pick by chance, get up to BLOCKS times as many.

MODEL, COMPRESSED, PLAIN = 0, 1, 2
MODE_NAMES = ("model", "compressed", "plain")
TURN = 2  # steps per candidate and round: the last one timed
WARMUP = 0  # untimed rounds first (a turn's first step already absorbs a compile)
SAMPLES = 7  # timed rounds: each candidate's figure is the median of as many steps
MARGIN = 3.0  # not checked where the model has one side this many times faster than the other
TIE = 0.01  # the model's pick is kept unless another candidate is faster by more than this
BLOCKS = 3  # blocks of SAMPLES rounds at most: the check goes on while its rounds are not sure
CONFIDENCE = 0.9375  # of :func:`sure`'s one-sided sign test (7 rounds: at most one against)


def start_steps():
    """Steps a job runs before its checked decision holds, at most: the model's step, the
    longest schedule (every mode in turns, every block) and the step that decides."""
    return 2 + len(MODE_NAMES) * TURN * (WARMUP + SAMPLES * BLOCKS)


def is_plain(mode, pick):
    """Whether a bucket whose model pick is ``pick`` (plain or not) goes plain in ``mode``."""
    return pick if mode == MODEL else mode == PLAIN


def candidates(picks, compressed_s, plain_s, margin=None):
    """The modes to check: the model's picks (``picks``, one bool per bucket: plain), then every
    bucket compressed and every bucket plain where those differ from the picks, unless the
    model's times for the whole step (``compressed_s`` every bucket compressed, ``plain_s`` every
    bucket plain) differ by ``margin`` times or more."""
    margin = MARGIN if margin is None else margin
    modes = [MODEL]
    lo, hi = sorted((max(compressed_s, 1e-12), max(plain_s, 1e-12)))
    if hi / lo >= margin:
        return modes
    if any(picks):
        modes.append(COMPRESSED)
    if not all(picks):
        modes.append(PLAIN)
    return modes


def schedule(modes, warmup=None, samples=None):
    """The mode of each checked step: the modes in turns of TURN steps, ``warmup + samples``
    rounds (none with one mode: nothing to check)."""
    warmup = WARMUP if warmup is None else warmup
    samples = SAMPLES if samples is None else samples
    return [] if len(modes) < 2 else [m for _ in range(warmup + samples) for m in modes
                                      for _ in range(TURN)]


def rounds_of(steps, spans, warmup=None):
    """[{mode: span}] per timed round of a schedule: the last step of each mode's turn, after
    the warmup rounds, where its span is known."""
    import math
    per_round = max(len(set(steps)), 1) * TURN
    skip = (WARMUP if warmup is None else warmup) * per_round
    rounds = {}  # round -> {mode: span}
    for i, (mode, s) in enumerate(zip(steps, spans)):
        timed = i >= skip and i % TURN == TURN - 1
        if timed and s is not None and math.isfinite(s) and s > 0:
            rounds.setdefault(i // per_round, {})[mode] = s
    return [rounds[k] for k in sorted(rounds)]


def medians(steps, spans, warmup=None):
    """[figure] per mode (NaN for a mode never timed) of a schedule's timed steps (the last of
    each turn, after the warmup rounds): the model's pick's median span, and each other mode's
    as that median times the median, over the rounds, of its span over the model pick's span in
    the same round (paired, so that a change in the machine's load between rounds falls on both
    alike)."""
    import statistics
    rounds = rounds_of(steps, spans, warmup)
    base = [r[MODEL] for r in rounds if MODEL in r]
    out = [statistics.median(base) if base else float("nan")]
    for m in range(1, len(MODE_NAMES)):
        ratios = [r[m] / r[MODEL] for r in rounds if m in r and MODEL in r]
        out.append(out[0] * statistics.median(ratios) if ratios and base else float("nan"))
    return out


def lower_bound(ratios, confidence=None):
    """A lower bound of the median of ``ratios`` at ``confidence`` (one-sided, distribution
    free): the k-th smallest, for the largest k where at most k - 1 of them fall below the
    median with probability 1 - ``confidence`` or less (a sign test); 0 where there are too few
    for that (4 at 93.75 %)."""
    from math import comb
    confidence = CONFIDENCE if confidence is None else confidence
    n, xs = len(ratios), sorted(ratios)
    k, below = 0, 0.0  # P(at most k of n below the median)
    while k < n:
        below += comb(n, k) / 2.0 ** n
        if below > 1.0 - confidence + 1e-12:
            break
        k += 1
    return xs[k - 1] if k else 0.0


def sure(rounds, chosen, tie=None):
    """Whether the timed ``rounds`` (:func:`rounds_of`) are sure that no other mode is faster
    than ``chosen`` by more than ``tie``: for each other mode timed with it, the
    :func:`lower_bound` of its span over the chosen one's, round by round, is 1 - ``tie`` or
    more."""
    tie = TIE if tie is None else tie
    others = {m for r in rounds for m in r} - {chosen}
    for m in others:
        ratios = [r[m] / r[chosen] for r in rounds if m in r and chosen in r]
        if lower_bound(ratios) < 1.0 - tie:
            return False
    return True


def from_starts(steps, starts):
    """:func:`medians` of a schedule from when each step started: ``starts[j]`` is when scheduled
    step j started (None if unknown), ``starts[len(steps)]`` when the step after them did; a
    step's figure is the whole step, from its start to the next one's."""
    return medians(steps, _spans(starts))


def _spans(starts):
    return [b - a if a is not None and b is not None else None
            for a, b in zip(starts, starts[1:])]


def assess(steps, starts, last):
    """What the step after a block of the check decides, on rank 0 (broadcast, so every rank
    goes on alike): :func:`from_starts`'s figures and a last value, 1.0 where the check is
    decided (its rounds are :func:`sure` of the mode :func:`choose` keeps, or ``last``, the
    last block, ran) and 0.0 where it goes on for another block."""
    spans = _spans(starts)
    figures = medians(steps, spans)
    done = last or sure(rounds_of(steps, spans), choose(figures))
    return figures + [1.0 if done else 0.0]


def blocks(firsts):
    """The check's schedule of every block, and the lengths after which it may decide (one per
    block, in order), from each bucket's (model pick, modelled (compressed s, plain s)) at its
    first step; the schedule runs up to one of them (the first, then the next while the rounds
    are not sure)."""
    modes = candidates([p for p, _ in firsts], sum(t[0] for _, t in firsts),
                       sum(t[1] for _, t in firsts))
    full = schedule(modes, samples=SAMPLES * BLOCKS)
    if not full:
        return [], [0]
    per_round = len(modes) * TURN
    return full, [per_round * (WARMUP + SAMPLES * (i + 1)) for i in range(BLOCKS)]


def verdict(got, steps, ends, where):
    """What every rank does with rank 0's :func:`assess` ``got`` after ``steps`` scheduled steps
    (``ends``: :func:`blocks`' lengths): (the figures, the mode kept or None while the check
    goes on, the schedule's length from now); logged."""
    figures = [float(x) for x in got[:-1]]
    if got[-1] > 0.5:
        chosen = choose(figures)
        log_checked(where, steps, figures, chosen)
        return figures, chosen, steps
    log_longer(where, steps, figures)
    return figures, None, min(e for e in ends if e > steps)


def choose(figures, tie=TIE):
    """The mode with the shortest median span (``figures``, from :func:`medians`); the model's
    pick unless another is faster by more than ``tie``."""
    import math
    timed = [m for m, s in enumerate(figures) if math.isfinite(s)]
    if not timed:
        return MODEL
    best = min(timed, key=lambda m: figures[m])
    if MODEL in timed and figures[best] >= figures[MODEL] * (1.0 - tie):
        return MODEL
    return best


def summary(steps, chosen, figures):
    """A decided check as the stats show it."""
    return {"steps": steps, "kept": MODE_NAMES[chosen],
            "median_span_ms": {MODE_NAMES[m]: 1e3 * s for m, s in enumerate(figures) if s == s}}


def log_checked(where, steps, figures, chosen):
    """Logs a checked decision once: its ``steps``, the median spans and the mode kept."""
    _log.info("horovod-twobit: fallback checked over %d steps (%s): median span %s; keeping %s",
              steps, where, _spans_text(figures), MODE_NAMES[chosen])


def log_longer(where, steps, figures):
    """Logs a check that goes on for another block after ``steps`` steps, not sure yet."""
    _log.info("horovod-twobit: fallback check not sure after %d steps (%s): median span %s; "
              "checking another block", steps, where, _spans_text(figures))


def _spans_text(figures):
    return ", ".join("%s %.3g ms" % (MODE_NAMES[m], 1e3 * s) for m, s in enumerate(figures)
                     if s == s)
