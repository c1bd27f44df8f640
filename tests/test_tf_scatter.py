"""The scatter exchange of the TensorFlow binding in real horovodrun jobs, against the NumPy
reference, bit for bit: DistributedGradientTape eager and under tf.function, the Keras
DistributedOptimizer, single tensors, a NaN, and mismatches raising on every rank. One job per
number of ranks carries all of them (tests/workers/tf_scatter.py)."""

import re

import numpy as np
import pytest

import jobs
import sim
from horovod_twobit import reference as ref
from horovod_twobit.wire import scatter as sw
from horovod_twobit.wire.layout import Layout

STEPS = 3
ODD = (1, 17, 100, 16 * 7 + 3, 3000)
MODES = ("tape_eager", "tape_function", "keras")
SIZES = {"hidden/kernel": 480, "hidden/bias": 40, "out/kernel": 240, "out/bias": 6}
BUCKET = ["hidden/bias", "out/kernel", "out/bias"]  # bucket_bytes=2048; hidden/kernel alone
CASES = {
    "size_same_words": ("PayloadMismatchError", r"tensor 'x': ranks sent tensors of different "
                                                r"sizes \[33, 34(, 35)?(, 36)?\]"),
    "threshold_function": ("UnknownError", r"PayloadMismatchError: tensor 'x': ranks use "
                                           r"different thresholds \[0\.5, 0\.25"),
    "auto_mixed_tape": ("PayloadMismatchError", r"tensor 'v': some ranks use threshold='auto' "
                                                r"and others a fixed threshold"),
    # ranks mixing exchanges: the first scatter step's plan meets the allgather exchange's payload
    "exchange": ("PayloadMismatchError", r"tensor 'x': ranks \[1(, 2)?\] use exchange='scatter' "
                                         r"for it and ranks \[0\] exchange='allgather'"),
    "exchange_tape": ("PayloadMismatchError", r"tensor '[ab]'.*: ranks \[0\] use exchange="
                                              r"'scatter' for it and ranks \[1(, 2)?\] exchange="),
    "auto_exchange_function": ("UnknownError", r"PayloadMismatchError: tensor 'x': ranks \[1, 2\] "
                                               r"use exchange='scatter' for it and ranks \[0\]"),
}


def _cases(np_):
    return [c for c in CASES if np_ >= 3 or c != "auto_exchange_function"]  # 3000: scatter from N=3


CONFIGS = [(2, 0.05, "scatter"), (3, "auto", "scatter"), (3, 0.05, "auto")]


def _job(tmp_path_factory, np_, threshold, exchange):
    """(the job's Result, the ranks' records for this threshold and exchange): one horovodrun
    job per number of ranks runs that number's configurations in turn, and the cases once."""
    mine = [c for c in CONFIGS if c[0] == np_]

    def job():
        out = tmp_path_factory.mktemp("tf_scatter_np%d" % np_)
        res = jobs.run(np_, "tf_scatter.py", "--out", out, "--steps", STEPS, "--configs",
                       *["%s:%s" % (t, e) for _, t, e in mine], "--cases", *_cases(np_),
                       timeout=600)
        return res, out

    res, out = jobs.shared(("tf_scatter", np_), job)
    assert res.output.count("uses %s" % jobs.os.path.join(jobs.os.path.dirname(jobs.HERE),
                                                          "horovod_twobit")) == np_, res
    out = out / str(mine.index((np_, threshold, exchange)))
    return res, sim.load_ranks(str(out), np_)


def _check_training(ranks, mode, np_, threshold, exchange):
    """Every rank's aggregated gradients are the reference's, step by step; the weights end the
    same on every rank. Returns the mode's groups (buckets and tensors alone)."""
    r0 = ranks[0]
    assert sorted(r0[mode + "/layouts"].tolist()) == sorted([",".join(BUCKET), "hidden/kernel"])
    groups = [BUCKET, ["hidden/kernel"]]
    w = ref.Workers(np_, threshold, exchange=exchange)
    nonzero = 0
    for step in range(STEPS):
        for b in groups:
            want = w.bucket(b, [[r["%s/local/%d/%s" % (mode, step, n)] for n in b] for r in ranks])
            for n, x in zip(b, want):
                nonzero += np.count_nonzero(x)
                for rank, r in enumerate(ranks):
                    np.testing.assert_array_equal(r["%s/agg/%d/%s" % (mode, step, n)], x,
                                                  err_msg="%s rank %d step %d %s"
                                                  % (mode, rank, step, n))
    assert nonzero > 0
    for n in SIZES:
        for r in ranks[1:]:
            np.testing.assert_array_equal(r["%s/w/%s" % (mode, n)], r0["%s/w/%s" % (mode, n)])
    return groups


def _scatters(group, np_, threshold, exchange):
    return sw.choose(exchange, Layout([SIZES[n] for n in group], threshold == "auto"),
                     np_) == "scatter"


