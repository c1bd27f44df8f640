"""Buckets in the torch codec: N ranks simulated in one process, against the NumPy reference.

A bucket's payload goes through ``codec.encode_payload`` on every rank; the concatenation of the
payloads (what the allgather returns) through ``codec.finish_payload``. Every member's result and
residual must be the reference's for that tensor alone, bit for bit. And a real job's training,
bucketed and each tensor alone (tests/workers/torch_buckets.py), step by step against the
reference's workers."""

import numpy as np
import pytest
import torch

import jobs
import sim
from horovod_twobit import reference as ref
from horovod_twobit import wire
from horovod_twobit.wire.layout import Layout, assign_buckets
from horovod_twobit.torch.codec import compiled
from horovod_twobit.torch import codec

SIZES = [1, 15, 16, 17, 40, 480, 1000, 9216, 70003]


def _grads(sizes, nranks, step, scale=0.3):
    rng = np.random.default_rng(100 * step + 7)
    return [[(rng.standard_normal(n) * scale * rng.choice([0.1, 0.7, 3.0], n)).astype(np.float32)
             for n in sizes] for _ in range(nranks)]


def encode_all(layout, rs, grads, threshold, rule="lsq"):
    """Every rank's payload, (threshold, magnitude) and flat gradient."""
    payloads, levels, gs = [], [], []
    for rank in range(len(rs)):
        g = torch.zeros(layout.values, device=rs[rank].device)
        for s, x in zip(layout.starts, grads[rank]):
            g[s:s + x.size] = torch.from_numpy(x)
        p = torch.empty(layout.payload_words, dtype=torch.int32, device=g.device)
        levels.append(codec.encode_payload(layout, rs[rank], g, threshold, rule, p))
        payloads.append(p)
        gs.append(g)
    return payloads, levels, gs


def _exchange(layout, rs, grads, threshold, rule="lsq", op_divisor=None, scale=1.0):
    """One step on every rank; returns each rank's flat result."""
    nranks = len(rs)
    payloads, levels, gs = encode_all(layout, rs, grads, threshold, rule)
    gathered = torch.cat(payloads)
    names = ["t%d" % i for i in range(layout.members)]
    return [codec.finish_payload(layout, gathered, nranks, names, rs[rank], gs[rank],
                                 *levels[rank], op_divisor or nranks, scale)[0]
            for rank in range(nranks)]


@pytest.mark.parametrize("threshold,block,blocks", [(0.5, None, None), (0.05, None, None),
                                                    ("auto", None, None), ("auto", None, 1),
                                                    ("auto", 16, 4), ("auto", 32, 0)])
