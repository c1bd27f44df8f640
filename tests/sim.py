"""Replays what ranks saved against the NumPy N-worker simulation."""

import glob
import os

import numpy as np

from horovod_twobit import reference as ref


def load_ranks(out_dir, nranks):
    files = sorted(glob.glob(os.path.join(out_dir, "rank*.npz")))
    assert len(files) == nranks, "expected %d rank files, found %s" % (nranks, files)
    return [dict(np.load(os.path.join(out_dir, "rank%d.npz" % r))) for r in range(nranks)]


def check_training(ranks, threshold, steps, op="average", dtype=np.float32, block=None, blocks=None):
    """Every rank's aggregated gradients equal the simulation's, bit for bit (after the cast to
    the gradients' dtype), and final weights are identical on all ranks."""
    sim = ref.Workers(len(ranks), threshold, block=block, blocks=blocks)
    names = sorted({k.split("/", 2)[2] for k in ranks[0] if k.startswith("agg/0/")})
    assert names
    nonzero = 0
    for step in range(steps):
        for n in names:
            want = sim.allreduce(n, [r["local/%d/%s" % (step, n)] for r in ranks], op=op)
            want = want.astype(dtype).astype(np.float32)
            nonzero += int(np.count_nonzero(want))
            for rank, r in enumerate(ranks):
                got = r["agg/%d/%s" % (step, n)]
                np.testing.assert_array_equal(
                    got, want, err_msg="rank %d, step %d, tensor %s" % (rank, step, n))
    assert nonzero > 0, "nothing was ever sent: the test would not see a wrong decode"
    for n in names:
        for r in ranks[1:]:
            np.testing.assert_array_equal(r["w/" + n], ranks[0]["w/" + n])
    return sim


# The codec tests of both frameworks run on the same sizes, thresholds and gradients.
SIZES = [0, 1, 15, 16, 17, 1000, 2 ** 20 + 3]
THRESHOLDS = [0.5, 0.1, 1e-3]


def grads(n, t, steps, seed):
    """Gradients with a mix of values far below, near and far above the threshold t."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * t * rng.choice([0.1, 0.7, 3.0], n)).astype(np.float32)
            for _ in range(steps)]


def check_scatter_nonfinite(ranks, w, threshold):
    """The "nf" tensor of a scatter job (3 steps, NaN on some rank at step 1) against the reference
    workers ``w``: same result on every rank, NaN everywhere at step 1 with no residual changed
    (the owners' included), and owners' residuals only with "auto"."""
    for step in range(3):
        want = w.allreduce("nf", [r["nf_in/%d" % step] for r in ranks])
        for rank, r in enumerate(ranks):
            np.testing.assert_array_equal(r["nf_out/%d" % step], want)
            np.testing.assert_array_equal(r["nf_res_after/%d" % step], w.residuals[rank]["nf"])
            if threshold == "auto":
                np.testing.assert_array_equal(r["nf_own_after/%d" % step],
                                              w.owner_residuals[rank]["nf"])
            else:
                assert r["nf_own_after/%d" % step].size == 0
            if step == 1:
                assert np.isnan(r["nf_out/1"]).all()
                for k in ("res", "own"):
                    np.testing.assert_array_equal(r["nf_%s_after/1" % k], r["nf_%s_before/1" % k])
    if threshold == "auto":
        assert any(np.abs(r["nf_own_after/2"]).sum() > 0 for r in ranks)
