"""Odd tensors, non-finite gradients, threads: real horovodrun jobs against the NumPy simulation."""

import re
import threading

import numpy as np
import pytest
import torch

import jobs
import sim
from horovod_twobit import reference as ref
from horovod_twobit.state.residuals import ResidualRegistry

CAST = {"fp16": lambda a: a.astype(np.float16).astype(np.float32),
        "bf16": lambda a: torch.from_numpy(a).to(torch.bfloat16).float().numpy(),
        "fp64": lambda a: a}


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    d = tmp_path_factory.mktemp("odd")
    jobs.run(2, "torch_odd.py", d)
    return sim.load_ranks(str(d), 2)


@pytest.mark.parametrize("name", ["empty", "one", "scalar", "noncontig", "fp16", "bf16", "fp64"])
def test_odd_tensors_match_simulation(odd, name):
    w = ref.Workers(2, 0.5)
    for step in range(3):
        want = w.allreduce(name, [r["in/%s/%d" % (name, step)] for r in odd])
        want = CAST.get(name, lambda a: a)(want)
        for r in odd:
            np.testing.assert_array_equal(r["out/%s/%d" % (name, step)], want)


def test_integers_pass_through_exactly(odd):
    for r in odd:
        np.testing.assert_array_equal(r["ints"], np.arange(7) * 3)


def test_nonfinite_gradient_gives_nan_everywhere_and_keeps_residuals(odd):
    w = ref.Workers(2, 0.5)
    for step in range(3):
        want = w.allreduce("nf", [r["nf_in/%d" % step] for r in odd])
        for rank, r in enumerate(odd):
            got = r["nf_out/%d" % step]
            if step == 1:
                assert np.isnan(got).all()
                np.testing.assert_array_equal(r["nf_res_after/1"], r["nf_res_before/1"])
            else:
                np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(r["nf_res_after/%d" % step], w.residuals[rank]["nf"])
    # the step after the NaN is finite again and the residual was really in use
    assert np.abs(odd[0]["nf_res_after/1"]).sum() > 0


def test_registry_is_thread_safe():
    reg = ResidualRegistry(zeros_like=lambda g: torch.zeros_like(g), numel=lambda r: r.numel())
    seen = {}
    barrier = threading.Barrier(8)

    def work(i):
        barrier.wait()
        for k in range(200):
            r = reg.get("t%d" % (k % 10), torch.zeros(5))
            seen.setdefault((i, k % 10), set()).add(id(r))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg) == 10
    ids = {k: set() for k in range(10)}
    for (i, k), s in seen.items():
        ids[k] |= s
    assert all(len(s) == 1 for s in ids.values()), "two threads got different residuals for one name"


def test_dead_worker_ends_the_job():
    res = jobs.run(2, "torch_die.py", timeout=120, check=False)
    assert "rank 1 dies" in res.output
    assert res.returncode != 0 and res.seconds < 60, res


def test_bad_construction():
    from horovod_twobit.torch import TwoBitCompressor
    for bad in (0, -0.5, float("nan"), float("inf"), "x", None):
        with pytest.raises(ValueError, match="got " + re.escape(repr(bad))):
            TwoBitCompressor(bad)
    with pytest.raises(TypeError):
        TwoBitCompressor(0.5, treshold=1)


def test_state_from_another_rank_resets_with_warning():
    from horovod_twobit.torch import TwoBitCompressor
    c = TwoBitCompressor(0.5)
    state = c.state_dict()
    state["residuals"] = {"w": torch.ones(3)}
    state["rank"], state["size"] = 1, 2
    with pytest.warns(UserWarning, match="rank 1 of 2"):
        c.load_state_dict(state)
    assert len(c.residuals) == 0
    state["rank"], state["size"] = 0, 1
    c.load_state_dict(state)
    assert torch.equal(c.residuals.get("w", torch.zeros(3)), torch.ones(3))


def test_router_leaves_horovods_own_references_alone():
    import horovod.torch as hvd
    import horovod.torch.optimizer as hvd_opt
    from horovod_twobit.torch import router as _routing
    assert _routing.installed()
    assert hvd_opt.DistributedOptimizer.__module__ == "horovod.torch.optimizer"
    assert hvd.DistributedOptimizer is _routing.DistributedOptimizer
    _routing.uninstall()
    try:
        assert hvd.DistributedOptimizer.__module__ == "horovod.torch.optimizer"
        assert hvd.allreduce.__module__ == "horovod.torch.mpi_ops"
    finally:
        _routing.install()
    assert hvd.allreduce is _routing.allreduce


def test_min_numel_leaves_small_tensors_uncompressed():
    from horovod_twobit.torch import TwoBitCompressor
    from horovod_twobit.torch.router import pending_of
    c = TwoBitCompressor(0.5, min_numel=100)
    small, ctx = c.compress(torch.ones(99))
    assert pending_of(small) is None and ctx is None
    big, ctx = c.compress(torch.ones(100))
    assert pending_of(big) is ctx and ctx is not None
    assert pending_of(TwoBitCompressor(0.5).compress(torch.ones(1))[0]) is not None
    for bad in (-1, 1.5, "10", True):
        with pytest.raises(ValueError, match="min_numel"):
            TwoBitCompressor(0.5, min_numel=bad)
