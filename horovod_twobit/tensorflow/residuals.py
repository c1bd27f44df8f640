"""Error-feedback state of the TensorFlow binding: one float32 ``tf.Variable`` per tensor name
(:class:`Residuals`), tracked for ``tf.train.Checkpoint`` per rank."""

import threading
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable

from horovod_twobit.wire import scatter as scatter_wire

FORMAT1_WARNING = (
    "horovod-twobit: this tf.train.Checkpoint holds scatter owner residuals of scatter format 1 "
    "(the 2-bit phase 2 of threshold='auto', saved without an owner format version); this "
    "version uses format %d (a 3-bit phase 2): the owners' residuals restart from zero; the "
    "workers' residuals are restored" % scatter_wire.FORMAT_VERSION)


class _Plain:
    """Holds state that must not become a checkpoint dependency."""

    def __init__(self):
        self.pending = {}
        self.variables = {}
        self.generation = 0  # counts the times variables were made or dropped
        self.eager_fns = {}
        self.tracked = None


class _Discard(trackable.Trackable):
    """Takes one format-1 owner residual from a checkpoint and keeps nothing; the first of a
    restore (``batch``: the restore's discards) calls ``on_restore``, which warns and sets the
    owners' residuals to zero."""

    def __init__(self, on_restore, batch):
        self._on_restore, self._batch, self.restored = on_restore, batch, False
        batch.append(self)  # alive as long as the restore's view of the checkpoint may look

    def _serialize_to_tensors(self):
        # read on restore only (for the value's dtype): never saved, see _Format1Owners
        return {trackable.VARIABLE_VALUE_KEY: tf.zeros([0], tf.float32)}

    def _restore_from_tensors(self, restored_tensors):
        if not any(d.restored for d in self._batch):
            self._on_restore()
        self.restored = True
        return tf.no_op()


class _Format1Owners(trackable.Trackable):
    """Stands where scatter format 1 saved the owners' residuals (``owners/_tracked/...``, no
    format version): each one a checkpoint holds there is restored into a :class:`_Discard`.
    Saves nothing (an empty node): format 2 saves them under ``format<v>``."""

    def __init__(self, on_restore):
        self._on_restore, self._batch = on_restore, []

    def _trackable_children(self, save_type=trackable.SaveType.CHECKPOINT, **kwargs):
        # a restore asks for the children once, then looks up each checkpointed one: one
        # warning per restore
        self._batch = []
        return {}

    def _lookup_dependency(self, name, cached_dependencies=None):
        return _Discard(self._on_restore, self._batch)


def rank_size():
    """(rank, size) of this Horovod process, or (0, 1) before ``hvd.init()``."""
    import horovod.tensorflow as hvd
    try:
        return hvd.rank(), hvd.size()
    except ValueError:
        return 0, 1


