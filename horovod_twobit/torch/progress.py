"""Progress of scatter exchanges. A scatter step has two collectives, and its second (the
owners' allgather) can only be submitted once its first (the alltoall) is done; nothing runs in
the background to do that, so whichever wait comes first does it for every step in flight.

Every wait of this package (and ``hvd.synchronize`` through the router) polls instead of blocking
while a scatter step's second phase is not yet submitted, submitting each as soon as its first
phase completes, in launch order. So ranks that wait on their steps in different orders still
submit every collective the others wait on: no rank blocks on a phase 2 that another rank would
only submit after its own wait returns.
"""

import threading
import time

_pending = []  # flights whose second phase is not submitted yet, in launch order
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


def wait(done):
    """Advances flights until ``done()`` or until no flight needs progress; then a blocking wait
    can no longer starve another rank."""
    delay = 2e-5
    while True:
        advance()
        if done() or not _pending:
            return
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)
