"""Runs error cases one after another in one job: each must raise the documented error on every
rank, quickly, with no hang, and leave the job able to run the next case.

    torch_errors.py [--exchange allgather|scatter] CASE [CASE ...]

Every rank prints one line per case: ``RAISED rank R case C after S s: Type: message``, ``OK rank R
case C`` (a case that must be accepted) or ``NO ERROR rank R case C`` (a defect). Single tensors get
a name of their own per case (``x.CASE``), so no case meets another's state."""

import sys
import time

import torch

import horovod.torch as hvd
from horovod_twobit.torch import PayloadMismatchError
from horovod_twobit.torch import TwoBitCompressor as _TwoBit

args = sys.argv[1:]
exchange = None
if args[:1] == ["--exchange"]:
    exchange, args = args[1], args[2:]
hvd.init()
rank = hvd.rank()


def TwoBitCompressor(threshold):
    return _TwoBit(threshold) if exchange is None else _TwoBit(threshold, exchange=exchange)


def model_opt(compression, module=None, **kw):
    m = module if module is not None else torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return m, hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters(),
                                       compression=compression, **kw)


def step(m, opt, x):
    m(x).sum().backward()
    opt.step()


def run(case, x):
    """Runs one case; returns normally only when the case was accepted."""
    if case == "threshold":
        hvd.allreduce(torch.ones(40), name=x, compression=TwoBitCompressor(0.5 if rank == 0 else 0.25))
    elif case == "size":
        hvd.allreduce(torch.ones(40 + 20 * rank), name=x, compression=TwoBitCompressor(0.5))
    elif case == "size_same_words":
        hvd.allreduce(torch.ones(33 + rank), name=x, compression=TwoBitCompressor(0.5))
    elif case == "noname":
        hvd.allreduce(torch.ones(4), compression=TwoBitCompressor(0.5))
    elif case == "auto_vs_fixed":
        hvd.allreduce(torch.ones(40), name=x, compression=TwoBitCompressor("auto" if rank == 0 else 0.5))
    elif case == "buckets":  # another model on one rank: buckets of different tensors
        m = torch.nn.Sequential(torch.nn.Linear(4, 3 + rank), torch.nn.Linear(3 + rank, 2))
        step(*model_opt(TwoBitCompressor(0.5), m), torch.ones(2, 4))
    elif case == "exchange":  # rank 0 uses the allgather exchange, the others scatter
        c = _TwoBit(0.5, exchange="allgather" if rank == 0 else "scatter")
        hvd.allreduce(torch.ones(40), name=x, compression=c)
    elif case == "exchange_bucket":  # the same in a bucket, where rank 0 is the one that scatters
        step(*model_opt(_TwoBit(0.5, exchange="scatter" if rank == 0 else "allgather")),
             torch.ones(2, 4))
    elif case == "auto_exchange":  # "auto" decides from the size: allgather on rank 0 only
        c = _TwoBit(0.5, exchange="auto")
        hvd.allreduce(torch.ones(40 if rank == 0 else 3000), name=x, compression=c)
    elif case == "class":
        hvd.allreduce(torch.ones(4), name=x, compression=_TwoBit)
    elif case == "op":
        hvd.allreduce(torch.ones(4), name=x, op=hvd.Max, compression=TwoBitCompressor(0.5))
    elif case == "adasum":
        model_opt(TwoBitCompressor(0.5), op=hvd.Adasum)
    elif case in ("sparse", "sparse_as_dense"):
        emb = torch.nn.Embedding(10, 4, sparse=True)
        step(*model_opt(TwoBitCompressor(0.5), emb, sparse_as_dense=case == "sparse_as_dense"),
             torch.tensor([1, 2]))
        if case == "sparse_as_dense":
            return
    else:
        raise SystemExit("unknown case " + case)
    print("NO ERROR rank %d case %s" % (rank, case), flush=True)
    sys.exit(1)


for case in args:
    t0 = time.time()
    try:
        run(case, "x." + case)
        print("OK rank %d case %s" % (rank, case), flush=True)
    except (PayloadMismatchError, ValueError, TypeError) as e:
        print("RAISED rank %d case %s after %.1fs: %s: %s"
              % (rank, case, time.time() - t0, type(e).__name__, e), flush=True)
    hvd.barrier()  # the next case starts together on every rank
