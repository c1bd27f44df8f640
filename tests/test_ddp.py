"""The DDP hook (horovod_twobit.torch.ddp) in real torchrun jobs: every step's result on every
rank, and every rank's residuals after it, equal the NumPy reference workers' replay of the
gradients the ranks saw, bit for bit; DDP's buckets rebuilt after the first iteration keep each
parameter's residual; a NaN on one rank makes that parameter NaN on every rank, its residual
unchanged, and the steps after it are finite again. With no_sync() and unused parameters
(2 ranks), gradient_as_bucket_view and static_graph (3 ranks); ranks with different thresholds
all raise the same error, and none hangs."""

import os
import subprocess
import sys

import numpy as np
import pytest

from horovod_twobit import reference as ref

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, NAN_STEP, FAULTY = 6, 3, "body.2.bias"


def _run(tmp_path, nranks, threshold, modes):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nranks), os.path.join(HERE, "workers", "ddp_train.py"),
           str(tmp_path), str(threshold), modes]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
@pytest.mark.parametrize("nranks,threshold,modes", [(2, 0.05, "nosync,unused"),
                                                    (3, "auto", "view,static")])
def test_ddp_hook_matches_the_reference(tmp_path, nranks, threshold, modes):
    out = _run(tmp_path, nranks, threshold, modes)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [dict(np.load(os.path.join(tmp_path, "rank%d.npz" % r))) for r in range(nranks)]
    w = ref.Workers(nranks, threshold)
    seen_layouts = set()
    for step in range(STEPS):
        nb = int(ranks[0]["buckets/%d" % step])
        assert all(int(r["buckets/%d" % step]) == nb for r in ranks)
        groups = [ranks[0]["names/%d/%d" % (step, i)].tolist() for i in range(nb)]
        seen_layouts.add(tuple(tuple(g) for g in sorted(groups)))
        assert sorted(n for g in groups for n in g) == sorted(
            k[len("w/"):] for k in ranks[0] if k.startswith("w/"))
        for g in groups:
            local = [[r["local/%d/%s" % (step, n)] for n in g] for r in ranks]
            want = w.bucket(g, local)
            for n, x in zip(g, want):
                for rank, r in enumerate(ranks):
                    np.testing.assert_array_equal(r["agg/%d/%s" % (step, n)], x,
                                                  err_msg="step %d %s rank %d" % (step, n, rank))
                    np.testing.assert_array_equal(r["res/%d/%s" % (step, n)],
                                                  w.residuals[rank][n].reshape(-1))
                assert np.isnan(x).all() == (step == NAN_STEP and n == FAULTY), (step, n)
    if "unused" not in modes:  # (DDP keeps its first buckets when it looks for unused ones)
        assert len(seen_layouts) > 1  # DDP rebuilt its buckets: the residuals followed the names
    for k in ranks[0]:
        if k.startswith("w/"):
            assert np.isfinite(ranks[0][k]).all()
            for r in ranks[1:]:
                np.testing.assert_array_equal(r[k], ranks[0][k])
    for r in ranks:
        assert int(r["stats_nan_steps"]) == 1 and int(r["stats_bytes"]) > 0
    if "unused" in modes:  # the layer used on even steps only: its gradient was zero on odd ones
        for step in range(1, STEPS, 2):
            assert not ranks[0]["local/%d/extra.weight" % step].any()
        assert ranks[0]["local/0/extra.weight"].any()


@pytest.mark.slow
def test_ddp_mismatched_thresholds_raise_on_every_rank(tmp_path):
    out = _run(tmp_path, 2, 0.05, "mismatch")
    raised = sorted(line.split(": ", 1)[1] for line in out.stdout.splitlines()
                    if line.startswith("RAISED rank"))
    assert out.returncode != 0 and len(raised) == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert raised[0] == raised[1] and "different thresholds" in raised[0], raised


def test_ddp_state_refuses_what_it_cannot_do():
    from horovod_twobit.torch import ddp
    for kw, word in (({"exchange": "scatter"}, "allgather only"), ({"fallback": "auto"}, "no fallback"),
                     ({"min_numel": 100}, "every parameter")):
        with pytest.raises(ValueError, match=word):
            ddp.TwoBitState(0.5, **kw)
    with pytest.raises(ValueError, match="threshold"):
        ddp.TwoBitState(-1.0)
    s = ddp.TwoBitState("auto")
    s.name_parameters([("module.a.weight", object())])
    assert list(s.names.values()) == ["a.weight"]
    saved = s.state_dict()
    assert saved["rank"] == 0 and saved["size"] == 1
    saved = dict(saved, size=2, residuals={"a.weight": np.ones(3, np.float32)})
    with pytest.warns(UserWarning, match="saved by rank 0 of 2, this is rank 0 of 1"):
        s.load_state_dict(saved)  # another world size: the residuals restart from zero
    assert len(s.residuals) == 0
