"""The DDP hook (horovod_twobit.torch.ddp) in real torchrun jobs: every step's result on every
rank, and every rank's residuals (and scatter owners' residuals) after it, equal the NumPy
reference workers' replay of the gradients the ranks saw, bit for bit; DDP's buckets rebuilt after
the first iteration keep each parameter's residual; a NaN on one rank makes that parameter NaN on
every rank, its residual unchanged, and the steps after it are finite again (+Inf and -Inf
likewise). With no_sync() and unused parameters (2 ranks); the scatter exchange (2 ranks);
gradient_as_bucket_view, static_graph and the "auto" exchange (3 ranks: both exchanges); with
min_numel (parameters under it summed uncompressed) in the last two; the stats after the last step;
ranks with different thresholds all raise the same error, and none hangs, with either exchange."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from horovod_twobit import reference as ref, wire
from horovod_twobit.state import stats
from horovod_twobit.wire import scatter as scatter_wire
from horovod_twobit.wire.layout import Layout

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, NAN_STEP, FAULTY = 6, 3, "body.2.bias"


def _run(tmp_path, nranks, threshold, modes):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nranks), os.path.join(HERE, "workers", "ddp_train.py"),
           str(tmp_path), str(threshold), modes]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def _options(modes):
    """(exchange, min_numel) of a job's modes (as tests/workers/ddp_train.py reads them)."""
    modes = modes.split(",")
    exchange = "scatter" if "scatter" in modes else "auto" if "xauto" in modes else "allgather"
    return exchange, int(dict(m.split("=") for m in modes if "=" in m).get("min", 0))


def _layout(numels, threshold):
    return Layout(numels, threshold == "auto", *wire.validate_blocks(threshold, None, None))


def _plain(local, nranks):
    """What the hook gives a parameter under min_numel: the sum over the ranks, / N."""
    total = np.zeros_like(local[0])
    for x in local:
        total += x
    return total / np.float32(nranks)


def _has_cuda():
    import torch
    return torch.cuda.is_available()


CUDA = pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")


@pytest.mark.slow
@pytest.mark.parametrize("nranks,threshold,modes", [
    (2, 0.05, "nosync,unused"), (2, 0.05, "scatter,min=10,nosync,fault=inf"),
    (3, "auto", "view,static,xauto,min=10,fault=-inf"),
    (2, "auto", "scatter,fallback=checked"),
    pytest.param(2, 0.05, "cuda,nosync", marks=CUDA, id="2-0.05-cuda,nosync"),
    pytest.param(2, "auto", "cuda,xauto,min=10,fault=inf", marks=CUDA,
                 id="2-auto-cuda,xauto,min=10,fault=inf")])
