"""The scatter exchange in real horovodrun jobs, against the NumPy reference, bit for bit."""

import re

import numpy as np
import pytest

import jobs
import sim
from horovod_twobit import reference as ref
from horovod_twobit.wire import scatter as sw
from horovod_twobit import wire
from horovod_twobit.wire.layout import Layout

STEPS = 6
ODD = (1, 17, 33, 100, 16 * 7 + 3, 3000)


# (threshold, exchange) each number of ranks runs, in one job
CONFIGS = {2: [(0.05, "scatter"), ("auto", "scatter"), (0.05, "auto")],
           3: [(0.05, "scatter"), ("auto", "scatter")],
           4: [(0.05, "scatter"), ("auto", "scatter"), (0.05, "auto")]}


def _job(tmp_path_factory, np_, threshold, exchange="scatter"):
    """The ranks' records of one threshold and exchange: one horovodrun job per number of ranks
    runs all of that number's configurations in turn."""
    def job():
        out = tmp_path_factory.mktemp("torch_scatter_np%d" % np_)
        res = jobs.run(np_, "torch_scatter.py", "--out", out, "--steps", STEPS, "--configs",
                       *["%s:%s" % c for c in CONFIGS[np_]])
        assert res.output.count("uses %s" % jobs.os.path.join(jobs.os.path.dirname(jobs.HERE),
                                                              "horovod_twobit")) == np_, res
        return out

    out = jobs.shared(("torch_scatter", np_), job) / str(CONFIGS[np_].index((threshold, exchange)))
    return sim.load_ranks(str(out), np_)


def _check_training(ranks, w, threshold):
    """Every rank's aggregated gradients are the reference's; returns the alltoalls per step."""
    r0 = ranks[0]
    buckets = [list(r0[k]) for k in sorted(k for k in r0 if k.startswith("bucket/"))]
    names = sorted({k.split("/", 2)[2] for k in r0 if k.startswith("agg/0/")})
    in_bucket = {n for b in buckets for n in b}
    assert [len(b) for b in buckets] == [3] and [n for n in names if n not in in_bucket] == ["0.weight"]
    groups = buckets + [[n] for n in names if n not in in_bucket]
    nonzero = 0
    for step in range(STEPS):
        for b in groups:
            want = w.bucket(b, [[r["local/%d/%s" % (step, n)] for n in b] for r in ranks])
            for n, x in zip(b, want):
                nonzero += np.count_nonzero(x)
                for rank, r in enumerate(ranks):
                    np.testing.assert_array_equal(r["agg/%d/%s" % (step, n)], x,
                                                  err_msg="rank %d step %d %s" % (rank, step, n))
    assert nonzero > 0
    for n in names:
        for r in ranks[1:]:
            np.testing.assert_array_equal(r["w/" + n], r0["w/" + n])
    return groups


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 3, 4])
@pytest.mark.parametrize("threshold", [0.05, "auto"])
def test_scatter_matches_reference(tmp_path_factory, np_, threshold):
    """DistributedOptimizer with a bucket and a tensor alone, single tensors of odd sizes, op=Sum
    with scale factors, and a NaN on one rank: every result is the reference's, on every rank."""
    ranks = _job(tmp_path_factory, np_, threshold)
    w = ref.Workers(np_, threshold, exchange="scatter")
    _check_training(ranks, w, threshold)
    for r in ranks:  # one alltoall and one allgather per bucket and step, and each bucket's plan
        for step in range(STEPS):
            assert int(r["calls/alltoall/%d" % step]) == 2
            assert int(r["calls/allgather/%d" % step]) == (4 if step == 0 else 2)
    for step in range(3):
        for n in ODD:
            want = w.allreduce("single%d" % n, [r["single_in/%d/%d" % (n, step)] for r in ranks])
            for r in ranks:
                np.testing.assert_array_equal(r["single_out/%d/%d" % (n, step)], want)
        want = w.allreduce("sum", [r["sum_in/%d" % step] for r in ranks], op="sum",
                           prescale=0.5, postscale=3.0)
        for r in ranks:
            np.testing.assert_array_equal(r["sum_out/%d" % step], want)
    sim.check_scatter_nonfinite(ranks, w, threshold)
    for step in range(2):  # waited on in a different order on every rank: no rank starves another
        for n in ("oa", "ob"):
            want = w.allreduce(n, [r["order_in/%s/%d" % (n, step)] for r in ranks])
            for r in ranks:
                np.testing.assert_array_equal(r["order_out/%s/%d" % (n, step)], want)
        for r in ranks:
            np.testing.assert_array_equal(r["order_out/plain/%d" % step],
                                          np.full(3, sum(range(np_)), np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 4])
