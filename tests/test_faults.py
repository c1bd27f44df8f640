"""The fault-injection matrix (tests/fault_cells.py) in real horovodrun jobs, and torchrun jobs
for DDP's 2-bit hook: a NaN, +Inf or -Inf on one rank at one step, through every path, threshold,
exchange and bucketing, on 2 and 3 ranks.
Every cell is replayed on the NumPy reference workers from the gradients the ranks saw, and checked
step by step, the steps after the fault included:

- every step's result on every rank equals the reference's, bit for bit; at the faulty step the
  faulty tensor is NaN on every rank and the other members of its bucket are finished as if it
  were not there;
- the workers' and the scatter owners' residuals after every step equal the reference's, so the
  faulty step changed none of them;
- the steps after the fault are finite again, and the weights end identical on every rank.

One job per (framework, number of ranks) runs all of its cells."""

import itertools

import numpy as np
import pytest

import fault_cells as fc
import jobs
import sim
from horovod_twobit import reference as ref

pytestmark = pytest.mark.slow
WORKER = {"torch": "torch_faults.py", "tf": "tf_faults.py"}


def _cell_records(tmp_path_factory, framework, np_, index):
    def job():
        out = tmp_path_factory.mktemp("faults_%s_np%d" % (framework, np_))
        if framework == "ddp":
            return jobs.torchrun(np_, "ddp_faults.py", "--out", out, timeout=900), out
        return jobs.run(np_, WORKER[framework], "--out", out, timeout=900), out

    res, out = jobs.shared(("faults", framework, np_), job)
    return sim.load_ranks(str(out / str(index)), np_)


def groups_at(ranks, step):
    """The groups the tensors travelled in at ``step``, the same on every rank: per step where
    the job recorded them so (DDP's buckets, rebuilt after the first step), else for all steps."""
    key = "groups/%d" % step if "groups/%d" % step in ranks[0] else "groups"
    for r in ranks[1:]:
        assert r[key].tolist() == ranks[0][key].tolist()
    return [g.split(",") for g in ranks[0][key].tolist()]


# the groups of DDP's rebuilt buckets (the faulty step's) for each bucketing, in DDP's order
DDP_GROUPS = {"b0": [["2.bias"], ["2.weight"], ["0.bias"], ["0.weight"]],
              "one": [["2.bias", "2.weight", "0.bias"], ["0.weight"]],
              "multi": [["2.bias", "2.weight", "0.bias", "0.weight"]]}


def check_cell(ranks, cell, framework):
    np_ = len(ranks)
    names = {n for g in groups_at(ranks, 0) for n in g}
    assert len(names) == len(fc.TENSORS[framework])
    if framework == "ddp":
        assert groups_at(ranks, fc.FAULT_STEP) == DDP_GROUPS[cell.bucketing]
    w = ref.Workers(np_, fc.threshold(cell), exchange=cell.exchange)
    nan_seen = 0
    for step in range(fc.STEPS):
        groups = groups_at(ranks, step)
        assert sorted(n for g in groups for n in g) == sorted(names)
        for g in groups:
            local = [[r["local/%d/%s" % (step, n)] for n in g] for r in ranks]
            want = w.bucket(g, local)
            for n, x in zip(g, want):
                for rank, r in enumerate(ranks):
                    np.testing.assert_array_equal(
                        r["agg/%d/%s" % (step, n)], x,
                        err_msg="%s: rank %d, step %d, tensor %s" % (fc.encode(cell), rank, step, n))
                if step == fc.FAULT_STEP and not all(np.isfinite(loc[i]).all()
                                                     for loc in local for i in [g.index(n)]):
                    assert np.isnan(x).all()
                    nan_seen += 1
                else:
                    assert np.isfinite(x).all(), (fc.encode(cell), step, n)
        for rank, r in enumerate(ranks):
            for n in names:
                np.testing.assert_array_equal(
                    r["res/%d/%s" % (step, n)].reshape(-1), w.residuals[rank][n].reshape(-1),
                    err_msg="%s: residual of %s, rank %d, step %d" % (fc.encode(cell), n, rank, step))
            owned = {k[len("own/%d/" % step):] for k in r if k.startswith("own/%d/" % step)}
            assert owned == set(w.owner_residuals[rank]), (fc.encode(cell), step, owned)
            for k in owned:
                np.testing.assert_array_equal(r["own/%d/%s" % (step, k)], w.owner_residuals[rank][k])
    assert nan_seen == 1, "%s: the fault reached %d tensors" % (fc.encode(cell), nan_seen)
    if fc.threshold(cell) == "auto" and cell.exchange == "scatter":
        assert any(np.abs(e).sum() > 0 for own in w.owner_residuals for e in own.values())
    for n in names:
        if "w/" + n in ranks[0]:
            for r in ranks[1:]:
                np.testing.assert_array_equal(r["w/" + n], ranks[0]["w/" + n])
            assert np.isfinite(ranks[0]["w/" + n]).all()