def test_ddp_hook_matches_the_reference(tmp_path, nranks, threshold, modes):
    out = _run(tmp_path, nranks, threshold, modes)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [dict(np.load(os.path.join(tmp_path, "rank%d.npz" % r))) for r in range(nranks)]
    exchange, min_numel = _options(modes)
    w = ref.Workers(nranks, threshold, exchange=exchange)
    seen_layouts, exchanges, modes_seen = set(), set(), set()
    steps = sum(1 for k in ranks[0] if k.startswith("buckets/"))  # STEPS, or more (fallback)
    assert steps >= STEPS
    for step in range(steps):
        nb = int(ranks[0]["buckets/%d" % step])
        assert all(int(r["buckets/%d" % step]) == nb for r in ranks)
        groups = [ranks[0]["names/%d/%d" % (step, i)].tolist() for i in range(nb)]
        seen_layouts.add(tuple(tuple(g) for g in sorted(groups)))
        assert sorted(n for g in groups for n in g) == sorted(
            k[len("w/"):] for k in ranks[0] if k.startswith("w/"))
        for g in groups:
            local = {n: [r["local/%d/%s" % (step, n)] for r in ranks] for n in g}
            packed = [n for n in g if local[n][0].size >= min_numel]
            mode = _decided(ranks, step, packed)
            modes_seen.add(mode)
            replay = w.plain if mode == "plain" else w.bucket
            want = dict(zip(packed, replay(packed, [[local[n][q] for n in packed]
                                                    for q in range(nranks)]) if packed else []))
            if packed and mode != "plain":
                layout = _layout([local[n][0].size for n in packed], threshold)
                exchanges.add(scatter_wire.choose(exchange, layout, nranks))
            for n in g:
                got = [r["agg/%d/%s" % (step, n)] for r in ranks]
                if n not in want:  # summed uncompressed: no residual
                    for rank, r in enumerate(ranks):
                        np.testing.assert_array_equal(got[rank], got[0])
                        assert "res/%d/%s" % (step, n) not in r
                    if nranks == 2:  # (3 ranks: the collective's own order of additions)
                        np.testing.assert_array_equal(got[0], _plain(local[n], nranks))
                    scale = float(np.abs(np.stack(local[n])).sum(axis=0).max())
                    np.testing.assert_allclose(got[0], _plain(local[n], nranks), rtol=0,
                                               atol=1e-6 * scale)  # a rounding or two apart
                    continue
                for rank, r in enumerate(ranks):
                    np.testing.assert_array_equal(got[rank], want[n],
                                                  err_msg="step %d %s rank %d" % (step, n, rank))
                    np.testing.assert_array_equal(r["res/%d/%s" % (step, n)],
                                                  w.residuals[rank][n].reshape(-1))
                assert np.isnan(want[n]).all() == (step == NAN_STEP and n == FAULTY), (step, n)
        for rank, r in enumerate(ranks):  # the scatter owners' residuals ("auto" only)
            own = {k[len("own/%d/" % step):]: x for k, x in r.items()
                   if k.startswith("own/%d/" % step)}
            assert sorted(own) == sorted(w.owner_residuals[rank])
            for k, x in own.items():
                np.testing.assert_array_equal(x, w.owner_residuals[rank][k])
    if "unused" not in modes:  # (DDP keeps its first buckets when it looks for unused ones)
        assert len(seen_layouts) > 1  # DDP rebuilt its buckets: the residuals followed the names
    assert exchanges == ({"allgather", "scatter"} if exchange == "auto" else {exchange})
    if "fallback=checked" in modes:  # both paths ran, and rank 0's medians chose for all
        assert modes_seen == {"plain", "compressed"}, modes_seen
        checks = [json.loads(str(r["checks"])) for r in ranks]
        assert checks[0] and all(c == checks[0] for c in checks), checks
    for k in ranks[0]:
        if k.startswith("w/"):
            assert np.isfinite(ranks[0][k]).all()
            for r in ranks[1:]:
                np.testing.assert_array_equal(r[k], ranks[0][k])
    for rank, r in enumerate(ranks):
        assert int(r["stats_nan_steps"]) == 1 and int(r["stats_bytes"]) > 0
        if "fallback" not in modes:  # (the fallback's last step may have gone plain)
            _check_stats(json.loads(str(r["stats"])), groups, ranks[0], min_numel, threshold,
                         exchange, nranks, rank)
    if "unused" in modes:  # the layer used on even steps only: its gradient was zero on odd ones
        for step in range(1, STEPS, 2):
            assert not ranks[0]["local/%d/extra.weight" % step].any()
        assert ranks[0]["local/0/extra.weight"].any()


@CUDA
@pytest.mark.parametrize("threshold", [0.05, "auto"])
def test_ddp_training_on_cuda_follows_the_cpu_run(tmp_path, threshold):
    """The same job with the model on the GPU (2 processes on cuda:0) and on the CPU: its loss at
    every step follows the CPU run's (the GPU's matrix products round differently; the hook
    itself gives the reference's bits on both, above), and both end with the same weights
    to within those roundings."""
    runs = {}
    for where in ("cpu", "cuda"):
        out = tmp_path / where
        out.mkdir()
        res = _run(out, 2, threshold, "cuda" if where == "cuda" else "")
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs[where] = dict(np.load(os.path.join(out, "rank0.npz")))
    cpu, gpu = runs["cpu"], runs["cuda"]
    for step in range(STEPS):  # (at NAN_STEP both skip the optimizer's step)
        np.testing.assert_allclose(gpu["loss/%d" % step], cpu["loss/%d" % step], rtol=1e-3,
                                   err_msg="step %d" % step)
    for k in cpu:
        if k.startswith("w/"):
            np.testing.assert_allclose(gpu[k], cpu[k], rtol=0, atol=1e-3, err_msg=k)


def _decided(ranks, step, packed):
    """The fallback's mode for the bucket of ``packed`` at ``step``, the same on every rank
    ("compressed" without the fallback)."""
    if "decided/%d" % step not in ranks[0] or not packed:
        return "compressed"
    got = [json.loads(str(r["decided/%d" % step]))[scatter_wire.owner_key(packed)] for r in ranks]
    assert all(d == got[0] for d in got), got
    return got[0]


