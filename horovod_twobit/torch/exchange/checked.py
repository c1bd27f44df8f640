"""The fallback's measurements that need no collective library: the codec's pass on values of
known size (for the step-time model's per-bucket pick), and the checked decision of
``fallback="auto"`` (:mod:`horovod_twobit.state.fallback`), for Horovod's buckets
(:mod:`.link` gives the collectives) and DDP's (:mod:`horovod_twobit.torch.ddp`)."""

import threading
import time

import torch

from horovod_twobit.state import fallback
from horovod_twobit.state.fallback import BIG
from horovod_twobit.wire.layout import Layout


def codec_seconds(device, threshold, nranks, values):
    """Seconds of a step's codec work on ``values`` values: one encode, and the decode-sum of
    ``nranks`` payloads (this rank's, repeated, in the place of the gathered ones)."""
    from horovod_twobit.torch import codec
    layout = Layout([values], threshold == "auto")
    g = torch.randn(values, device=device)
    r = torch.zeros(values, device=device)
    payload = torch.empty(layout.payload_words, dtype=torch.int32, device=device)
    best = float("inf")
    for _ in range(3 if values >= BIG else 7):  # the first small one may compile
        g2 = g.clone()
        t0 = time.perf_counter()
        t, v = codec.encode_payload(layout, r, g2, threshold, "lsq", payload)
        codec.finish_payload(layout, payload.repeat(max(nranks, 1)), max(nranks, 1),
                             ["twobit.link"], r, g2, t, v, nranks, 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best



class Checker:
    """The checked decision of ``fallback="auto"`` (:mod:`horovod_twobit.state.fallback`) for
    the buckets of one group of ``size`` ranks (``broadcast(floats, name)`` gives rank 0's
    floats on every rank). Each bucket counts its own launches, so a launch's mode is a
    function of that count alone, the same on every rank: the model's pick at a bucket's first
    launch, the schedule's modes in turns after it (another block of them at a time while rank
    0's rounds are not sure), then the mode rank 0's medians chose. A bucket
    first seen after the schedule was made (a new tensor size, a new group) is checked anew, with
    the others that first launch in the same step, by a later checker (:attr:`late`)."""

    def __init__(self, size, broadcast, generation=0):
        self.size, self.broadcast, self.generation = size, broadcast, generation
        self.late = None
        self.picks = {}  # the model's picks, fallback.decide's cache
        self.launches = {}  # bucket key -> its launches so far
        self.first = {}  # bucket key -> (model pick, modelled (compressed s, plain s))
        self.steps = None  # the schedule so far, made at the first bucket's second launch
        self.full, self.ends = None, None  # every block's schedule; where a block may end it
        self.starts = {}  # checked step -> when its first gradient arrived
        self.chosen = None
        self.figures = None  # rank 0's median span per mode
        self._lock = threading.Lock()
        self._deciding = threading.Lock()

    def plain(self, key, pick, times, started):
        """(Whether bucket ``key``, whose model pick is ``pick``, goes plain at this launch; the
        checker that decided and the launch's step, for :meth:`settled`). ``times()``: the
        model's (compressed, plain) seconds for the bucket; ``started``: when its first member
        arrived (``time.perf_counter``)."""
        with self._lock:
            late = key not in self.first and self.steps is not None
            if late and self.late is None:
                self.late = Checker(self.size, self.broadcast, self.generation + 1)
        if late:
            return self.late.plain(key, pick, times, started)
        with self._lock:
            k = self.launches.get(key, 0)
            self.launches[key] = k + 1
            if k == 0:
                self.first[key] = (pick, times())
            elif self.steps is None:  # every bucket of step 0 has launched
                self.full, self.ends = fallback.blocks(list(self.first.values()))
                self.steps = self.full[:self.ends[0]]
            if 1 <= k <= len(self.steps or ()) + 1:  # (the step after the schedule ends its last)
                self.starts[k] = min(self.starts.get(k, float("inf")), started)
        if self.steps is not None and k > len(self.steps) and self.chosen is None:
            self._decide(k)  # the first launch after the schedule, on every rank
        if k == 0:
            mode = fallback.MODEL
        elif k <= len(self.steps):
            mode = self.steps[k - 1]
        else:
            mode = self.chosen
        return fallback.is_plain(mode, pick), (self, k)

    def next_plain(self, key):
        """Whether bucket ``key``'s next launch is a scheduled plain one (see
        ``TwoBitState.next_plain``): within the schedule, not its first launch nor the one
        after the schedule, and not a bucket that a later checker checks."""
        with self._lock:
            k = self.launches.get(key, 0)
            if key not in self.first or self.steps is None or not 1 <= k <= len(self.steps):
                return False
            return fallback.is_plain(self.steps[k - 1], self.first[key][0])

    def settled(self, step):
        """Whether a bucket's launch ``step`` took the chosen mode, as all its later ones will."""
        return self.chosen is not None and step > len(self.steps)

    def _decide(self, k):
        """At launch ``k``, the first after the schedule so far: decides, or makes the schedule
        a block longer (:func:`fallback.assess`, rank 0's verdict)."""
        with self._deciding:
            if self.chosen is not None or k <= len(self.steps):
                return  # decided or made longer by another bucket's launch of this step
            steps = self.steps
            if not steps:
                self.chosen = fallback.MODEL
                return
            with self._lock:
                starts = [self.starts.get(j) for j in range(1, len(steps) + 2)]
            got = fallback.assess(steps, starts, len(steps) >= self.ends[-1])
            if self.size > 1:
                got = self.broadcast(got, "twobit.fallback.checked.%d.%d"
                                     % (self.generation, len(steps)))
            figures, chosen, length = fallback.verdict(got, len(steps), self.ends,
                                                       "%d buckets" % len(self.first))
            if chosen is None:  # a block longer
                with self._lock:
                    self.steps = self.full[:length]
                return
            self.figures, self.chosen = figures, chosen

    def summaries(self):
        """The checks for the stats, this one's and its later checkers', once decided."""
        mine = [self.summary()] if self.chosen is not None else []
        return mine + (self.late.summaries() if self.late is not None else [])

    def summary(self):
        return fallback.summary(len(self.steps or ()), self.chosen, self.figures or ())
