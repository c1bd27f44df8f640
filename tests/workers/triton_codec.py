"""The codec's Triton kernels through Triton's interpreter, against the NumPy reference, bit for
bit (tests/test_triton_kernels.py runs this with TRITON_INTERPRET=1 and HOROVOD_TWOBIT_TRITON=force,
which must be set before the process starts; on a GPU, with ``--device cuda``, the same cases run
the compiled kernels).

``python triton_codec.py [--device cuda] CASE...`` runs the named cases (``all``: every one) and
prints one JSON line per case: {"case", "ok", "error", "seconds"}. Each case takes a few ranks
through a few steps of a bucket (or a tensor alone) with the codec's own entry points
(``codec.encode_payload`` / ``finish_payload``, ``scatter_codec.owner_reduce``), which dispatch
to the Triton kernels, and checks every rank's payload words, result and residuals against the
reference's workers, and the payloads and returned levels against the codec's torch path
(HOROVOD_TWOBIT_TRITON=0's, eager) on the same inputs.
"""

import json
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from horovod_twobit import reference as ref  # noqa: E402
from horovod_twobit import wire  # noqa: E402
from horovod_twobit.wire import scatter as sw  # noqa: E402
from horovod_twobit.wire.layout import Layout  # noqa: E402
from horovod_twobit.torch import codec  # noqa: E402
from horovod_twobit.torch.codec import compiled  # noqa: E402

