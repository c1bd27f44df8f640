"""Allreduce and allgather give the right values on every rank, in PyTorch or TensorFlow."""

import sys

framework = sys.argv[1]
if framework == "torch":
    import torch
    import horovod.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    s = hvd.allreduce(torch.full((5,), float(r + 1)), name="s", op=hvd.Sum)
    g = hvd.allgather(torch.full((r + 1, 2), float(r)), name="g")
    ok = s.tolist() == [n * (n + 1) / 2] * 5 and g[:, 0].tolist() == [float(i) for i in range(n) for _ in range(i + 1)]
else:
    import tensorflow as tf
    import horovod.tensorflow as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    s = hvd.allreduce(tf.fill([5], float(r + 1)), name="s", op=hvd.Sum)
    g = hvd.allgather(tf.fill([r + 1, 2], float(r)), name="g")
    ok = s.numpy().tolist() == [n * (n + 1) / 2] * 5 and g.numpy()[:, 0].tolist() == [float(i) for i in range(n) for _ in range(i + 1)]
print("rank %d of %d %s: %s" % (r, n, framework, "OK" if ok else "WRONG %s %s" % (s, g)))
