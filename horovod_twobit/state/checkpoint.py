"""The compressor's saved state, shared by both bindings: residuals plus what they belong to."""

import warnings

from horovod_twobit.wire import scatter as scatter_wire
from horovod_twobit import wire


def make(threshold, rank, size, residuals, owner_residuals=None):
    """The ``state_dict()`` of a compressor: this rank's residuals with the threshold, rank and
    number of ranks they belong to; with the scatter exchange, also the residuals it keeps as
    the owner of chunks (keyed by bucket) and the scatter format they belong to."""
    out = {"format_version": wire.FORMAT_VERSION, "threshold": threshold,
           "rank": rank, "size": size, "residuals": residuals}
    if owner_residuals:
        out["owner_residuals"] = owner_residuals
        out["owner_format_version"] = scatter_wire.FORMAT_VERSION
    return out


def owner_residuals_to_load(state):
    """The scatter owners' residuals of ``state`` to restore (a dict, maybe empty). Those of
    another scatter format (a checkpoint written with the 2-bit phase 2 of "auto", which saved
    no ``owner_format_version``) restart from zero, with a warning."""
    owners = state.get("owner_residuals") or {}
    saved = state.get("owner_format_version", 1)
    if owners and saved != scatter_wire.FORMAT_VERSION:
        warnings.warn("horovod-twobit: this checkpoint's scatter owner residuals were written for "
                      "scatter format %d (%s), this version uses format %d (a 3-bit phase 2): "
                      "the owners' residuals restart from zero; the workers' residuals are "
                      "restored" % (saved, "the 2-bit phase 2 of threshold='auto'" if saved == 1
                                    else "unknown", scatter_wire.FORMAT_VERSION))
        return {}
    return owners


def residuals_to_load(state, threshold, rank, size):
    """The residuals of ``state`` to restore on this rank, or None when they must restart from
    zero (saved by another rank or with another number of ranks: a residual belongs to the rank
    that made it). Warns about either case and about a different threshold."""
    if not isinstance(state, dict) or "residuals" not in state:
        raise ValueError("not a TwoBitCompressor state_dict: expected a dict with 'residuals'")
    if state.get("threshold") != threshold:
        warnings.warn("horovod-twobit: restoring residuals saved with threshold %r into a "
                      "compressor with threshold %r" % (state.get("threshold"), threshold))
    saved = (state.get("rank", rank), state.get("size", size))
    if saved != (rank, size):
        warnings.warn("horovod-twobit: residuals were saved by rank %d of %d, this is rank %d "
                      "of %d; they restart from zero. Save compressor.state_dict() per rank to "
                      "restore them exactly." % (saved[0], saved[1], rank, size))
        return None
    return state["residuals"]
