"""Residual registry: the error-feedback state of one compressor, keyed by tensor name."""

import threading
import warnings


class ResidualRegistry:
    """Maps a tensor name to its residual (float32, same shape and device as the gradient).

    Framework-neutral: ``zeros_like(grad)`` makes a fresh residual, ``to_state(r)`` and
    ``from_state(v, like)`` convert for ``state_dict()`` / ``load_state_dict()``. Safe to use from
    several threads (Horovod's hooks run during backward).
    """

    def __init__(self, zeros_like, numel, to_state=lambda r: r, from_state=lambda v, like: v):
        self._zeros_like = zeros_like
        self._numel = numel
        self._to_state = to_state
        self._from_state = from_state
        self._residuals = {}
        self._pending = {}  # restored values not yet bound to a gradient (device unknown until then)
        self._lock = threading.Lock()
        self.generation = 0  # changes whenever residuals are replaced (reset, load_state_dict)

    def get(self, name, grad):
        """The residual for ``name``, created at zero on first use. Raises if the tensor's size
        changed under the same name (a residual cannot be carried across a shape change)."""
        with self._lock:
            r = self._residuals.get(name)
            if r is None:
                pending = self._pending.pop(name, None)
                r = self._zeros_like(grad)
                if pending is not None:
                    if self._numel(pending) != self._numel(grad):
                        warnings.warn("horovod-twobit: restored residual %r has %d values but the "
                                      "gradient has %d; starting that residual from zero"
                                      % (name, self._numel(pending), self._numel(grad)))
                    else:
                        r = self._from_state(pending, r)
                self._residuals[name] = r
            elif self._numel(r) != self._numel(grad):
                raise ValueError(
                    "tensor %r changed size from %d to %d values; its residual cannot follow. Give "
                    "tensors of different sizes different names, or call compressor.reset()"
                    % (name, self._numel(r), self._numel(grad)))
            return r

    def lookup(self, name):
        """The residual of ``name`` if it has one in use, else None (nothing is created)."""
        with self._lock:
            return self._residuals.get(name)

    def bind(self, name, view):
        """Makes ``view`` (e.g. a slice of a bucket's flat buffer) the residual of ``name``, holding
        its current value: the residual it had, a restored one, or zero. Same size checks as
        :meth:`get`."""
        old = self.get(name, view)
        with self._lock:
            if old is not view:
                view.copy_(old.reshape(view.shape))
            self._residuals[name] = view

    def names(self):
        with self._lock:
            return sorted(set(self._residuals) | set(self._pending))

    def __len__(self):
        return len(self.names())

    def __contains__(self, name):
        with self._lock:
            return name in self._residuals or name in self._pending

    def state_dict(self):
        """A dict name -> residual copy (pending restored values included)."""
        with self._lock:
            out = {k: self._to_state(v) for k, v in self._residuals.items()}
            out.update({k: v for k, v in self._pending.items() if k not in out})
            return out

    def load_state_dict(self, state):
        """Replaces all residuals. Values are bound to each tensor's device on its next use."""
        with self._lock:
            self._residuals = {}
            self._pending = dict(state)
            self.generation += 1

    def reset(self):
        """Forgets every residual (they restart from zero)."""
        with self._lock:
            self._residuals = {}
            self._pending = {}
            self.generation += 1
