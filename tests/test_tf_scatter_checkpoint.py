"""tf.train.Checkpoint and the scatter owners' residuals of the TensorFlow binding: scatter
format 2 saves them under ``owners/format2/...``; a checkpoint with owners' residuals where
format 1 (the 2-bit phase 2 of "auto") saved them, ``owners/_tracked/...`` without a format
version, restores its workers' residuals and restarts the owners' from zero with a warning.
One process (rank 0 of 1, Horovod not initialized)."""

import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

from horovod_twobit.tensorflow import TwoBitCompressor
from horovod_twobit.tensorflow.residuals import Residuals

WARNING = (r"tf.train.Checkpoint holds scatter owner residuals of scatter format 1 .the 2-bit "
           r"phase 2.*owners' residuals restart from zero; the workers' residuals are restored")
KEYS = ("b", "c")


def _compressor(format1=False):
    c = TwoBitCompressor("auto", exchange="scatter")
    if format1:  # the objects format 1 saved: owners' residuals as the workers', no version
        c.state.owners = c.owners = Residuals(name="owner_residuals")
    return c


def _fill(c):
    c.residuals.get("w", tf.zeros([3])).assign(np.full(3, 4.0, np.float32))
    for i, k in enumerate(KEYS):
        c.owner_residual(k, 5, 0, 1).assign(np.full(5, 2.0 + i, np.float32))


def _restore(c, prefix, create_first):
    """Restores ``prefix`` into ``c``, its residuals made before (set to 1) or after; returns
    (workers' residual 'w', owners' residuals, the restore's status, its warnings)."""
    if create_first:
        c.residuals.get("w", tf.zeros([3])).assign(np.ones(3, np.float32))
        for k in KEYS:
            c.owner_residual(k, 5, 0, 1).assign(np.ones(5, np.float32))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        status = tf.train.Checkpoint(twobit=c).restore(prefix)
        w = c.residuals.get("w", tf.zeros([3])).numpy()
        owners = [c.owner_residual(k, 5, 0, 1).numpy() for k in KEYS]
    mine = [str(x.message) for x in got if "horovod-twobit" in str(x.message)]
    return w, owners, status, mine


@pytest.mark.parametrize("create_first", [True, False])
def test_format1_checkpoint_restarts_owners_with_a_warning(tmp_path, create_first):
    old = _compressor(format1=True)
    _fill(old)
    prefix = tf.train.Checkpoint(twobit=old).save(str(tmp_path / "ckpt"))
    names = [n for n, _ in tf.train.list_variables(prefix)]
    assert "twobit/owners/_tracked/rank0of1.Sb/.ATTRIBUTES/VARIABLE_VALUE" in names
    w, owners, status, mine = _restore(_compressor(), prefix, create_first)
    assert len(mine) == 1, mine  # one warning per restore, whatever the number of buckets
    assert re.search(WARNING, mine[0]), mine[0]
    np.testing.assert_array_equal(w, np.full(3, 4.0))
    for e in owners:
        np.testing.assert_array_equal(e, np.zeros(5))
    status.expect_partial()  # the owners' residuals are not in it: they are new, at zero


@pytest.mark.parametrize("create_first", [True, False])
def test_current_checkpoint_restores_owners_silently(tmp_path, create_first):
    c = _compressor()
    _fill(c)
    prefix = tf.train.Checkpoint(twobit=c).save(str(tmp_path / "ckpt"))
    names = [n for n, _ in tf.train.list_variables(prefix)]
    assert "twobit/owners/format2/rank0of1.Sb/.ATTRIBUTES/VARIABLE_VALUE" in names
    assert not any("owners/_tracked" in n for n in names)
    w, owners, status, mine = _restore(_compressor(), prefix, create_first)
    assert mine == []
    np.testing.assert_array_equal(w, np.full(3, 4.0))
    for i, e in enumerate(owners):
        np.testing.assert_array_equal(e, np.full(5, 2.0 + i))
    status.assert_consumed()
    # a format-1 binary reading this checkpoint finds no owners' residuals where it looks
    old = _compressor(format1=True)
    tf.train.Checkpoint(twobit=old).restore(prefix).expect_partial()
    assert not old.owner_residual("b", 5, 0, 1).numpy().any()
