"""TwoBitCompressor through Horovod's own, unmodified DistributedOptimizer, in real horovodrun jobs."""

import numpy as np
import pytest

import jobs
import sim
from horovod_twobit import reference as ref


def _auto(block, blocks):
    return "--steps 12 --threshold auto --groups 2" + (" --block %d" % block if block else "") + (
        " --blocks %d" % blocks if blocks else "")


AUTO = [(2, None, 1), (3, None, None), (3, 32, None), (2, 16, 4)]  # (ranks, block, blocks)
OPTIMIZER = "--steps 20 --threshold 0.5"
BPPS = "--steps 12 --threshold 0.1 --bpps 2 --groups 2"
SUM = "--steps 8 --op sum --no-names"
HALF = "--steps 6 --dtype %s"
# what each number of ranks trains (tests/workers/torch_train.py options), in one job
TRAINED = {
    2: [OPTIMIZER, BPPS, SUM, HALF % "float16", HALF % "bfloat16"]
       + [_auto(b, bs) for n, b, bs in AUTO if n == 2],
    3: [OPTIMIZER] + [_auto(b, bs) for n, b, bs in AUTO if n == 3],
}


def _train(tmp_path_factory, np_, config):
    """The ranks' records of ``config``: one horovodrun job per number of ranks trains all of
    that number's configurations in turn, each with its own model, optimizer and compressor."""
    def job():
        out = tmp_path_factory.mktemp("torch_train_np%d" % np_)
        jobs.run(np_, "torch_train.py", out, *TRAINED[np_])
        return out

    out = jobs.shared(("torch_train", np_), job) / str(TRAINED[np_].index(config))
    return sim.load_ranks(str(out), np_)


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 3])
def test_optimizer_matches_simulation(tmp_path_factory, np_):
    ranks = _train(tmp_path_factory, np_, OPTIMIZER)
    sim.check_training(ranks, 0.5, 20)
    # an ordinary allreduce in the same job is exact
    want = sum(np.arange(10, dtype=np.float32) * (r + 1) + np.float32(0.001) for r in range(np_))
    for r in ranks:
        np.testing.assert_array_equal(r["plain"], want.astype(np.float32))
    # hvd.allreduce(..., compression=TwoBitCompressor) keeps its own residual under its name
    w = ref.Workers(np_, 0.5)
    for i in range(2):
        expect = w.allreduce("direct", [r["direct_in/%d" % i] for r in ranks])
        for r in ranks:
            np.testing.assert_array_equal(r["direct_out/%d" % i], expect)
    assert "direct" in list(ranks[0]["residual_names"])


# the 3-rank job (17 s on 2 cores) in the slow set; the quick set keeps the 2-rank one (12 s)
@pytest.mark.parametrize("np_,block,blocks", [
    pytest.param(*a, marks=pytest.mark.slow) if a[0] == 3 else a for a in AUTO])
def test_auto_threshold_matches_simulation(tmp_path_factory, np_, block, blocks):
    """The tensors have 480, 240, 50, 40 and 6 values. blocks=1: one magnitude per tensor, in the
    header. The defaults (blocks of at least 64 values, at most 64 blocks): blocks of 64 for the
    first two, one magnitude for the others. block=32: whole and partial blocks (and 6 values
    are one block). block=16, blocks=4: blocks of 128, 64, 16 and 16 values, and none."""
    ranks = _train(tmp_path_factory, np_, _auto(block, blocks))
    sim.check_training(ranks, "auto", 12, block=block, blocks=blocks)
    w = ref.Workers(np_, "auto", block=block, blocks=blocks)
    for i in range(2):
        expect = w.allreduce("direct", [r["direct_in/%d" % i] for r in ranks])
        last = [np.atleast_1d(t)[-1] for t in w.last_thresholds["direct"]]
        assert len(set(float(t) for t in last)) == np_  # one value per sender
        for r in ranks:
            np.testing.assert_array_equal(r["direct_out/%d" % i], expect)


def test_backward_passes_per_step_and_groups(tmp_path_factory):
    ranks = _train(tmp_path_factory, 2, BPPS)
    sim.check_training(ranks, 0.1, 12)


def test_sum_op_without_names(tmp_path_factory):
    ranks = _train(tmp_path_factory, 2, SUM)
    sim.check_training(ranks, 0.5, 8, op="sum")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_gradients(tmp_path_factory, dtype):
    ranks = _train(tmp_path_factory, 2, HALF % dtype)
    import torch
    npdt = {"float16": np.float16}.get(dtype)
    if npdt is None:  # numpy has no bfloat16: compare after torch's own cast
        def cast(a):
            return torch.from_numpy(a).to(torch.bfloat16).float().numpy()
        sim_w = ref.Workers(2, 0.5)
        for step in range(6):
            for n in ("0.weight", "0.bias", "2.weight", "2.bias"):
                want = cast(sim_w.allreduce(n, [r["local/%d/%s" % (step, n)] for r in ranks]))
                for r in ranks:
                    np.testing.assert_array_equal(r["agg/%d/%s" % (step, n)], want)
    else:
        sim.check_training(ranks, 0.5, 6, dtype=npdt)


