"""TwoBitCompressor through Horovod's own, unmodified TensorFlow API (DistributedGradientTape eager
and under tf.function, horovod.tensorflow.keras.DistributedOptimizer with model.fit,
hvd.allreduce), in real horovodrun jobs with Gloo."""

import re

import numpy as np
import pytest

import jobs
import sim
from horovod_twobit import reference as ref

VARS = ["hidden/bias", "hidden/kernel", "out/bias", "out/kernel"]


CONFIGS = [  # (mode, ranks, groups, threshold, block, blocks)
    ("tape_eager", 2, 0, 0.5, None, None),
    ("tape_eager", 3, 2, 0.1, None, None),
    ("tape_function", 2, 0, 0.1, None, None),
    ("tape_function", 3, 0, 0.5, None, None),
    ("keras", 2, 0, 0.5, None, None),
    ("keras", 3, 2, 0.1, None, None),
    # threshold="auto": each rank's own t per tensor (blocks=1) or per block and step, carried in
    # the header and after it
    ("tape_function", 2, 0, "auto", None, 1),
    ("keras", 3, 2, "auto", None, None),
    # block=32: one magnitude per block of 32 values (whole and partial blocks), after the header
    ("tape_function", 3, 2, "auto", 32, None),
    # block=16, blocks=4: at most four blocks per tensor, their size from the tensor's
    ("keras", 2, 0, "auto", 16, 4),
]


def _trained(tmp_path_factory, np_, config):
    """The directory where ``config`` saved its ranks' records: one horovodrun job per number of
    ranks runs all of that number's configurations in turn, each with its own model and
    compressor."""
    mine = [c for c in CONFIGS if c[1] == np_]

    def job():
        out = tmp_path_factory.mktemp("tf_train_np%d" % np_)
        specs = ["%s:%s:%d:%s:%s" % (m, t, g, b or "-", bs or "-") for m, _, g, t, b, bs in mine]
        jobs.run(np_, "tf_train.py", "--out", out, "--steps", 20, "--configs", *specs,
                 timeout=600)
        return out

    return jobs.shared(("tf_train", np_), job) / str(mine.index(config))


@pytest.mark.slow
@pytest.mark.parametrize("mode,np_,groups,threshold,block,blocks", CONFIGS)
def test_training_matches_simulation(tmp_path_factory, mode, np_, groups, threshold, block,
                                     blocks):
    out = _trained(tmp_path_factory, np_, (mode, np_, groups, threshold, block, blocks))
    ranks = sim.load_ranks(str(out), np_)
    # every rank's averaged gradients equal the N-worker simulation's, bit for bit, for 20 steps,
    # and the weights end identical on every rank
    sim.check_training(ranks, threshold, 20, block=block, blocks=blocks)
    # an ordinary allreduce in the same job is exact and uncompressed
    want = sum(np.arange(10, dtype=np.float32) * (r + 1) + np.float32(0.001) for r in range(np_))
    for r in ranks:
        np.testing.assert_array_equal(r["plain"], want.astype(np.float32))
    # hvd.allreduce(t, name="direct", compression=...) inside a tf.function traced for two input
    # signatures: one residual under its name, carried from one call to the next
    w = ref.Workers(np_, threshold, block=block, blocks=blocks)
    for i in range(2):
        expect = w.allreduce("direct", [r["direct_in/%d" % i] for r in ranks])
        if threshold == "auto":  # one t per sender, each decoded with its own
            assert len(set(float(np.atleast_1d(t)[-1]) for t in w.last_thresholds["direct"])) == np_
        for r in ranks:
            np.testing.assert_array_equal(r["direct_out/%d" % i], expect)
    # hvd.grouped_allreduce(name="grp", op=hvd.Sum): floats compressed as "grp.<i>", int32 exact
    for i in (0, 2):
        expect = w.allreduce("grp.%d" % i, [r["grp_in/%d" % i] for r in ranks], op="sum")
        for r in ranks:
            np.testing.assert_array_equal(r["grp_out/%d" % i], expect)
    for r in ranks:
        assert r["grp_out/1"].dtype == np.int32
        np.testing.assert_array_equal(r["grp_out/1"], np.arange(6) * sum(range(1, np_ + 1)))
    # prescale_factor * postscale_factor multiplies the average
    expect = w.allreduce("scaled", [r["scaled_in"] for r in ranks], prescale=0.5, postscale=3.0)
    for r in ranks:
        np.testing.assert_array_equal(r["scaled_out"], expect)
    for r in ranks:
        assert int(r["direct_traces"]) == 2  # one per signature: residuals cost no extra trace
        # one residual per variable (keyed by the variable's name) plus one per named tensor,
        # however many times anything was traced, and nothing else tracked by the compressor
        named = ["direct", "grp.0", "grp.2", "scaled"]
        assert sorted(r["residual_names"].tolist()) == sorted(VARS + named)
        assert int(r["tracked_variables"]) == len(VARS) + len(named)
        if mode == "tape_function":
            assert int(r["traces"]) == 2  # the training step was traced once per batch size


