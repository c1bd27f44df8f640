"""Both bindings against the shared test vectors (tests/vectors/twobit.json, made from the NumPy
reference by tests/vectors/make_vectors.py): same words, same bytes in memory, same residual bits,
same decoded values; and a payload encoded by one framework decodes to the same values in the other."""

import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "vectors"))

import make_vectors  # noqa: E402

with open(make_vectors.PATH) as _f:
    VECTORS = json.load(_f)
CASES = VECTORS["cases"]
IDS = [c["name"] for c in CASES]
AUTO = VECTORS["auto_cases"]
AUTO_IDS = [c["name"] for c in AUTO]


def f32(values):
    return np.array(values, dtype=np.float64).astype(np.float32)


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def test_file_is_what_the_reference_makes():
    assert make_vectors.dumps(make_vectors.build()) == make_vectors.dumps(VECTORS), \
        "tests/vectors/twobit.json is stale: run python tests/vectors/make_vectors.py"
    names = set(IDS)
    assert {"layout_0xE3", "random_n0_t0.5", "random_n1_t0.5", "random_n15_t0.1", "random_n16_t0.5",
            "random_n17_t0.001", "random_n100_t0.1"} <= names
    assert {"auto_zeros", "auto_empty", "auto_mean_n17", "auto_rms_n100"} <= set(AUTO_IDS)


def test_layout_example_is_0xE3():
    case = CASES[IDS.index("layout_0xE3")]
    assert case["steps"][0]["bytes"] == "e3000000"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch(case):
    torch = pytest.importorskip("torch")
    from horovod_twobit.torch import decode, encode
    n, t = case["numel"], case["threshold"]
    r = torch.zeros(n)
    for step in case["steps"]:
        words = encode(torch.from_numpy(f32(step["grad"])), r, t)
        assert words.dtype == torch.int32 and tuple(words.shape) == (len(step["words"]),)
        assert words.tolist() == step["words"]
        assert bytes(words.view(torch.uint8).tolist()).hex() == step["bytes"]
        np.testing.assert_array_equal(bits(r.numpy()), bits(f32(step["residual"])))
        np.testing.assert_array_equal(bits(decode(words, n, t).numpy()), bits(f32(step["decoded"])))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tensorflow(case):
    tf = pytest.importorskip("tensorflow")
    from horovod_twobit.tensorflow import decode, encode
    n, t = case["numel"], case["threshold"]
    r = tf.Variable(tf.zeros([n]))
    for step in case["steps"]:
        words = encode(tf.constant(f32(step["grad"])), r, t)
        assert words.dtype == tf.int32 and tuple(words.shape) == (len(step["words"]),)
        assert words.numpy().tolist() == step["words"]
        assert tf.bitcast(words, tf.uint8).numpy().tobytes().hex() == step["bytes"]
        np.testing.assert_array_equal(bits(r.numpy()), bits(f32(step["residual"])))
        np.testing.assert_array_equal(bits(decode(words, n, t).numpy()), bits(f32(step["decoded"])))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_payloads_cross_frameworks(case):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("tensorflow")
    import horovod_twobit.tensorflow as htf
    import horovod_twobit.torch as hpt
    n, t = case["numel"], case["threshold"]
    for step in case["steps"]:
        raw = bytes.fromhex(step["bytes"])
        from_torch = torch.frombuffer(bytearray(raw), dtype=torch.int32) if raw else \
            torch.zeros(0, dtype=torch.int32)
        in_tf = htf.decode(tf.constant(from_torch.numpy()), n, t).numpy()
        from_tf = tf.bitcast(tf.constant(np.frombuffer(raw, dtype=np.uint8).reshape(-1, 4)), tf.int32)
        in_torch = hpt.decode(torch.from_numpy(from_tf.numpy()), n, t).numpy()
        np.testing.assert_array_equal(bits(in_tf), bits(in_torch))
        np.testing.assert_array_equal(bits(in_tf), bits(f32(step["decoded"])))


def _check_auto_step(step, n, t_bits, v_bits, words, residual, decoded):
    assert t_bits == step["threshold_bits"]
    assert v_bits == step["magnitude_bits"]
    assert list(words) == step["words"]
    np.testing.assert_array_equal(bits(residual), bits(f32(step["residual"])))
    np.testing.assert_array_equal(bits(decoded), bits(f32(step["decoded"])))