@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_bucket_matches_each_tensor_alone(threshold, block, blocks, nranks, device):
    auto = threshold == "auto"
    layout = Layout(SIZES, auto, *wire.validate_blocks(threshold, block, blocks))
    assert all(s % 16 == 0 for s in layout.starts) and layout.payload_words > layout.words
    rs = [torch.zeros(layout.values, device=device) for _ in range(nranks)]
    w = ref.Workers(nranks, threshold, block=block, blocks=blocks)
    sent = 0
    for step in range(3):
        grads = _grads(SIZES, nranks, step)
        outs = _exchange(layout, rs, grads, threshold)
        for i, (n, s) in enumerate(zip(SIZES, layout.starts)):
            want = w.allreduce("t%d" % i, [g[i] for g in grads])
            sent += np.count_nonzero(want)
            for rank in range(nranks):
                np.testing.assert_array_equal(outs[rank][s:s + n].cpu().numpy(), want,
                                              err_msg="rank %d tensor %d step %d" % (rank, i, step))
                np.testing.assert_array_equal(rs[rank][s:s + n].cpu().numpy().view(np.int32),
                                              w.residuals[rank]["t%d" % i].view(np.int32))
        for rank in range(nranks):  # the gaps between members stay zero
            mask = torch.ones(layout.values, dtype=torch.bool, device=device)
            for n, s in zip(SIZES, layout.starts):
                mask[s:s + n] = False
            assert not rs[rank][mask].any() and not outs[rank][mask].any()
    assert sent > 0


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference, on Inf
@pytest.mark.parametrize("rule", ["lsq", "opt", "mean", "rms", "lsq*2"])
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_segment_levels_are_each_blocks_levels(monkeypatch, rule, path):
    """codec.segment_levels gathers a bucket's segments into tables (small groups of different
    lengths share one, rows padded); each segment's levels are still the reference's for that
    block alone, with empty members, zeros, NaN and Inf among them, and for a tensor alone."""
    monkeypatch.setattr(compiled, "COMPILE_MIN_NUMEL", 0 if path == "compiled" else 1 << 62)
    sizes = [0, 10, 32, 33, 64, 100, 200, 257, 1000, 9216, 12288, 4096, 0, 70003, 5]
    rng = np.random.default_rng(5)
    for step in range(2):
        for layout in (Layout(sizes, True, 64, 64), Layout(sizes, True, 16, 0),
                       Layout([70003], True, 64, 64), Layout([1000], True, 64, 1)):
            xs = [(rng.standard_normal(n) * np.exp2(rng.uniform(-20, 20, n))).astype(np.float32)
                  for n in layout.numels]
            if layout.members > 1:
                xs[2][:] = 0.0
                xs[3][7], xs[4][0], xs[6][:] = np.nan, np.inf, 1e-42
            r = torch.from_numpy(rng.standard_normal(layout.values).astype(np.float32))
            g = torch.zeros(layout.values)
            for s, x, n in zip(layout.starts, xs, layout.numels):
                g[s:s + n] = torch.from_numpy(x) - r[s:s + n]
            r, g = (r, g) if step == 0 else (g, r)  # r + g == g + r, bit for bit
            t, v = codec.segment_levels(layout, r, g, rule)
            want = []
            for s, n, b in zip(layout.starts, layout.numels, layout.blocks):
                x = (r[s:s + n] + g[s:s + n]).numpy()
                want += zip(*ref.block_levels(x, b, rule)) if b else [ref.auto_levels(x, rule)]
            want = np.array(want, np.float32).reshape(-1, 2)
            np.testing.assert_array_equal(t.numpy().view(np.int32), want[:, 0].view(np.int32))
            np.testing.assert_array_equal(v.numpy().view(np.int32), want[:, 1].view(np.int32))


def test_one_member_sends_the_single_tensor_payload():
    """A bucket of one tensor is today's payload, byte for byte."""
    for threshold, blocks in ((0.5, (None, None)), ("auto", (64, 64)), ("auto", (64, 1))):
        layout = Layout([1000], threshold == "auto", *blocks)
        g = torch.from_numpy(_grads([1000], 1, 0)[0][0])
        p = torch.empty(layout.payload_words, dtype=torch.int32)
        codec.encode_payload(layout, torch.zeros(1000), g, threshold, "lsq", p)
        r = np.zeros(1000, np.float32)
        block = wire.block_of(1000, *blocks) if threshold == "auto" else None
        if threshold == "auto" and block:
            t, v = ref.block_levels(g.numpy(), block)
            want = wire.make_header(1000, 1.0, wire.FLAG_AUTO, block) + list(v.view(np.int32))
            want += list(ref.encode(g.numpy(), r, ref.per_value(t, block, 1000),
                                    ref.per_value(v, block, 1000)))
        elif threshold == "auto":
            t, v = ref.auto_levels(g.numpy())
            want = wire.make_header(1000, v, wire.FLAG_AUTO) + list(ref.encode(g.numpy(), r, t, v))
        else:
            want = wire.make_header(1000, threshold) + list(ref.encode(g.numpy(), r, threshold))
        assert p.tolist() == [int(x) for x in want]


@pytest.mark.parametrize("threshold", [0.5, "auto"])
@pytest.mark.parametrize("middle", [17, compiled.COMPILE_MIN_NUMEL + 7])  # eager, compiled codec
def test_nonfinite_member_is_nan_everywhere_and_keeps_its_residual(threshold, middle):
    sizes = [40, middle, 300]
    layout = Layout(sizes, threshold == "auto", *wire.validate_blocks(threshold))
    rs = [torch.zeros(layout.values) for _ in range(2)]
    w = ref.Workers(2, threshold)
    for step in range(3):
        grads = _grads(sizes, 2, step)
        if step == 1:
            grads[1][1][5] = np.nan  # rank 1, second member
        before = [r.clone() for r in rs]
        outs = _exchange(layout, rs, grads, threshold)
        for i, (n, s) in enumerate(zip(sizes, layout.starts)):
            want = w.allreduce("t%d" % i, [g[i] for g in grads])
            for rank in range(2):
                np.testing.assert_array_equal(outs[rank][s:s + n].numpy(), want)
                if step == 1 and i == 1:
                    assert torch.isnan(outs[rank][s:s + n]).all()
                    assert torch.equal(rs[rank][s:s + n], before[rank][s:s + n])


