"""Each case must raise the documented error on every rank, quickly, with no hang."""

import functools
import sys
import time

import torch

import horovod.torch as hvd
from horovod_twobit.torch import PayloadMismatchError
from horovod_twobit.torch import TwoBitCompressor as _TwoBit

case = sys.argv[1]
exchange = sys.argv[2] if len(sys.argv) > 2 else "allgather"
TwoBitCompressor = functools.partial(_TwoBit, exchange=exchange) if len(sys.argv) > 2 else _TwoBit
hvd.init()
rank = hvd.rank()
t0 = time.time()


def model_opt(compression, **kw):
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return m, hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters(),
                                       compression=compression, **kw)


try:
    if case == "threshold":
        c = TwoBitCompressor(0.5 if rank == 0 else 0.25)
        hvd.allreduce(torch.ones(40), name="x", compression=c)
    elif case == "size":
        hvd.allreduce(torch.ones(40 + 20 * rank), name="x", compression=TwoBitCompressor(0.5))
    elif case == "size_same_words":
        hvd.allreduce(torch.ones(33 + rank), name="x", compression=TwoBitCompressor(0.5))
    elif case == "noname":
        hvd.allreduce(torch.ones(4), compression=TwoBitCompressor(0.5))
    elif case == "auto_vs_fixed":
        c = TwoBitCompressor("auto" if rank == 0 else 0.5)
        hvd.allreduce(torch.ones(40), name="x", compression=c)
    elif case == "buckets":  # another model on one rank: buckets of different tensors
        m = torch.nn.Sequential(torch.nn.Linear(4, 3 + rank), torch.nn.Linear(3 + rank, 2))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters(),
                                       compression=TwoBitCompressor(0.5))
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    elif case == "exchange":  # rank 0 uses the allgather exchange, the others scatter
        c = _TwoBit(0.5, exchange="allgather" if rank == 0 else "scatter")
        hvd.allreduce(torch.ones(40), name="x", compression=c)
    elif case == "exchange_bucket":  # the same in a bucket, where rank 0 is the one that scatters
        m, opt = model_opt(_TwoBit(0.5, exchange="scatter" if rank == 0 else "allgather"))
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    elif case == "auto_exchange":  # "auto" decides from the size: allgather on rank 0 only
        c = _TwoBit(0.5, exchange="auto")
        hvd.allreduce(torch.ones(40 if rank == 0 else 3000), name="x", compression=c)
    elif case == "class":
        hvd.allreduce(torch.ones(4), name="x", compression=_TwoBit)
    elif case == "op":
        hvd.allreduce(torch.ones(4), name="x", op=hvd.Max, compression=TwoBitCompressor(0.5))
    elif case == "adasum":
        model_opt(TwoBitCompressor(0.5), op=hvd.Adasum)
    elif case == "sparse":
        emb = torch.nn.Embedding(10, 4, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(),
                                       compression=TwoBitCompressor(0.5))
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
    elif case == "sparse_as_dense":
        emb = torch.nn.Embedding(10, 4, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(),
                                       compression=TwoBitCompressor(0.5), sparse_as_dense=True)
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
        print("OK rank %d" % rank)
        sys.exit(0)
    else:
        raise SystemExit("unknown case " + case)
    print("NO ERROR rank %d" % rank)
    sys.exit(1)
except (PayloadMismatchError, ValueError, TypeError) as e:
    print("RAISED rank %d after %.1fs: %s: %s" % (rank, time.time() - t0, type(e).__name__, e))