class Residuals(tf.Module):
    """The error-feedback state of one compressor: a float32 ``tf.Variable`` per tensor name.

    A residual is created at zero on the first exchange of its tensor and lives as long as the
    compressor: a ``tf.function`` that captured it keeps working whatever happens later
    (:meth:`reset` and :meth:`load_state_dict` assign values, they never replace variables). It is
    created under ``tf.init_scope()``, so a first use inside a ``tf.function`` (on any trace, not
    only the first) makes an ordinary eager variable, initialized there; the function is not
    traced a second time for it.

    Every residual is a checkpoint dependency of this module, saved as ``rank<r>of<n>/<name>``; a
    ``tf.train.Checkpoint`` restored before the residuals exist fills each one in when it is
    created. A residual belongs to the rank that made it, so a checkpoint written by another rank
    or with another number of ranks (the usual "save on rank 0 only") restores none of them: they
    start from zero, as with :meth:`TwoBitCompressor.load_state_dict`. Save one checkpoint per rank
    to restore them exactly.

    With ``format_version`` (the scatter owners' residuals) they are saved under
    ``format<v>/rank<r>of<n>/<name>`` instead of ``_tracked/...``; a checkpoint that holds
    residuals under ``_tracked`` (scatter format 1, whose owners' residuals belong to another
    phase 2) restores none of them: they restart from zero with a warning, as with
    :meth:`TwoBitCompressor.load_state_dict`.
    """

    def __init__(self, name="residuals", format_version=None):
        super().__init__(name=name)
        # Plain (untracked) state: name -> tf.Variable, and values from load_state_dict() for
        # residuals not created yet.
        self._plain = _Plain()
        self._lock = threading.RLock()
        # tracked by tf.Module: "rank<r>of<n>/<name>" -> tf.Variable
        if format_version is None:
            self._tracked = {}
            self._plain.tracked = self._tracked
        else:
            setattr(self, "format%d" % format_version, {})
            self._plain.tracked = getattr(self, "format%d" % format_version)
            self._tracked = _Format1Owners(self._format1_restored)

    def _format1_restored(self):
        """A checkpoint restores residuals saved for scatter format 1: warn, restart from zero."""
        warnings.warn(FORMAT1_WARNING)
        self.reset()

    @property
    def _by_name(self):
        return self._plain.variables

    def get(self, name, grad):
        """The residual (1-D, float32) for tensor ``name``, created at zero on first use. Raises if
        the tensor's size changed under the same name."""
        if not isinstance(name, str) or not name:
            raise ValueError("a residual needs a non-empty string name, got %r" % (name,))
        numel = grad.shape.num_elements()
        if numel is None:
            raise ValueError(
                "tensor %r has a shape that is not fully known (%s): TwoBitCompressor keeps a "
                "residual of fixed size per tensor and needs static shapes" % (name, grad.shape))
        with self._lock:
            r = self._by_name.get(name)
            if r is not None:
                if r.shape.num_elements() != numel:
                    raise ValueError(
                        "tensor %r changed size from %d to %d values; its residual cannot follow. "
                        "Give tensors of different sizes different names"
                        % (name, r.shape.num_elements(), numel))
                return r
            with tf.init_scope():
                init = tf.zeros([numel], tf.float32)
                pending = self._plain.pending.pop(name, None)
                if pending is not None:
                    pending = np.asarray(pending, dtype=np.float32).reshape(-1)
                    if pending.size != numel:
                        warnings.warn("horovod-twobit: restored residual %r has %d values but the "
                                      "gradient has %d; starting that residual from zero"
                                      % (name, pending.size, numel))
                    else:
                        init = tf.constant(pending)
                device = getattr(grad, "device", "") or ""
                with tf.device(device or None):
                    # The class itself, not tf.Variable: the creator scopes stay out, so a
                    # tf.function whose first trace made a residual is not traced a second time
                    # to lift initializers (this one is initialized eagerly, here).
                    r = resource_variable_ops.ResourceVariable(
                        init, trainable=False, name="twobit_residual",
                        synchronization=tf.VariableSynchronization.NONE,
                        aggregation=tf.VariableAggregation.NONE)
                self._by_name[name] = r
                self._plain.generation += 1
                # Tracked inside init_scope: a deferred checkpoint restore runs eagerly, once.
                self._plain.tracked["rank%dof%d/%s" % (rank_size() + (name,))] = r
            return r

    @property
    def generation(self):
        """A number that changes whenever a residual variable is made or dropped."""
        return self._plain.generation

    def variable(self, name):
        """The residual variable of ``name`` (KeyError if it was never created)."""
        with self._lock:
            return self._by_name[name]

    def names(self):
        with self._lock:
            return sorted(set(self._by_name) | set(self._plain.pending))

    def __len__(self):
        return len(self.names())

    def __contains__(self, name):
        with self._lock:
            return name in self._by_name or name in self._plain.pending

    def state_dict(self):
        """A dict name -> residual value (a NumPy float32 copy), pending values included. Eager only."""
        with self._lock:
            out = {k: v.numpy().copy() for k, v in self._by_name.items()}
            out.update({k: np.array(v, dtype=np.float32).reshape(-1)
                        for k, v in self._plain.pending.items() if k not in out})
            return out

    def load_state_dict(self, state):
        """Replaces all residuals: existing variables are assigned (those absent from ``state`` are
        zeroed), the others are created with their value on first use. Eager only."""
        with self._lock:
            pending = {}
            for k, v in self._by_name.items():
                if k in state:
                    value = np.asarray(state[k], dtype=np.float32).reshape(-1)
                    if value.size != v.shape.num_elements():
                        warnings.warn("horovod-twobit: restored residual %r has %d values but the "
                                      "gradient has %d; starting that residual from zero"
                                      % (k, value.size, v.shape.num_elements()))
                        value = np.zeros(v.shape.num_elements(), np.float32)
                    v.assign(value)
                else:
                    v.assign(tf.zeros_like(v))
            for k, value in state.items():
                if k not in self._by_name:
                    pending[k] = np.asarray(value, dtype=np.float32).reshape(-1)
            self._plain.pending = pending

    def reset(self):
        """Sets every residual to zero (the variables stay, so traced functions stay valid) and
        drops values restored for residuals not created yet."""
        with self._lock:
            for v in self._by_name.values():
                v.assign(tf.zeros_like(v))
            self._plain.pending = {}

    def forget(self):
        """Drops every residual (variables and values restored for residuals not created yet): the
        next use creates a new one at zero, of the size asked then. Functions traced before keep
        the variables they captured."""
        with self._lock:
            for k in list(self._plain.tracked):
                del self._plain.tracked[k]
            self._by_name.clear()
            self._plain.generation += 1
            self._plain.pending = {}
