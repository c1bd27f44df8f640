"""The fault-injection matrix: which cells the fault jobs run, shared by the workers
(tests/workers/torch_faults.py, tf_faults.py, ddp_faults.py) and the test that checks them (test_faults.py).

A cell is one short training run of a small model (two dense layers: tensors of 70, 7, 21 and 3
values, so every one ends in padding inside its words) through one path of a framework's Horovod
API, with a threshold, an exchange and a bucketing. One rank's gradient of one tensor holds one
NaN, +Inf or -Inf value at step ``FAULT_STEP``; the run goes on for ``STEPS`` steps in all, with
the optimizer step skipped where the result is not finite, as a loss scaler does.

Bucketings (what the faulty tensor shares its collective with):
  ``b0``    bucket_bytes=0: every tensor alone; the 7-value bias is faulty;
  ``one``   bucket_bytes=200: the 70-value weight, faulty, is alone; the other three share a
            bucket;
  ``multi`` the default bucket_bytes: all four in one bucket, the 7-value bias faulty and the
            other members finite.
With ``hvd.allreduce`` (PyTorch) the same groups are made by hand: single named allreduces and
``hvd.grouped_allreduce``. The ``ddp`` framework is DistributedDataParallel with the 2-bit hook
(tests/workers/ddp_faults.py, under torchrun): its buckets are DDP's, made with
``DDP_BUCKET_MB``'s caps, and may differ on the first step, before DDP rebuilds them.
"""

import collections
import itertools

import numpy as np

FAULT_STEP = 2
STEPS = FAULT_STEP + 4  # the faulty step and the three after it are checked
KINDS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
THRESHOLDS = ("0.05", "auto")
EXCHANGES = ("allgather", "scatter")
BUCKETINGS = {"b0": 0, "one": 200, "multi": None}  # bucket_bytes (None: the default)
PATHS = {"torch": ("optimizer", "allreduce"),
         "tf": ("tape_eager", "tape_function", "keras"),
         "ddp": ("hook",)}
# the model's tensors in parameter order, by their framework's names
TENSORS = {"torch": [("0.weight", 70), ("0.bias", 7), ("2.weight", 21), ("2.bias", 3)],
           "tf": [("hidden/kernel", 70), ("hidden/bias", 7), ("out/kernel", 21),
                  ("out/bias", 3)]}
TENSORS["ddp"] = TENSORS["torch"]
# DistributedDataParallel's bucket_cap_mb for each bucketing (DDP fills a bucket in reverse
# parameter order, 3 + 21 + 7 + 70 float32 values, and closes it once it holds the cap): one byte
# closes every bucket at its first tensor; 120 bytes closes one at the 7-value bias (124 bytes),
# leaving the 70-value weight alone; the default (25 MiB) holds all four
DDP_BUCKET_MB = {"b0": 1 / 2 ** 20, "one": 120 / 2 ** 20, "multi": 25}
INDEX = 3  # the value of the faulty tensor that gets the fault

Cell = collections.namedtuple("Cell", "path threshold exchange bucketing kind rank")


def faulty(framework, bucketing):
    """The name of the tensor that gets the fault."""
    return TENSORS[framework][0 if bucketing == "one" else 1][0]


def inject(cell, framework, rank, name, step, g):
    """A torch gradient with the cell's fault in it where this is the faulty rank, tensor and
    step (else ``g`` itself)."""
    if step == FAULT_STEP and rank == int(cell.rank) and name == faulty(framework, cell.bucketing):
        g = g.clone()
        g.view(-1)[INDEX] = KINDS[cell.kind]
    return g


def threshold(cell):
    return cell.threshold if cell.threshold == "auto" else float(cell.threshold)


def cells(framework, nranks):
    """The cells one job of ``nranks`` ranks runs. PyTorch on 2 ranks: every fault kind in every
    (path, threshold, exchange, bucketing), the faulty rank alternating. Otherwise (TensorFlow's
    cells cost a trace each, 3 ranks share 2 cores): each of those once, the kind and the faulty
    rank taking turns, so that every kind and every rank is covered, and each combination meets
    different kinds on 2 and on 3 ranks."""
    out = []
    combos = itertools.product(PATHS[framework], THRESHOLDS, EXCHANGES, BUCKETINGS)
    for i, (path, t, e, b) in enumerate(combos):
        if framework in ("torch", "ddp") and nranks == 2:
            out += [Cell(path, t, e, b, k, (i + j) % 2) for j, k in enumerate(KINDS)]
        else:
            out.append(Cell(path, t, e, b, list(KINDS)[(i + nranks) % 3], (i // 3) % nranks))
    return out


def encode(cell):
    return "/".join(str(x) for x in cell)


def decode(text):
    return Cell(*text.split("/"))


def save_residuals(rec, state, step):
    """A compressor's ``state_dict()`` after ``step``: the workers' residuals under res/STEP/NAME,
    the scatter owners' under own/STEP/KEY."""
    for k, r in state["residuals"].items():
        rec["res/%d/%s" % (step, k)] = np.asarray(r).copy()
    for k, r in state.get("owner_residuals", {}).items():
        rec["own/%d/%s" % (step, k)] = np.asarray(r).copy()


# ------------------------------------------------------------------------------ the soak run
# A long run of the default PyTorch path (hvd.DistributedOptimizer, buckets) with faults at random
# steps on random ranks. Its gradients are a function of the weights computed in NumPy, the same
# bits in the worker and in the test's replay, so the final weights can be compared exactly.

SOAK_STEPS = 2000
SOAK_LR = np.float32(0.1)
SOAK_CONFIGS = ("0.5/allgather", "auto/scatter")


def soak_faults(steps, nranks, seed=7, rate=0.02):
    """{step: (rank, tensor index, kind)}: about ``rate`` of the steps, never the first."""
    rng = np.random.default_rng(seed)
    out = {}
    for step in range(1, steps):
        if rng.random() < rate:
            out[step] = (int(rng.integers(nranks)), int(rng.integers(len(TENSORS["torch"]))),
                         list(KINDS)[int(rng.integers(len(KINDS)))])
    return out


def soak_start():
    """The initial weights, flat float32 per tensor (the same on every rank)."""
    rng = np.random.default_rng(3)
    return [rng.standard_normal(n).astype(np.float32) for _, n in TENSORS["torch"]]


def soak_grads(weights, rank, step, faults):
    """Rank ``rank``'s gradients at ``step``: a pull toward fixed targets plus per-rank noise, in
    float32, with the step's fault in it where there is one."""
    rng = np.random.default_rng(1000003 * rank + step)
    out = []
    for i, w in enumerate(weights):
        target = np.float32(0.25) * np.float32(i + 1)
        noise = (rng.standard_normal(w.size) * 0.2).astype(np.float32)
        out.append(np.float32(0.5) * (w - target) + noise)
    f = faults.get(step)
    if f is not None and f[0] == rank:
        out[f[1]][INDEX % out[f[1]].size] = KINDS[f[2]]
    return out
