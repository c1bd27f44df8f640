"""TensorFlow's plain exchange (the fallback's, exchange/plain.py) on one rank, each path: the
residuals read or known to be zero (None: read in the graph; True / False: told, as the checked
exchange's branches are), members that come out finite or not, a bucket with padding between
its members and a tensor alone. Prints one JSON line: per case, whether results, residuals and
the zero flag are what the exchange promises (g + r sent; a member not finite NaN with its
residual kept, the others' residuals zero; the flag set when every member was finite), and the
step after it sends what a member kept and leaves every residual zero."""

import json

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
import horovod.tensorflow.mpi_ops as mpi_ops

from horovod_twobit.tensorflow import TwoBitCompressor
from horovod_twobit.tensorflow.exchange import bucket, plain
from horovod_twobit.tensorflow.exchange.bucket import layout_of


def case(sizes, known, bad_member, bad_value, flag_before):
    comp = TwoBitCompressor(0.5, fallback="always")
    state = comp.state
    keys = ["m%d" % i for i in range(len(sizes))]
    rng = np.random.default_rng(len(sizes) * 10 + (bad_member or 0))
    gs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    if bad_member is not None:
        gs[bad_member][1] = bad_value
    rs = [np.zeros(n, np.float32) if flag_before else
          (0.25 * rng.standard_normal(n)).astype(np.float32) for n in sizes]
    tensors = [tf.constant(g) for g in gs]
    for k, t, r in zip(keys, tensors, rs):
        state.residuals.get(k, t).assign(r)
    plain.zero_flag(state, keys).assign(flag_before)
    lay = layout_of(state, keys, tensors)

    def run(tensors, known):
        @tf.function(autograph=False)
        def step():
            out, bad = plain.run(state, tensors, keys, mpi_ops.Average, 1.0, 1.0,
                                 hvd.global_process_set, "case", False, lay, None, known)
            return bucket.members(lay, out, tensors), bad
        return step()

    got, bad = run(tensors, known)
    ok = []
    for i, (g, r, o) in enumerate(zip(gs, rs, got)):
        finite = bool(np.isfinite(g + r).all())
        want = (g + r) if finite else np.full_like(g, np.nan)
        ok.append(bool(np.array_equal(o.numpy(), want, equal_nan=True)))
        res = state.residuals.variable(keys[i]).numpy()
        ok.append(bool(np.array_equal(res, np.zeros_like(r) if finite else r)))
    all_finite = all(np.isfinite(g + r).all() for g, r in zip(gs, rs))
    ok.append(bool(plain.zero_flag(state, keys).numpy()) == all_finite)
    ok.append(bool(bad.numpy()) == (not all_finite))
    # the step after: finite gradients, the flag read in the graph; what a member kept is sent
    kept = [state.residuals.variable(k).numpy().copy() for k in keys]
    g2 = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    got, bad = run([tf.constant(g) for g in g2], None)
    for k, g, r, o in zip(keys, g2, kept, got):
        want = g if all_finite else g + r  # the flag set: g alone (the residuals are zero)
        ok.append(bool(np.array_equal(o.numpy(), want)))
        ok.append(not state.residuals.variable(k).numpy().any())
    ok.append(bool(plain.zero_flag(state, keys).numpy()) and not bool(bad.numpy()))
    return ok


if __name__ == "__main__":
    hvd.init()
    cases = {}
    for sizes in ([5, 20, 3], [7]):
        for known, flag_before in ((None, False), (None, True), (False, False), (True, True)):
            for bad_member, bad_value in ((None, 0.0), (len(sizes) - 1, np.nan), (0, np.inf)):
                name = "%s/%s/%s/%s/%s" % (sizes, known, flag_before, bad_member, bad_value)
                cases[name] = case(sizes, known, bad_member, bad_value, flag_before)
    print("RESULT " + json.dumps(cases))
