"""The PyTorch binding's residual store: a :class:`horovod_twobit.state.residuals.ResidualRegistry`
of float32 tensors on each gradient's device, saved as CPU copies (TensorFlow's store, of
``tf.Variable`` s, is :mod:`horovod_twobit.tensorflow.residuals`)."""

import torch

from horovod_twobit.state.residuals import ResidualRegistry


def _to_state(r):
    return r.detach().to("cpu", copy=True)


def _from_state(value, like):
    return like.copy_(torch.as_tensor(value).reshape(like.shape))


def Residuals():
    """A residual store keyed by tensor name (or, for the scatter owners, by bucket)."""
    return ResidualRegistry(
        zeros_like=lambda g: torch.zeros(g.shape, dtype=torch.float32, device=g.device),
        numel=lambda r: r.numel(), to_state=_to_state, from_state=_from_state)