@pytest.mark.slow
@pytest.mark.parametrize("np_,threshold,exchange", CONFIGS)
def test_scatter_matches_reference(tmp_path_factory, np_, threshold, exchange):
    res, ranks = _job(tmp_path_factory, np_, threshold, exchange)
    for mode in MODES:
        groups = _check_training(ranks, mode, np_, threshold, exchange)
        scatter = [g[0] for g in groups if _scatters(g, np_, threshold, exchange)]
        if exchange == "scatter":
            assert len(scatter) == 2
        for r in ranks:  # the alltoalls traced (once or more per trace): one per scattered group
            names = r["alltoall/" + mode].tolist()
            assert len(set(names)) == len(scatter), names
    w = ref.Workers(np_, threshold, exchange=exchange)
    for step in range(3):
        for n in ODD:
            want = w.allreduce("single%d" % n, [r["single_in/%d/%d" % (n, step)] for r in ranks])
            for r in ranks:
                np.testing.assert_array_equal(r["single_out/%d/%d" % (n, step)], want)
        want = w.allreduce("sum", [r["sum_in/%d" % step] for r in ranks], op="sum",
                           prescale=0.5, postscale=3.0)
        for r in ranks:
            np.testing.assert_array_equal(r["sum_out/%d" % step], want)
    for r in ranks:
        got = set(r["alltoall/single"].tolist())
        want = {"HorovodTwoBit_%s" % ("single%d" % n if n != 70 else "sum") for n in ODD + (70,)
                if sw.choose(exchange, Layout([n], threshold == "auto"), np_) == "scatter"}
        assert got == want
    sim.check_scatter_nonfinite(ranks, w, threshold)
    _check_cases(res, np_)


def _check_cases(res, np_):
    """Each mismatch raised the documented error, the same message on every rank, quickly."""
    for case in _cases(np_):
        kind, pattern = CASES[case]
        msgs = set()
        for rank in range(np_):
            lines = [l for l in res.output.splitlines() if "CASE %s rank %d " % (case, rank) in l]
            assert len(lines) == 1, "case %s, rank %d: %r" % (case, rank, res)
            m = re.search(r"RAISED after ([0-9.]+)s: (\w+): (.*)", lines[0])
            assert m and m.group(2) == kind and re.search(pattern, m.group(3)), lines[0]
            assert float(m.group(1)) < 30, lines[0]
            msgs.add(m.group(3))
        assert len(msgs) == 1, msgs


def test_exchange_argument_and_owner_residuals():
    """exchange= is validated and shown; owners' residuals restart (with a warning) when the
    ranks change, and travel in state_dict() / load_state_dict() like the PyTorch binding's."""
    from horovod_twobit.tensorflow import TwoBitCompressor
    assert "exchange='scatter'" in repr(TwoBitCompressor(0.5, exchange="scatter"))
    assert "exchange" not in repr(TwoBitCompressor(0.5))
    for bad in ("Scatter", "", None, 2, "ring"):
        with pytest.raises(ValueError, match="exchange must be one of"):
            TwoBitCompressor(0.5, exchange=bad)
    c = TwoBitCompressor("auto", exchange="scatter")
    r = c.owner_residual("b", 10, 0, 2)
    r.assign(np.ones(10, np.float32))
    assert c.owner_residual("b", 10, 0, 2) is r
    with pytest.warns(UserWarning, match="rank 0 of 2, now 1 of 3.*workers' residuals are kept"):
        r2 = c.owner_residual("b", 7, 1, 3)
    assert r2.shape == [7] and not r2.numpy().any()
    # Horovod is not initialized here: this process is rank 0 of 1
    c = TwoBitCompressor("auto", exchange="scatter")
    c.owner_residual("b", 5, 0, 1).assign(np.full(5, 2.0, np.float32))
    st = c.state_dict()
    np.testing.assert_array_equal(st["owner_residuals"]["b"], np.full(5, 2.0, np.float32))
    c2 = TwoBitCompressor("auto", exchange="scatter")
    c2.load_state_dict(st)
    np.testing.assert_array_equal(c2.owner_residual("b", 5, 0, 1).numpy(), np.full(5, 2.0))
    old = {k: v for k, v in st.items() if k != "owner_format_version"}  # the 2-bit phase 2's
    old["residuals"] = {"w": np.full(3, 4.0, np.float32)}
    with pytest.warns(UserWarning, match="written for scatter format 1 .the 2-bit phase 2.*"
                      "owners' residuals restart from zero; the workers' residuals are restored"):
        c2.load_state_dict(old)
    assert not c2.owner_residual("b", 5, 0, 1).numpy().any()
    np.testing.assert_array_equal(c2.residuals.state_dict()["w"], np.full(3, 4.0))
    st["rank"], st["size"] = 1, 2
    with pytest.warns(UserWarning, match="rank 1 of 2"):
        c2.load_state_dict(st)
    assert not c2.owner_residual("b", 5, 0, 1).numpy().any()
    c.reset()
    assert not c.owners.variable("b").numpy().any()
    assert "owner_residuals" not in TwoBitCompressor(0.5).state_dict()
