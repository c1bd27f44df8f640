"""What reading ``compressor.stats()`` after every step costs, for ``examples/bench_buckets.py
--read-stats``: each compressed method ``M`` gets a twin ``M+stats`` that runs the same step (the
same model, optimizer and compressor) and then reads the stats, in PyTorch and TensorFlow's tape
loop with ``compressor.stats()``, in Keras' fit loop through
:class:`~horovod_twobit.tensorflow.TwoBitStatsCallback` with ``every=1`` (its
``on_train_batch_end``, as ``model.fit`` calls it). The twins take turns with the other methods, so
the machine's load falls on the steps with and without reading alike.

:func:`table` reports, per compressed method, the median step without and with the read, their
difference as a percentage of the step (the overhead), and the read alone (timed around it in
the ``+stats`` steps) as a percentage of the step: the first is what a run sees, the second the
same cost without the noise of two step-time medians."""

import time

SUFFIX = "+stats"


def compressed(method):
    """Whether a bench_buckets method uses a TwoBitCompressor (it has stats to read)."""
    return method.partition("/")[0].split("_fallback")[0] in ("twobit", "auto")


def add_reads(steps_of, counts, build, fit=False):
    """Puts a ``M+stats`` step after every compressed method ``M`` of ``steps_of`` (in place,
    ``counts`` too): the step of a second instance of ``M`` (``build(M)`` -> (step, number of
    tensors, compressor)), then the stats read, timed; ``fit``: read through the Keras callback
    (the step returns the loss). Returns {``M+stats``: the list of read durations, one per step
    run}."""
    reads, order = {}, list(steps_of.items())
    steps_of.clear()
    for method, step in order:
        steps_of[method] = step
        if not compressed(method):
            continue
        twin = method + SUFFIX
        twin_step, counts[twin], compressor = build(method)
        reads[twin] = []
        steps_of[twin] = _reading(twin_step, _reader(compressor, fit), reads[twin])
    return reads


def _reader(compressor, fit):
    if not fit:
        return lambda _: compressor.stats()
    from horovod_twobit.tensorflow import TwoBitStatsCallback
    callback = TwoBitStatsCallback(compressor, every=1)
    return lambda loss: callback.on_train_batch_end(0, {"loss": float(loss)})


def _reading(step, read, durations):
    def run():
        out = step()
        t0 = time.perf_counter()
        read(out)
        durations.append(time.perf_counter() - t0)
    return run


def timed_reads(reads, times):
    """The read durations of the timed steps only (the last ones; warm-up steps ran first)."""
    return {m: d[len(d) - len(times[m]):] for m, d in reads.items()}


def table(results, reads, framework):
    """A markdown table per (model, compressed method): ``results`` {(model, method): (median
    step, ...)} with the ``+stats`` twins, ``reads`` {(model, twin): median read}."""
    lines = ["| model (%s) | method | step (ms) | with stats() (ms) | overhead | stats() (ms) "
             "| stats() / step |" % framework, "|---|---|---|---|---|---|---|"]
    for (model, twin), read in sorted(reads.items()):
        method = twin[:-len(SUFFIX)]
        base, with_read = results[(model, method)][0], results[(model, twin)][0]
        lines.append("| %s | %s | %.1f | %.1f | %+.1f %% | %.2f | %.1f %% |" % (
            model, method, 1e3 * base, 1e3 * with_read, 100 * (with_read / base - 1),
            1e3 * read, 100 * read / base))
    return "\n".join(lines)