def test_auto_exchange_picks_per_bucket(tmp_path_factory, np_):
    """exchange="auto": each bucket takes the exchange that sends fewer bytes (the same on every
    rank: here allgather for the model's small tensors, scatter for 3000 values from N = 3 on) and
    gets the reference's result."""
    ranks = _job(tmp_path_factory, np_, 0.05, exchange="auto")
    w = ref.Workers(np_, 0.05, exchange="auto")
    groups = _check_training(ranks, w, 0.05)
    sizes = {"0.weight": 480, "0.bias": 40, "2.weight": 240, "2.bias": 6}
    scatter = sum(sw.choose("auto", Layout([sizes[n] for n in g], False), np_) == "scatter"
                  for g in groups)
    for r in ranks:
        for step in range(STEPS):
            assert int(r["calls/alltoall/%d" % step]) == scatter
            assert int(r["calls/allgather/%d" % step]) == 2 + (scatter if step == 0 else 0)
    for step in range(3):  # 3000 values: scatter from N = 3 on (README's crossover table)
        for n in ODD:
            want = w.allreduce("single%d" % n, [r["single_in/%d/%d" % (n, step)] for r in ranks])
            for r in ranks:
                np.testing.assert_array_equal(r["single_out/%d/%d" % (n, step)], want)
                assert int(r["single_alltoalls/%d/%d" % (n, step)]) == (n == 3000 and np_ > 2)


CASES = {
    "threshold": r"different thresholds \[0\.5, 0\.25(, 0\.25)?\].*same threshold",
    "size": r"different sizes \[40, 60(, 80)?\]",
    "size_same_words": r"different sizes \[33, 34(, 35)?\]",
    "auto_vs_fixed": r"some ranks use threshold='auto' and others a fixed threshold",
    "buckets": r"bucketed different tensors",
}


EXCHANGE = r"tensor '[^']+'.*: ranks \[(0|1, 2|1)\] use exchange='scatter' for it and ranks \[(0|1|1, 2)\] exchange='allgather'"
MIXED = {2: ["exchange", "exchange_bucket"], 3: ["exchange", "auto_exchange"]}


@pytest.fixture(scope="module")
def error_jobs():
    """One job per number of ranks runs every case in turn (tests/workers/torch_errors.py): the
    mismatches with exchange="scatter", then ranks mixing exchanges for one tensor."""
    done = {}

    def outcomes(np_):
        if np_ not in done:
            cases = sorted(CASES) + MIXED[np_]
            res = jobs.run(np_, "torch_errors.py", "--exchange", "scatter", *cases, timeout=300)
            done[np_] = jobs.case_outcomes(res, np_, cases)
        return done[np_]
    return outcomes


