"""The compressor's saved state, shared by both bindings: residuals plus what they belong to."""

import warnings

from . import wire


def make(threshold, rank, size, residuals, owner_residuals=None):
    """The ``state_dict()`` of a compressor: this rank's residuals with the threshold, rank and
    number of ranks they belong to; with the scatter exchange, also the residuals it keeps as
    the owner of chunks (keyed by bucket)."""
    out = {"format_version": wire.FORMAT_VERSION, "threshold": threshold,
           "rank": rank, "size": size, "residuals": residuals}
    if owner_residuals:
        out["owner_residuals"] = owner_residuals
    return out


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