@pytest.mark.slow
def test_mpi_controller(tmp_path):
    jobs.run(2, "torch_train.py", tmp_path, "--steps 5", mpi=True)
    ranks = sim.load_ranks(str(tmp_path / "0"), 2)
    sim.check_training(ranks, 0.5, 5)


@pytest.mark.slow
def test_state_dict_round_trip():
    res = jobs.run(2, "torch_state.py", "unused")
    for rank in range(2):
        assert ("rank %d same=True without_residuals_differs=True nonzero_residual=True" % rank
                in res.output), res


@pytest.mark.slow
def test_demo_runs_and_plots(tmp_path):
    import os
    demo = os.path.join(os.path.dirname(jobs.HERE), "examples", "digits_torch.py")
    png = tmp_path / "plot.png"
    res = jobs.run(2, demo, "--plot", png, timeout=300)  # the whole demo: 15 epochs, ~10 s
    # the demo's MLP (64-256-10) travels as one bucket: one payload, as the stats count it
    from horovod_twobit.wire.layout import Layout
    sizes = [64 * 256, 256, 256 * 10, 10]
    ratio = 4 * sum(sizes) / (4 * Layout(sizes, False).payload_words)
    assert "twobit epoch  2" in res.output and "ratio %4.1fx" % ratio in res.output, res
    assert "ratio 15.9x" in res.output  # 76,840 bytes against 4,840
    jobs.check_demo_accuracies(res.output)  # both learn, TwoBit as well as uncompressed
    assert png.exists() and png.stat().st_size > 1000


@pytest.mark.slow
def test_process_set(tmp_path):
    jobs.run(3, "torch_pset.py", tmp_path)
    ranks = [dict(np.load(tmp_path / ("rank%d.npz" % r))) for r in range(3)]
    w = ref.Workers(2, 0.5)
    for i in range(3):
        want = w.allreduce("ps", [ranks[r]["in/%d" % i] for r in range(2)])
        for r in range(2):
            np.testing.assert_array_equal(ranks[r]["out/%d" % i], want)
    np.testing.assert_array_equal(ranks[0]["w"], ranks[1]["w"])
    assert "w" not in ranks[2]


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [0.05, "auto"])
def test_buckets_give_each_tensor_its_own_result(tmp_path, threshold):
    """Bucketed and unbucketed training give the same bits on every rank (BatchNorm, a layer
    without gradient on odd steps, a float64 parameter), with fewer collectives; hand-submitted
    tensors of a planned bucket arrive in a different order on each rank and still match."""
    ranks = _train_script(tmp_path, 3, "torch_buckets.py", "--threshold", threshold)
    r0 = ranks[0]
    assert int(r0["buckets"]) >= 2  # bucket_bytes=4096 cuts the model into several buckets
    steps = sorted({int(k.split("/")[2]) for k in r0 if k.startswith("agg/bucketed/")})
    names = sorted({k.split("/", 3)[3] for k in r0 if k.startswith("agg/bucketed/0/")})
    assert len(steps) == 6 and len(names) == 11
    for r in ranks:
        for s in steps:
            assert int(r["allgathers/bucketed/%d" % s]) < int(r["allgathers/alone/%d" % s]) == 11
            for n in names:
                np.testing.assert_array_equal(r["agg/bucketed/%d/%s" % (s, n)],
                                              r["agg/alone/%d/%s" % (s, n)], err_msg=n)
                np.testing.assert_array_equal(r["agg/bucketed/%d/%s" % (s, n)],
                                              r0["agg/bucketed/%d/%s" % (s, n)])
        for k in r:
            if k.startswith(("w/bucketed/", "residual/bucketed/")):
                np.testing.assert_array_equal(r[k], r[k.replace("bucketed", "alone", 1)], err_msg=k)
        hand = [k for k in r if k.startswith("hand/")]
        assert len(hand) == 12
        for k in hand:
            np.testing.assert_array_equal(r[k], r["handref/" + k[5:]], err_msg=k)
    assert any(np.count_nonzero(r0[k]) for k in r0 if k.startswith("agg/bucketed/"))


def _train_script(tmp_path, np_, script, *args):
    jobs.run(np_, script, "--out", tmp_path, *args)
    return sim.load_ranks(str(tmp_path), np_)
