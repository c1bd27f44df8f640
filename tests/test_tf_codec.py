"""The TensorFlow codec against the NumPy reference, bit for bit, eagerly and inside tf.function."""

import numpy as np
import pytest
import tensorflow as tf

from horovod_twobit import reference as ref
from horovod_twobit.tensorflow import decode, encode

SIZES = [0, 1, 15, 16, 17, 1000, 2 ** 20 + 3]
THRESHOLDS = [0.5, 0.1, 1e-3]


def _grads(n, t, steps, seed):
    rng = np.random.default_rng(seed)
    # a mix of values far below, near and far above the threshold
    return [(rng.standard_normal(n) * t * rng.choice([0.1, 0.7, 3.0], n)).astype(np.float32)
            for _ in range(steps)]


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("t", THRESHOLDS)
def test_encode_decode_match_reference(n, t, mode):
    r_ref = np.zeros(n, np.float32)
    r = tf.Variable(tf.zeros([n]))
    enc = lambda g: encode(g, r, t)  # noqa: E731
    dec = lambda w: decode(w, n, t)  # noqa: E731
    if mode == "function":
        enc, dec = tf.function(enc), tf.function(dec)
    for g in _grads(n, t, 3, n):
        want = ref.encode(g, r_ref, t)
        got = enc(tf.constant(g))
        assert got.dtype == tf.int32 and tuple(got.shape) == (-(-n // 16),)
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(_bits(r.numpy()), _bits(r_ref))
        out = dec(got)
        assert out.dtype == tf.float32 and tuple(out.shape) == (n,)
        np.testing.assert_array_equal(_bits(out.numpy()), _bits(ref.decode(want, n, t)))


def test_layout_example():
    words = encode(tf.constant([0.5, -0.5, 0.0, 0.7]), tf.Variable(tf.zeros(4)), 0.5)
    assert tf.bitcast(words, tf.uint8).numpy().reshape(-1).tolist() == [0xE3, 0, 0, 0]


def test_residual_any_shape_and_half_precision():
    g = tf.random.stateless_normal([3, 5], seed=[1, 2], dtype=tf.float16)
    r = tf.Variable(tf.zeros([3, 5]))
    r_ref = np.zeros(15, np.float32)
    want = ref.encode(g.numpy().astype(np.float32).reshape(-1), r_ref, 0.5)
    np.testing.assert_array_equal(encode(g, r, 0.5).numpy(), want)
    np.testing.assert_array_equal(r.numpy().reshape(-1), r_ref)


def test_unknown_static_shape_in_function():
    """Inside a tf.function traced for any length, sizes are computed at run time."""
    r = tf.Variable(tf.zeros([37]))
    r_ref = np.zeros(37, np.float32)
    enc = tf.function(lambda g: encode(g, r, 0.1), input_signature=[tf.TensorSpec([None], tf.float32)])
    dec = tf.function(lambda w: decode(w, 37, 0.1), input_signature=[tf.TensorSpec([None], tf.int32)])
    for g in _grads(37, 0.1, 3, 5):
        want = ref.encode(g, r_ref, 0.1)
        got = enc(tf.constant(g))
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(r.numpy(), r_ref)
        np.testing.assert_array_equal(dec(got).numpy(), ref.decode(want, 37, 0.1))


def test_non_finite_values_send_nothing():
    g = np.array([np.nan, np.inf, -np.inf, 0.7], np.float32)
    r_ref = np.zeros(4, np.float32)
    r = tf.Variable(tf.zeros(4))
    want = ref.encode(g, r_ref, 0.5)
    np.testing.assert_array_equal(encode(tf.constant(g), r, 0.5).numpy(), want)
    np.testing.assert_array_equal(_bits(r.numpy()), _bits(r_ref))


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        encode(tf.zeros(3), tf.Variable(tf.zeros(3)), -1)
    with pytest.raises(TypeError, match="float32"):
        encode(tf.zeros(3), tf.Variable(tf.zeros(3, tf.float64)), 0.5)
    with pytest.raises(TypeError, match="tf.Variable"):
        encode(tf.zeros(3), tf.zeros(3), 0.5)
    with pytest.raises(ValueError, match="values"):
        encode(tf.zeros(3), tf.Variable(tf.zeros(4)), 0.5)
    with pytest.raises(TypeError, match="floating-point"):
        encode(tf.zeros(3, tf.int32), tf.Variable(tf.zeros(3)), 0.5)
    with pytest.raises(TypeError, match="IndexedSlices"):
        encode(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2])),
               tf.Variable(tf.zeros(6)), 0.5)
    with pytest.raises(ValueError, match="words"):
        decode(tf.zeros(2, tf.int32), 40, 0.5)
    with pytest.raises(TypeError, match="int32"):
        decode(tf.zeros(3, tf.float32), 40, 0.5)
    with pytest.raises(ValueError, match="numeric threshold"):
        decode(tf.zeros(3, tf.int32), 40, "auto")


@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs a GPU")
def test_gpu_matches_cpu():
    g = np.random.default_rng(0).standard_normal(100003).astype(np.float32)
    with tf.device("/CPU:0"):
        r1 = tf.Variable(tf.zeros(100003))
        w1 = encode(tf.constant(g), r1, 0.5)
        d1 = decode(w1, 100003, 0.5)
    with tf.device("/GPU:0"):
        r2 = tf.Variable(tf.zeros(100003))
        w2 = encode(tf.constant(g), r2, 0.5)
        d2 = decode(w2, 100003, 0.5)
        assert "GPU" in w2.device and "GPU" in d2.device
    np.testing.assert_array_equal(w1.numpy(), w2.numpy())
    np.testing.assert_array_equal(r1.numpy(), r2.numpy())
    np.testing.assert_array_equal(d1.numpy(), d2.numpy())
