"""Elastic Horovod: residuals are part of the committed state.

``hvd.elastic.TorchState(model, optimizer, twobit=compressor)`` handles a ``TwoBitCompressor``
with :class:`TwoBitStateHandler` (registered when ``horovod_twobit.torch`` is imported):

- ``state.commit()`` snapshots this worker's residuals with the model and optimizer;
- after a failure, ``state.restore()`` rolls every worker's residuals back to that snapshot, like
  the weights;
- on a membership change, each surviving worker keeps its own residuals (a residual is the part
  of that worker's gradients it has not sent yet; it does not depend on the worker's rank number,
  and there is nothing to broadcast); a new worker starts from zero; what a removed worker had not
  sent (at most one threshold per value) is lost;
- with the scatter exchange and ``threshold="auto"``, the residuals a worker keeps as the owner of
  chunks are saved and rolled back alike; when the rank or the number of ranks changes, its
  chunks move, so they restart from zero with a warning.
"""

import horovod.torch.elastic.state as _state

from horovod_twobit.torch.compressor import TwoBitCompressor


class TwoBitStateHandler(_state.StateHandler):
    """Saves, restores and resets a TwoBitCompressor's residuals for elastic training."""

    def __init__(self, compressor):
        super().__init__(compressor)
        self._saved = self._snapshot()

    def _snapshot(self):
        c = self.value.state
        return c.residuals.state_dict(), c.owners.state_dict(), c._owner_of

    def save(self):
        self._saved = self._snapshot()

    def restore(self):
        c = self.value.state
        residuals, owners, c._owner_of = self._saved
        c.residuals.load_state_dict(residuals)
        c.owners.load_state_dict(owners)
        c.agreed.clear()

    def sync(self):
        """Nothing to synchronize: residuals are per worker by design. The workers may have
        changed, so scatter buckets announce their exchange again on their next step."""
        self.value.state.agreed.clear()


def register():
    """Makes ``TorchState`` use :class:`TwoBitStateHandler` for TwoBitCompressor values."""
    registry = _state.get_handler_registry()
    if not any(cls is TwoBitStateHandler for _, cls in registry):
        _state.set_handler_registry([(TwoBitCompressor, TwoBitStateHandler)] + list(registry))