def _params(framework):
    return [pytest.param(framework, np_, i, id="%s-np%d-%s" % (framework, np_, fc.encode(c)))
            for np_ in (2, 3) for i, c in enumerate(fc.cells(framework, np_))]


@pytest.mark.parametrize("framework,np_,index", _params("torch") + _params("tf") + _params("ddp"))
def test_fault_cell(tmp_path_factory, framework, np_, index):
    cell = fc.cells(framework, np_)[index]
    check_cell(_cell_records(tmp_path_factory, framework, np_, index), cell, framework)


def test_matrix_covers_every_kind_rank_and_path():
    for framework in fc.PATHS:
        for np_ in (2, 3):
            cells = fc.cells(framework, np_)
            assert {c.kind for c in cells} == set(fc.KINDS)
            assert {int(c.rank) for c in cells} == set(range(np_))
            assert {(c.path, c.threshold, c.exchange, c.bucketing) for c in cells} == set(
                itertools.product(fc.PATHS[framework], fc.THRESHOLDS, fc.EXCHANGES,
                                                fc.BUCKETINGS))



@pytest.mark.parametrize("index", range(len(fc.SOAK_CONFIGS)), ids=list(fc.SOAK_CONFIGS))
def test_soak_final_weights_equal_the_reference(tmp_path_factory, index):
    """SOAK_STEPS steps on 2 ranks with faults at random steps (tests/workers/torch_soak.py):
    the final weights and residuals are the NumPy reference's run of the same faults, exactly."""
    def job():
        out = tmp_path_factory.mktemp("soak")
        return jobs.run(2, "torch_soak.py", "--out", out, timeout=600), out

    res, out = jobs.shared(("soak",), job)
    ranks = sim.load_ranks(str(out / str(index)), 2)
    threshold, exchange = fc.SOAK_CONFIGS[index].split("/")
    w = ref.Workers(2, threshold if threshold == "auto" else float(threshold), exchange=exchange)
    groups = [g.split(",") for g in ranks[0]["groups"].tolist()]
    assert any(len(g) > 1 for g in groups), groups
    names = [n for n, _ in fc.TENSORS["torch"]]
    faults = fc.soak_faults(fc.SOAK_STEPS, 2)
    assert len(faults) >= 20 and {k for _, _, k in faults.values()} == set(fc.KINDS)
    weights = fc.soak_start()
    skipped = 0
    for step in range(fc.SOAK_STEPS):
        grads = [fc.soak_grads(weights, r, step, faults) for r in range(2)]
        agg = {}
        for g in groups:
            idx = [names.index(n) for n in g]
            agg.update(zip(g, w.bucket(g, [[gr[i] for i in idx] for gr in grads])))
        if all(np.isfinite(agg[n]).all() for n in names):
            weights = [x - fc.SOAK_LR * agg[n] for x, n in zip(weights, names)]
        else:
            skipped += 1
    assert skipped == len(faults)
    for r in ranks:
        assert int(r["skipped"]) == skipped
        for n, x in zip(names, weights):
            np.testing.assert_array_equal(r["w/" + n], x, err_msg=n)
    for rank, r in enumerate(ranks):
        for n in names:
            np.testing.assert_array_equal(r["res/" + n], w.residuals[rank][n])
        assert {k[4:] for k in r if k.startswith("own/")} == set(w.owner_residuals[rank])
        for k, e in w.owner_residuals[rank].items():
            np.testing.assert_array_equal(r["own/" + k], e)