def test_mismatched_buckets_raise_the_same_error_on_every_rank():
    a, b = Layout([40, 17], False), Layout([40, 18], False)
    pa = torch.empty(a.payload_words, dtype=torch.int32)
    pb = torch.empty(b.payload_words, dtype=torch.int32)
    codec.encode_payload(a, torch.zeros(a.values), torch.ones(a.values), 0.5, "lsq", pa)
    codec.encode_payload(b, torch.zeros(b.values), torch.ones(b.values), 0.5, "lsq", pb)
    gathered = torch.cat([pa, pb])
    msgs = set()
    for lay in (a, b):
        with pytest.raises(wire.PayloadMismatchError, match="bucketed different tensors") as e:
            codec.finish_payload(lay, gathered, 2, ["x", "y"], torch.zeros(lay.values),
                                 torch.ones(lay.values), 0.5, 0.5, 2, 1.0)
        msgs.add(str(e.value))
    assert len(msgs) == 1
    # a rank that sends the first member alone meets a bucket: refused on both sides
    single = Layout([40], False)
    ps = torch.empty(single.payload_words, dtype=torch.int32)
    codec.encode_payload(single, torch.zeros(40), torch.ones(40), 0.5, "lsq", ps)
    for lay, r in ((a, torch.zeros(a.values)), (single, torch.zeros(40))):
        with pytest.raises(wire.PayloadMismatchError, match="bucket"):
            codec.finish_payload(lay, torch.cat([pa, ps]), 2, ["x", "y"], r, torch.ones_like(r),
                                 0.5, 0.5, 2, 1.0)


@pytest.mark.parametrize("sizes", [[40, 17], [300]])
def test_headers_checked_again_when_they_change(sizes):
    """The finish takes a previous step's header check again only for the same header words: a
    rank whose header changes (another threshold) is refused after good steps, a NaN step is
    flagged, and the good steps after both finish as before, bit for bit."""
    lay = Layout(sizes, False)
    names = ["t%d" % i for i in range(lay.members)]
    g = torch.linspace(-1, 1, lay.values)

    def payload(threshold, grad=g):
        p = torch.empty(lay.payload_words, dtype=torch.int32)
        codec.encode_payload(lay, torch.zeros(lay.values), grad, threshold, "lsq", p)
        return p

    def finish(gathered):
        r = torch.zeros(lay.values)
        out, bad = codec.finish_payload(lay, gathered, 2, names, r, g.clone(), 0.5, 0.5, 2, 1.0)
        return out, bad, r

    good = torch.cat([payload(0.5), payload(0.5)])
    first = finish(good)
    assert not first[1]
    for _ in range(2):
        with pytest.raises(wire.PayloadMismatchError, match="different thresholds"):
            finish(torch.cat([payload(0.5), payload(0.25)]))
        nan = g.clone()
        nan[3] = float("nan")
        out, bad, _ = finish(torch.cat([payload(0.5, nan), payload(0.5)]))
        assert bad and torch.isnan(out[:sizes[0]]).all()
        again = finish(good)
        assert not again[1]
        for a, b in zip(first, again):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_assign_buckets_is_fixed_by_order_and_size():
    entries = [("a", 10, 40, "cpu"), ("b", 10, 40, "cpu"), ("big", 1000, 4000, "cpu"),
               ("c", 10, 40, "cpu"), ("d", 10, 40, "cpu"), ("e", 10, 40, "cuda"),
               ("f", 10, 40, "cuda"), ("z", 0, 0, "cpu")]
    assert assign_buckets(entries, 100) == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert assign_buckets(entries, 160) == [["a", "b", "c", "d"], ["e", "f"]]
    assert assign_buckets(entries, 40) == []
    assert assign_buckets(entries, 10000) == [["a", "b", "big", "c", "d"], ["e", "f"]]


