"""What both bindings' ``TwoBitState`` share about their options and their owners' residuals."""

import warnings

from horovod_twobit import wire
from horovod_twobit.wire import layout


def args_repr(state, min_numel=0):
    """The arguments of ``state`` that differ from the defaults, as a constructor call spells them
    (``"threshold='auto', bucket_bytes=0, exchange='scatter'"``)."""
    extra = ", min_numel=%d" % min_numel if min_numel else ""
    extra += wire.auto_args_repr(state.threshold, state.auto_rule, state.block, state.blocks)
    if state.bucket_bytes != layout.DEFAULT_BUCKET_BYTES:
        extra += ", bucket_bytes=%d" % state.bucket_bytes
    if state.exchange != "allgather":
        extra += ", exchange=%r" % state.exchange
    if state.fallback:
        extra += ", fallback=%r" % state.fallback
    return "threshold=%r%s" % (state.threshold, extra)


def owners_move(owner_of, rank, size, kept):
    """Whether the scatter owners' residuals, kept for ``owner_of`` (rank, size) or None, must
    restart for this (rank, size); warns when ``kept`` residuals are dropped so."""
    if owner_of == (rank, size):
        return False
    if owner_of is not None and kept:
        warnings.warn("horovod-twobit: the ranks changed (this was rank %d of %d, now %d of %d): "
                      "the scatter owners' residuals restart from zero; the workers' residuals "
                      "are kept" % (*owner_of, rank, size))
    return True