DEVICE = "cpu"
BUCKET = [1, 15, 16, 17, 40, 480, 1000, 3001]  # sizes not multiples of 16, nor of a block
TYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _grads(sizes, nranks, step, threshold, faults=()):
    """float32 gradients of each rank and member, with values exactly at +-t (a numeric
    threshold, on a step's first values, where the residual is still 0 at step 0) and the
    ``faults`` (step, rank, member, value) put in."""
    rng = np.random.default_rng(1000 * step + 11)
    out = []
    for rank in range(nranks):
        gs = []
        for i, n in enumerate(sizes):
            g = (rng.standard_normal(n) * 0.3 * rng.choice([0.1, 0.7, 3.0], n)).astype(np.float32)
            if threshold != "auto" and n >= 4:
                g[:4] = np.float32(threshold) * np.array([1, -1, 1, -1], np.float32)
            for s, r, m, value in faults:
                if (s, r, m) == (step, rank, i):
                    g[n // 2] = value
            gs.append(g)
        out.append(gs)
    return out


class Path:
    """One side of the comparison: the codec with the Triton kernels (``triton``) or without."""

    def __init__(self, triton, layout, nranks, dtype):
        self.triton, self.layout, self.dtype = triton, layout, dtype
        self.rs = [torch.zeros(layout.values, device=DEVICE) for _ in range(nranks)]

    def _on(self):
        compiled.TRITON = "force" if self.triton else "0"

    def encode(self, grads, threshold, rule):
        self._on()
        lay = self.layout
        self.payloads, self.levels, self.gs = [], [], []
        for rank, gs in enumerate(grads):
            g = torch.zeros(lay.values, dtype=self.dtype, device=DEVICE)
            for s, x in zip(lay.starts, gs):
                g[s:s + x.size] = torch.from_numpy(x).to(self.dtype)
            p = torch.full((lay.payload_words,), -7, dtype=torch.int32, device=DEVICE)
            self.levels.append(codec.encode_payload(lay, self.rs[rank], g, threshold, rule, p))
            self.payloads.append(p)
            self.gs.append(g)

    def finish(self, divisor, scale, into):
        self._on()
        lay, N = self.layout, len(self.rs)
        gathered = torch.cat(self.payloads)
        names = ["t%d" % i for i in range(lay.members)]
        outs = []
        for rank in range(N):
            out = torch.full((lay.values,), 5.0, dtype=torch.float32, device=DEVICE) if into else None
            res, _ = codec.finish_payload(lay, gathered, N, names, self.rs[rank], self.gs[rank],
                                          *self.levels[rank], divisor, scale, out=out)
            outs.append(res)
        return outs


def _levels(x, n):
    """A returned threshold or magnitude as float32 bits per word (a number or 0-d: repeated)."""
    x = torch.as_tensor(x, dtype=torch.float32).cpu().reshape(-1)
    return np.broadcast_to(x.numpy(), (n,)) if x.numel() == 1 else x.numpy()


def allgather_case(sizes, threshold, nranks, steps=2, block=None, blocks=None, rule="lsq",
                   op="average", scale=1.0, dtype="float32", faults=(), into=False):
    """Steps of a bucket (or a tensor alone) through the allgather exchange's codec."""
    auto = threshold == "auto"
    lay = Layout(sizes, auto, *wire.validate_blocks(threshold, block, blocks))
    tri, eager = Path(True, lay, nranks, TYPES[dtype]), Path(False, lay, nranks, TYPES[dtype])
    w = ref.Workers(nranks, threshold, rule=rule, block=block, blocks=blocks)
    divisor = nranks if op == "average" else 1
    for step in range(steps):
        grads = _grads(sizes, nranks, step, threshold, faults)
        # the reference sees the gradients as the codec does: rounded to their dtype
        grads = [[torch.from_numpy(g).to(TYPES[dtype]).float().numpy() for g in gs] for gs in grads]
        for p in (tri, eager):
            p.encode(grads, threshold, rule)
        for rank in range(nranks):
            np.testing.assert_array_equal(tri.payloads[rank].cpu().numpy(),
                                          eager.payloads[rank].cpu().numpy(),
                                          err_msg="payload of rank %d, step %d" % (rank, step))
            for a, b in zip(tri.levels[rank], eager.levels[rank]):
                np.testing.assert_array_equal(_levels(a, lay.words).view(np.int32),
                                              _levels(b, lay.words).view(np.int32))
        before = [{n: w.residuals[r].get(n, np.zeros(0, np.float32)).copy()
                   for n in w.residuals[r]} for r in range(nranks)]
        outs = tri.finish(divisor, scale, into)
        for a, b in zip(outs, eager.finish(divisor, scale, into)):  # (padding included)
            np.testing.assert_array_equal(a.float().cpu().numpy().view(np.int32),
                                          b.float().cpu().numpy().view(np.int32))
        names = ["t%d" % i for i in range(lay.members)]
        want = w.bucket(names, grads, op=op, postscale=scale)
        bad = [not all(np.isfinite(gs[i]).all() for gs in grads) for i in range(lay.members)]
        for i, (n, s) in enumerate(zip(lay.numels, lay.starts)):
            for rank in range(nranks):
                if not bad[i]:  # the payload's words: the reference's
                    words = ref_words(w, names[i], rank, grads[rank][i], before[rank], lay, i)
                    body = tri.payloads[rank][lay.body + s // 16:][:words.size].cpu().numpy()
                    np.testing.assert_array_equal(body, words, err_msg="words %d/%d" % (rank, i))
                got = outs[rank][s:s + n].float().cpu().numpy()
                exp = torch.from_numpy(np.asarray(want[i], np.float32)).to(
                    outs[rank].dtype).float().numpy()
                np.testing.assert_array_equal(got.view(np.int32), exp.view(np.int32),
                                              err_msg="rank %d tensor %d step %d" % (rank, i, step))
                np.testing.assert_array_equal(tri.rs[rank][s:s + n].cpu().numpy().view(np.int32),
                                              w.residuals[rank][names[i]].view(np.int32),
                                              err_msg="residual rank %d tensor %d" % (rank, i))
        for rank in range(nranks):  # the padding between members: residual 0, result 0 or kept
            pad = torch.ones(lay.values, dtype=torch.bool)
            for s, n in zip(lay.starts, lay.numels):
                pad[s:s + n] = False
            assert not tri.rs[rank].cpu()[pad].any()
            got = outs[rank].float().cpu()[pad]
            assert ((got == 0) | (got == 5.0)).all() and (into or not got.any())
    return lay


def ref_words(w, name, rank, g, before, lay, i):
    """The reference's packed words of one member on one rank for the step it just took, from
    its residual before the step and the levels it chose."""
    t, v = w.last_levels[name][rank]
    block = wire.block_of(g.size, *lay.cut) if lay.auto else None
    if block:
        t, v = ref.per_value(t, block, g.size), ref.per_value(v, block, g.size)
    r = before.get(name, np.zeros(g.size, np.float32))
    r = np.zeros(g.size, np.float32) if r.size != g.size else r.copy()
    return ref.codec.encode(g, r, t, v)


def scatter_case(sizes, threshold, nranks, steps=2, block=None, blocks=None, scale=1.0):
    """Steps of a bucket through the scatter exchange's codec (the owner's decode-sum of every
    sender's chunk in one launch), against the reference's scatter exchange."""
    import test_torch_scatter_codec as tsc
    compiled.TRITON = "force"
    auto = threshold == "auto"
    lay = Layout(sizes, auto, *wire.validate_blocks(threshold, block, blocks))
    chunks, rs_, owners = tsc.ranks_state(lay, nranks, DEVICE)
    w = ref.Workers(nranks, threshold, block=block, blocks=blocks, exchange="scatter")
    names = ["t%d" % i for i in range(len(sizes))]
    scratches = tsc.owner_scratches(chunks, DEVICE) if nranks % 2 else None  # both ways
    for step in range(steps):
        grads = tsc._grads(sizes, nranks, step)
        outs, _, _ = tsc.exchange(lay, rs_, owners, grads, threshold, divisor=nranks,
                                  scale=scale, scratches=scratches)
        want = w.bucket(names, grads, postscale=scale)
        tsc.check_step(w, names, lay, want, outs, rs_, owners if auto else None, step)


def at_least_case():
    """The count pass's float32 test of |r + g| against a float64 candidate, ``x >=
    _at_least(t)``, is ``float64(x) >= t`` for every x near t: t exactly a float32, rounded down
    or up to nearest, below the smallest subnormal, past the largest float32, 0, Inf and NaN."""
    compiled.triton_path(torch.device(DEVICE))  # the kernels' module, as the codec imports it
    from triton_at_least import at_least_kernel

    f32 = np.finfo(np.float32)
    base = [0.0, 1.0, 0.75, 1e-3, 3.3, 123456.789, float(f32.max), float(f32.tiny),
            float(f32.smallest_subnormal), 1e-46, 1e-50, 3.5e38, 1e300, INF, NAN]
    ts = sorted({t * (1 + e) for t in base for e in (0.0, 2.0 ** -30, -2.0 ** -30, 2.0 ** -24,
                                                     -2.0 ** -24)}, key=lambda t: (t != t, t))
    ts = [t for t in ts if t != t or t >= 0] + [NAN]
    n = 1 << (len(ts) - 1).bit_length()
    t = torch.tensor(ts + [0.0] * (n - len(ts)), dtype=torch.float64, device=DEVICE)
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    at_least_kernel[(1,)](t, out, N=n)
    for tv, up in zip(ts, out[:len(ts)].cpu().tolist()):
        near = np.float32(tv) if tv == tv and tv < 3.4e38 else f32.max
        xs = [np.float32(0.0), f32.smallest_subnormal, near, np.nextafter(near, np.float32(0)),
              np.nextafter(near, np.float32(INF)), np.float32(INF), np.float32(up)]
        for x in xs:
            assert (x >= np.float32(up)) == (float(x) >= tv), (tv, float(x), up)


NAN, INF = float("nan"), float("inf")
FAULTS = ((0, 0, 2, NAN), (0, 1, 5, INF), (1, 2, 7, -INF), (1, 0, 3, NAN))
# Under the interpreter a program costs milliseconds, an "auto" chunk three programs: the fast
# cases cut members into few blocks (block=256, blocks=4), the slow ones use the defaults (blocks
# of 64 values and up, 76 segments in BUCKET). The suite sets CHUNK to 512 values, so that
# segments of 1 K values and more span several chunks.
CASES = {
    # fixed threshold: a tensor alone (odd sizes, several programs), 1, 2 and 3 ranks, the
    # divisor 1, 2 or 3 and a scale; written over the gradient or into a new tensor
    # (0.1 and 0.37 have every significant bit set: the order of / divisor, * scale shows)
    "fixed_single": lambda: [allgather_case([n], t, N, op=op, scale=sc, into=into)
                             for n, t, N, op, sc, into in [(1, 0.5, 1, "average", 1.0, False),
                                                           (17, 0.5, 2, "sum", 0.37, True),
                                                           (4099, 0.1, 3, "average", 0.37, False),
                                                           (9000, 0.5, 2, "average", 2.5, True)]],
    "fixed_bucket": lambda: [allgather_case(BUCKET, t, N, op=op, scale=sc)
                             for t, N, op, sc in [(0.5, 2, "average", 1.0), (0.05, 3, "sum", 0.7)]],
    # NaN and +-Inf in members of a bucket on some ranks: NaN there, residuals kept, the rest as
    # usual; and in a tensor alone
    "nonfinite": lambda: [allgather_case(BUCKET, t, 3, faults=FAULTS, into=into, block=b,
                                         blocks=bs) for t, into, b, bs in
                          [(0.5, False, None, None), ("auto", True, 256, 4)]]
                         + [allgather_case([1000], t, 2, faults=((0, 1, 0, -INF),), block=b,
                                           blocks=bs) for t, b, bs in [(0.5, None, None),
                                                                       ("auto", 256, 4)]],
    # (1 + 2^-7 + 2^-8: its multiples / 2 * 0.5 lie half-way between two bfloat16 values, so
    # the rounding's ties show); and a tensor alone of a size not a multiple of 16, over several
    # programs (the vector path in all but the last)
    "half": lambda: [allgather_case(BUCKET, t, 2, dtype=d, scale=0.5, steps=1 + (t != "auto"),
                                    block=b, blocks=bs)
                     for t, b, bs in [(0.05, None, None), (1.01171875, None, None),
                                      ("auto", 256, 4)]
                     for d in ("float16", "bfloat16")]
                    + [allgather_case([4099], 0.05, 2, dtype=d, scale=0.5, into=into)
                       for d, into in (("float16", True), ("bfloat16", False))],
    # "auto", lsq in the kernels: one block, blocks of a member, segments cut into several chunks
    "auto_single": lambda: [allgather_case([n], "auto", N, block=b, blocks=bs, op=op, scale=sc)
                            for n, N, b, bs, op, sc in [(1, 1, None, None, "average", 1.0),
                                                        (100, 2, None, 1, "sum", 1.0),
                                                        (5003, 3, 16, 4, "average", 0.3),
                                                        (9000, 2, 16, 8, "average", 1.0),
                                                        (20000, 2, None, 1, "average", 1.0)]],
    "auto_bucket": lambda: [allgather_case(BUCKET, "auto", N, block=b, blocks=bs)
                            for N, b, bs in [(3, 16, 4), (2, 1024, 0), (2, None, 1)]],
    # the rule's factor in the kernels; other rules: their levels from torch, then the kernels
    "auto_rules": lambda: [allgather_case(BUCKET[:6] + [2000], "auto", 2, rule=rule, block=256,
                                          blocks=bs, steps=1)
                           for rule, bs in [("lsq*1.3", 4), ("opt", 4), ("mean", 1),
                                            ("rms*2", 4)]],
    "at_least": at_least_case,
    "scatter": lambda: [scatter_case(BUCKET, t, N, block=b, blocks=bs, scale=sc)
                        for t, N, b, bs, sc in [(0.5, 2, None, None, 1.0), (0.5, 3, None, None, 0.7),
                                                ("auto", 3, 256, 4, 0.7)]],
    # the defaults of threshold="auto" (many small segments): slow under the interpreter
    "auto_defaults": lambda: [allgather_case(BUCKET, "auto", 2, steps=2),
                              allgather_case(BUCKET, "auto", 3, faults=FAULTS[:2], steps=1)],
    "scatter_auto_defaults": lambda: scatter_case(BUCKET, "auto", 2, scale=0.5),
}
FAST = ["fixed_single", "fixed_bucket", "nonfinite", "half", "auto_single", "auto_bucket",
        "auto_rules", "at_least", "scatter"]


def main(argv):
    global DEVICE
    if argv[:1] == ["--device"]:
        DEVICE, argv = argv[1], argv[2:]
    names = list(CASES) if argv in ([], ["all"]) else argv
    ok = True
    for name in names:
        t0 = time.time()
        try:
            CASES[name]()
            row = {"case": name, "ok": True, "error": ""}
        except Exception:
            row = {"case": name, "ok": False, "error": traceback.format_exc()[-3000:]}
            ok = False
        row["seconds"] = round(time.time() - t0, 1)
        row["triton"] = compiled._triton[0] is not None if compiled._triton else False
        print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