def test_layout_groups_equal_segments():
    lay = Layout([9216, 9216, 32, 32, 100], True, 64, 64)
    assert lay.blocks == [256, 256, None, None, 64]
    assert lay.segments == 36 + 36 + 1 + 1 + 2
    lengths = {length: len(ids) for length, ids, _ in lay.groups}
    assert lengths == {256: 72, 32: 2, 64: 1, 36: 1}
    starts = {length: start for length, _, start in lay.groups}
    assert starts[256] == 0 and starts[32] == 18432  # runs of blocks: views, no gather
    assert Layout([9216, 32, 9216], True, 64, 64).groups[-1][2] is None  # gathered
    assert sum(lay.seg_words) == lay.words - 0  # every word belongs to one segment


def bucket_job(tmp_path_factory, threshold):
    """The ranks' records of tests/workers/torch_buckets.py on 3 ranks (one job per threshold
    and test session, shared by the tests that ask)."""
    def job():
        out = tmp_path_factory.mktemp("torch_buckets")
        jobs.run(3, "torch_buckets.py", "--out", out, "--threshold", threshold)
        return out
    return sim.load_ranks(str(jobs.shared(("torch_buckets", threshold), job)), 3)


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [0.05, "auto"])
def test_bucketed_training_matches_the_reference_step_by_step(tmp_path_factory, threshold):
    """hvd.DistributedOptimizer's training with buckets, and with each tensor alone: at every
    step, every rank's aggregated gradients and residuals are those of ``ref.Workers`` fed the
    ranks' local gradients bucket by bucket, bit for bit: the BatchNorm's parameters, the layer
    that gets no gradient on odd steps (Horovod sends zeros for it there), the float64 parameter
    (sent as float32, its result cast back)."""
    ranks = bucket_job(tmp_path_factory, threshold)
    r0 = ranks[0]
    names = sorted({k.split("/", 3)[3] for k in r0 if k.startswith("agg/bucketed/0/")})
    steps = sorted({int(k.split("/")[2]) for k in r0 if k.startswith("agg/bucketed/")})
    assert len(names) == 11 and len(steps) == 6
    assert {"bn.weight", "bn.bias", "unused.weight", "unused.bias", "scale"} <= set(names)
    for run in ("bucketed", "alone"):
        groups = [str(g).split(",") for g in r0["groups/" + run]]
        for r in ranks[1:]:
            assert [str(g).split(",") for g in r["groups/" + run]] == groups
        if run == "bucketed":
            assert len(groups) >= 2 and any(len(g) > 1 for g in groups)
            assert {"bn.weight", "bn.bias", "unused.weight"} <= {n for g in groups for n in g}
        grouped = {n for g in groups for n in g}
        groups += [[n] for n in names if n not in grouped]  # the tensors that travel alone
        assert sorted(n for g in groups for n in g) == names
        w = ref.Workers(3, threshold)
        sent = 0
        for step in steps:
            local = []
            for r in ranks:
                got = {}
                for n in names:
                    k = "local/%s/%d/%s" % (run, step, n)
                    if k in r:
                        got[n] = r[k].astype(np.float32)  # the float64 one: sent as float32
                    else:  # no gradient: Horovod's optimizer allreduces zeros
                        got[n] = np.zeros(r["agg/%s/%d/%s" % (run, step, n)].shape, np.float32)
                missing = sorted(set(names) - {n for n in names
                                               if "local/%s/%d/%s" % (run, step, n) in r})
                assert missing == ([] if step % 2 == 0 else ["unused.bias", "unused.weight"])
                local.append(got)
            for g in groups:
                want = w.bucket(g, [[loc[n] for n in g] for loc in local])
                for n, x in zip(g, want):
                    sent += int(np.count_nonzero(x))
                    for rank, r in enumerate(ranks):
                        msg = "%s run, rank %d, step %d, %s" % (run, rank, step, n)
                        got = r["agg/%s/%d/%s" % (run, step, n)]
                        np.testing.assert_array_equal(got, x.astype(got.dtype), err_msg=msg)
                        np.testing.assert_array_equal(
                            r["res/%s/%d/%s" % (run, step, n)].view(np.int32),
                            w.residuals[rank][n].view(np.int32), err_msg=msg)
        assert sent > 0