def _same_error_everywhere(outcomes, pattern):
    for rank, o in enumerate(outcomes):
        assert o.kind == "RAISED", "rank %d: %r" % (rank, o)
        assert o.message.startswith("PayloadMismatchError: ") and re.search(pattern, o.message), o
        assert o.seconds < 30, o
    assert len({o.message for o in outcomes}) == 1, outcomes  # the same message on every rank


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch_raises_on_every_rank(error_jobs, case, np_):
    _same_error_everywhere(error_jobs(np_)[case], CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case,np_", [(c, n) for n in sorted(MIXED) for c in MIXED[n]])
def test_mixed_exchanges_raise_on_every_rank(error_jobs, case, np_):
    """Ranks that use different exchanges for one tensor submit different collectives (alltoall,
    allgather): each scatter bucket's first step announces its exchange under the allgather
    exchange's name, so every rank raises the same error instead of waiting forever."""
    _same_error_everywhere(error_jobs(np_)[case], EXCHANGE)


@pytest.mark.slow
@pytest.mark.parametrize("threshold", ["0.1", "auto"])
def test_state_dict_round_trip(threshold):
    res = jobs.run(3, "torch_state.py", "unused", threshold, "scatter")
    for rank in range(3):
        assert ("rank %d same=True without_residuals_differs=True nonzero_residual=True" % rank
                in res.output), res
    if threshold == "auto":
        assert res.output.count("owners=True") == 3, res


def test_exchange_argument():
    from horovod_twobit.torch import TwoBitCompressor
    assert "exchange='scatter'" in repr(TwoBitCompressor(0.5, exchange="scatter"))
    assert "exchange" not in repr(TwoBitCompressor(0.5))
    for bad in ("Scatter", "", None, 2, "ring"):
        with pytest.raises(ValueError, match="exchange must be one of"):
            TwoBitCompressor(0.5, exchange=bad)


def test_owner_residuals_follow_rank_and_size_and_checkpoints():
    import torch
    from horovod_twobit.torch import TwoBitCompressor, TwoBitStateHandler
    c = TwoBitCompressor("auto", exchange="scatter")
    r = c.owner_residual("b", 10, "cpu", 0, 2)
    r += 1
    assert c.owner_residual("b", 10, "cpu", 0, 2) is r
    with pytest.warns(UserWarning, match="rank 0 of 2, now 1 of 3.*workers' residuals are kept"):
        r2 = c.owner_residual("b", 7, "cpu", 1, 3)
    assert r2.numel() == 7 and not r2.any()
    # Horovod is not initialized here: this process is rank 0 of 1
    c = TwoBitCompressor("auto", exchange="scatter")
    c.owner_residual("b", 5, "cpu", 0, 1).fill_(2)
    st = c.state_dict()
    assert torch.equal(st["owner_residuals"]["b"], torch.full((5,), 2.0))
    handler = TwoBitStateHandler(c)
    c.owner_residual("b", 5, "cpu", 0, 1).fill_(3)
    handler.restore()  # rolls back to the snapshot taken when the handler was made
    assert torch.equal(c.owner_residual("b", 5, "cpu", 0, 1), torch.full((5,), 2.0))
    c2 = TwoBitCompressor("auto", exchange="scatter")
    c2.load_state_dict(st)
    assert torch.equal(c2.owner_residual("b", 5, "cpu", 0, 1), torch.full((5,), 2.0))
    assert st["owner_format_version"] == 2
    old = {k: v for k, v in st.items() if k != "owner_format_version"}  # the 2-bit phase 2's
    old["residuals"] = {"w": torch.full((3,), 4.0)}
    with pytest.warns(UserWarning, match="written for scatter format 1 .the 2-bit phase 2.*"
                      "owners' residuals restart from zero; the workers' residuals are restored"):
        c2.load_state_dict(old)
    assert len(c2.owners) == 0 and torch.equal(c2.residuals.state_dict()["w"], torch.full((3,), 4.0))
    assert not c2.owner_residual("b", 5, "cpu", 0, 1).any()
    st["rank"], st["size"] = 1, 2
    with pytest.warns(UserWarning, match="rank 1 of 2"):
        c2.load_state_dict(st)
    assert len(c2.owners) == 0
    c.reset()
    assert len(c.owners) == 0
    assert "owner_residuals" not in TwoBitCompressor(0.5).state_dict()