def _check_stats(st, groups, rec, min_numel, threshold, exchange, nranks, rank):
    """The hook's stats after the last step: TwoBitCompressor.stats()'s fields, one entry per
    bucket with its exchange and the bytes this rank handed to the collectives."""
    from horovod_twobit.torch import TwoBitCompressor
    assert set(st) == set(TwoBitCompressor(threshold).stats()), sorted(st)
    total, last, keys = dict.fromkeys(stats.EXCHANGES, 0), STEPS - 1, set()
    for g in groups:
        packed = [n for n in g if rec["local/%d/%s" % (last, n)].size >= min_numel]
        if not packed:
            continue
        layout = _layout([rec["local/%d/%s" % (last, n)].size for n in packed], threshold)
        ex = scatter_wire.choose(exchange, layout, nranks)
        keys.add(scatter_wire.owner_key(packed))
        entry = st["buckets"][scatter_wire.owner_key(packed)]
        assert set(entry) == set(stats.bucket_entry([], "", 1, 0, 0, 0.0, 0, 0.0, 0.0))
        assert entry["exchange"] == ex and entry["tensors"] == packed
        assert entry["bytes_last_step"] == scatter_wire.rank_bytes(layout, nranks, rank, ex)
        assert 0 <= entry["fraction_sent"] < 1 and entry["residual_l2"] > 0
        total[ex] += entry["bytes_last_step"]
    assert set(st["buckets"]) == keys  # the buckets in use (not those before DDP rebuilt them)
    assert st["bytes_last_step"] == total and st["nonfinite_steps"] == 1
    assert 0 < st["fraction_sent"] < 1 and st["threshold"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("modes", ["mismatch", "mismatch,scatter"])
def test_ddp_mismatched_thresholds_raise_on_every_rank(tmp_path, modes):
    out = _run(tmp_path, 2, 0.05, modes)
    raised = sorted(line.split(": ", 1)[1] for line in out.stdout.splitlines()
                    if line.startswith("RAISED rank"))
    assert out.returncode != 0 and len(raised) == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert raised[0] == raised[1] and "different thresholds" in raised[0], raised


def test_ddp_state_refuses_what_it_cannot_do():
    from horovod_twobit.torch import ddp
    for kw in ({"exchange": "both"}, {"min_numel": -1}, {"fallback": "sometimes"}):
        with pytest.raises(ValueError):
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



# Two ranks of a gloo group: rank 0 starts an all_reduce with a Python callback and keeps the
# GIL (a busy loop, no switch interval) while rank 1 joins the all_reduce and another process
# reads rank 0's threads; then shutdown() ends the group on both.
SHUTDOWN_JOB = r"""
import os, subprocess, sys, time, torch, torch.distributed as dist
from horovod_twobit.torch import ddp as twobit_ddp
store, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
if rank == 1:  # joins the all_reduce once rank 0 keeps the GIL
    while not os.path.exists(store + ".go"):
        time.sleep(0.01)
    dist.all_reduce(torch.ones(4))
    twobit_ddp.shutdown()
    sys.exit(0)
t0 = time.monotonic()  # (the threads start)
while twobit_ddp._gloo_threads_idle() is not True and time.monotonic() - t0 < 10:
    time.sleep(0.01)
assert twobit_ddp._gloo_threads_idle() is True, "idle before any work"
reader = subprocess.Popen([sys.executable, "-c", "import sys, time; "
    "from horovod_twobit.torch import ddp; print('READY', flush=True); time.sleep(1.0); "
    "print('READ', [ddp._gloo_threads_idle(int(sys.argv[1])) for _ in range(20)], flush=True)",
    str(os.getpid())], stdout=subprocess.PIPE, text=True)
assert reader.stdout.readline().startswith("READY")
fut = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
sys.setswitchinterval(1000)  # this thread keeps the GIL while it runs Python
open(store + ".go", "w").close()
t0 = time.monotonic()
while time.monotonic() - t0 < 3.0:
    pass
sys.setswitchinterval(0.005)
print(reader.stdout.read().strip(), flush=True)
twobit_ddp.shutdown()
print("RESULT", fut.wait().tolist(), twobit_ddp._gloo_threads_idle())
"""


def test_shutdown_waits_for_gloo_threads(tmp_path):
    """While a gloo thread waits for the GIL to run the hook's callback (or free what a
    collective held), its threads are not idle; once it ran, they are, and shutdown() ends the
    group: the wait that keeps a rank from freeing the group or exiting under such a thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    other = subprocess.Popen([sys.executable, "-c", SHUTDOWN_JOB, str(tmp_path / "store"), "1"],
                             env=env)
    out = subprocess.run([sys.executable, "-c", SHUTDOWN_JOB, str(tmp_path / "store"), "0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert other.wait(timeout=60) == 0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    read = next(l for l in out.stdout.splitlines() if l.startswith("READ"))
    assert eval(read[len("READ "):]) == [False] * 20, read  # waiting for the GIL all along
    assert "RESULT [4.0, 4.0, 4.0, 4.0] None" in out.stdout, out.stdout  # 2 ranks x 1, x 2