@pytest.mark.parametrize("case", AUTO, ids=AUTO_IDS)
def test_auto_torch(case):
    torch = pytest.importorskip("torch")
    from horovod_twobit.torch.codec import levels
    from horovod_twobit.torch import decode, encode
    n = case["numel"]
    r = torch.zeros(n)
    for step in case["steps"]:
        g = torch.from_numpy(f32(step["grad"]))
        t, v = levels.auto_levels(r, g, case["rule"])
        words = encode(g, r, float(t), float(v))
        _check_auto_step(step, n, int(t.reshape(1).view(torch.int32)[0]),
                         int(v.reshape(1).view(torch.int32)[0]), words.tolist(),
                         r.numpy(), decode(words, n, float(v)).numpy())


@pytest.mark.parametrize("case", AUTO, ids=AUTO_IDS)
def test_auto_tensorflow(case):
    tf = pytest.importorskip("tensorflow")
    from horovod_twobit.tensorflow import auto_levels, decode, encode
    n = case["numel"]
    r = tf.Variable(tf.zeros([n]))
    for step in case["steps"]:
        g = tf.constant(f32(step["grad"]))
        t, v = auto_levels(r, g, case["rule"])
        words = encode(g, r, float(t), float(v))
        _check_auto_step(step, n, int(tf.bitcast(t, tf.int32)), int(tf.bitcast(v, tf.int32)),
                         words.numpy().tolist(), r.numpy(), decode(words, n, float(v)).numpy())


# ---- the scatter exchange's "auto" phase 2 (tests/vectors/owner3.json, make_owner_vectors.py)
import make_owner_vectors  # noqa: E402

with open(make_owner_vectors.PATH) as _f:
    OWNER = json.load(_f)
OWNER_IDS = [c["name"] for c in OWNER["cases"]]


def test_owner_file_is_what_the_reference_makes():
    assert make_owner_vectors.dumps(make_owner_vectors.build()) == make_owner_vectors.dumps(OWNER), \
        "tests/vectors/owner3.json is stale: run python tests/vectors/make_owner_vectors.py"
    assert {"ties_half_to_even", "zeros", "nonfinite_member", "pieces_error_feedback"} <= set(OWNER_IDS)


def _check_owner_step(step, body, residual, decoded):
    assert list(body) == step["body"]
    assert list(body[:len(step["scale_bits"])]) == step["scale_bits"]
    np.testing.assert_array_equal(bits(residual), bits(f32(step["residual"])))
    np.testing.assert_array_equal(bits(decoded), bits(f32(step["decoded"])))


@pytest.mark.parametrize("case", OWNER["cases"], ids=OWNER_IDS)
def test_owner_torch(case):
    torch = pytest.importorskip("torch")
    from horovod_twobit.torch.codec import owner as owner_codec
    pieces, n, nw = [tuple(p) for p in case["pieces"]], case["nvalues"], case["words"]
    e = torch.zeros(n)
    one = torch.tensor(1.0)
    for step in case["steps"]:
        body = owner_codec.owner_encode(pieces, nw, e, torch.from_numpy(f32(step["sum"])), step["bad"])
        decoded = owner_codec.owner_values(body, pieces, nw, n, one, one)
        _check_owner_step(step, body.tolist(), e.numpy(), decoded.numpy())


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("case", OWNER["cases"], ids=OWNER_IDS)
def test_owner_tensorflow(case, graph):
    """Eagerly and in a tf.function (where Grappler rewrites the graph)."""
    tf = pytest.importorskip("tensorflow")
    from horovod_twobit.tensorflow.codec import owner as owner_codec
    pieces, n, nw = [tuple(p) for p in case["pieces"]], case["nvalues"], case["words"]

    def step_fn(e, S, bad, one):
        body, e = owner_codec.owner_encode(pieces, nw, e, S, bad)
        return body, e, owner_codec.owner_values(body, pieces, nw, n, one, one)
    fn = tf.function(step_fn) if graph else step_fn
    e = tf.zeros([n])
    for step in case["steps"]:
        body, e, decoded = fn(e, tf.constant(f32(step["sum"])), tf.constant(step["bad"]),
                              tf.constant(1.0))
        _check_owner_step(step, body.numpy().tolist(), e.numpy(), decoded.numpy())