@pytest.mark.slow
def test_checkpoint_round_trip(tmp_path):
    res = jobs.run(2, "tf_state.py", tmp_path, timeout=240)
    for rank in range(2):
        assert ("rank %d checkpoint_same=True state_dict_same=True without_residuals_differs=True "
                "nonzero_residual=True other_rank_ok=True "
                "residuals=hidden/bias,hidden/kernel,out/bias,out/kernel"
                % rank in res.output), res


ERRORS = {
    # case: (exception type, pattern); None: the case must work
    "threshold": ("PayloadMismatchError",
                  r"tensor 'x': ranks use different thresholds \[0\.5, 0\.25\] \(by rank\).*same threshold"),
    "threshold_function": ("UnknownError",
                           r"PayloadMismatchError: tensor 'x': ranks use different thresholds \[0\.5, 0\.25\]"),
    "threshold_tape": ("PayloadMismatchError", r"tensor 'v': ranks use different thresholds \[0\.5, 0\.25\]"),
    "size": ("PayloadMismatchError", r"different sizes \[40, 60\]|ends before"),
    "size_same_words": ("PayloadMismatchError", r"different sizes \[33, 34\]"),
    "noname": ("ValueError", r"pass name="),
    "class": ("TypeError", r"pass an instance"),
    "op": ("ValueError", r"op=hvd.Average and op=hvd.Sum only \(got hvd.Max\)"),
    "adasum": ("ValueError", r"got hvd.Adasum"),
    "sparse": ("ValueError", r"tf.IndexedSlices.*sparse_as_dense=True"),
    "auto_mixed": ("PayloadMismatchError",
                   r"tensor 'x': some ranks use threshold='auto' and others a fixed threshold "
                   r"\[True, False\].*same threshold"),
    "auto_mixed_tape": ("PayloadMismatchError",
                        r"tensor 'v': some ranks use threshold='auto' and others a fixed threshold "
                        r"\[False, True\]"),
    "auto_nonfinite": None,
    "sparse_as_dense": None,
    "nonfinite": None,
    "uninstalled": None,
    # last: Keras' train function is a graph, the error surfaces as TensorFlow's
    "threshold_keras": ("UnknownError",
                        r"PayloadMismatchError: tensor 'd/(kernel|bias)': ranks use different thresholds \[0\.5, 0\.25\]"),
}


@pytest.mark.slow
def test_errors_on_every_rank():
    """Each case raises the documented error on every rank, quickly, and the job carries on."""
    res = jobs.run(2, "tf_errors.py", *ERRORS, timeout=240)
    for case, expect in ERRORS.items():
        for rank in range(2):
            lines = [l for l in res.output.splitlines() if "CASE %s rank %d " % (case, rank) in l]
            assert len(lines) == 1, "case %s, rank %d: %r" % (case, rank, res)
            line = lines[0]
            if expect is None:
                assert line.endswith(" OK"), line
                continue
            kind, pattern = expect
            m = re.search(r"RAISED after ([0-9.]+)s: (\w+): (.*)", line)
            assert m, line
            assert m.group(2) == kind and re.search(pattern, m.group(3)), line
            assert float(m.group(1)) < 30, line
    assert "rank 0 finished" in res.output and "rank 1 finished" in res.output
    assert res.seconds < 180
