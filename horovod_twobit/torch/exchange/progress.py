"""Progress of scatter exchanges. A scatter step has two collectives, and its second (the
owners' allgather) can only be submitted once its first (the alltoall) is done; nothing runs in
the background to do that, so whichever wait comes first does it for every step in flight.

Every wait of this package (and ``hvd.synchronize`` through the router) polls instead of blocking
while a scatter step's second phase is not yet submitted, submitting each as soon as its first
phase completes, in launch order. So ranks that wait on their steps in different orders still
submit every collective the others wait on: no rank blocks on a phase 2 that another rank would
only submit after its own wait returns. The waits of TwoBit's own steps poll until their
result is there, sleeping between polls (:func:`wait`); so a rank waiting on the network leaves
its core to others, where Horovod's wait would spin.
"""

import threading
import time

_pending = []  # flights whose second phase is not submitted yet, in launch order
# (the first, the longest) sleep between two polls of :func:`wait`, in seconds; an emulation of
# slower hosts by time dilation D polls D times less often (examples/_cluster_worker.py)
DEFAULT_POLL_S = (2e-5, 5e-4)
POLL_S = DEFAULT_POLL_S
_lock = threading.RLock()
_inside = threading.local()


def add(flight):
    """Registers a flight with an ``advance()`` method that returns True once it needs no more
    progress (its second phase submitted, or failed)."""
    with _lock:
        _pending.append(flight)


def advance():
    """Submits the second phase of every flight whose first phase has completed. A no-op inside
    a flight's own ``advance()`` (its waits go through the router's ``synchronize``)."""
    if getattr(_inside, "advancing", False):
        return
    with _lock:
        _inside.advancing = True
        try:
            for f in list(_pending):
                if f.advance():
                    _pending.remove(f)
        finally:
            _inside.advancing = False


def wait(done, until_done=True):
    """Advances flights until ``done()``, sleeping between polls (20 µs, doubling up to 0.5 ms).

    Horovod's own wait (``synchronize``) spins: it yields the CPU and polls again at once, so a
    rank waiting on the network keeps a core busy. Sleeping instead leaves that core to whatever
    shares it (the intra-op threads of another rank on the same host, a data loader), for at most
    about 0.5 ms of added latency per wait and ~2 % of a core while it lasts.

    With ``until_done=False`` it returns as soon as no flight needs progress: a blocking wait can
    then no longer starve another rank (the router's ``synchronize`` of plain Horovod handles,
    which then waits as Horovod does)."""
    delay, longest = POLL_S
    while True:
        advance()
        # no flight needs progress: a blocking wait follows, and polling first would only cost
        # (the router's synchronize passes here for every Horovod handle)
        if (not until_done and not _pending) or done():
            return
        time.sleep(delay)
        delay = min(2 * delay, longest)
