"""Codec throughput against the machine's own memory bandwidth.

    python -m horovod_twobit.benchmarks.codec [--sizes 1K,64K,1M,16M,64M] [--ranks 2]
        [--device cpu,cuda] [--frameworks torch,tensorflow] [--paths compiled,eager]
    python -m horovod_twobit.benchmarks.codec --owner [--sizes 64K,1M,4M] [--ranks 8]

For each framework, size and device it prints, in GB/s of float32 gradient (4 bytes per value):
- encode: what a rank does before the gather (``quantize_pack``: read g and r, threshold, write
  the packed words),
- decode-sum: what it does after the gather, in one pass (``decode_kernels.finish``): the
  residual update r <- r + g - q, and the decoded sum of ``--ranks`` payloads written over the
  gradient, as ``hvd.DistributedOptimizer``'s in-place allreduce does,
- probe: an in-place ``r.add_(g)`` over the same bytes (read g and r, write r), the memory
  bandwidth a fused pass can hope for,
and each codec figure as a percentage of the probe, for the compiled path (PyTorch: torch.compile;
TensorFlow: XLA) and the eager one (TensorFlow: the same ops in a ``tf.function`` without XLA).
TensorFlow's probe is ``Variable.assign_add`` in a ``tf.function``; its decode-sum writes a new
tensor and assigns the residual, as its communicator does.

The residual update runs after the gather, not in the encode pass, because a step in which any
rank's gradient held NaN or Inf must leave every residual as it was; it shares the decode pass.
Every call writes into memory that already exists: a fresh output tensor of more than 32 MB costs
page faults on every call (glibc returns such blocks to the system), as it does for Horovod's own
out-of-place allreduce.
"""

import argparse
import itertools
import statistics
import time

import torch

from horovod_twobit.torch.codec import compiled, decode_kernels
from horovod_twobit.torch import codec
from horovod_twobit.benchmarks.timing import parse_size, time_round_robin


def measure(n, device, ranks=2, path="compiled", threshold=0.5):
    """Returns a dict of GB/s figures for one size, device and path (PyTorch)."""
    old = compiled.COMPILE_MIN_NUMEL
    compiled.COMPILE_MIN_NUMEL = 0 if path == "compiled" else 1 << 62
    try:
        g = torch.randn(n, device=device)
        r = torch.zeros(n, device=device)
        words, _ = codec.quantize_pack(g, r, threshold)
        rows = [words.clone() for _ in range(ranks)]
        ts = [threshold] * ranks

        t_enc, t_dec, t_probe = time_round_robin(
            [lambda: codec.quantize_pack(g, r, threshold, out=words),  # as the communicator does
             lambda: decode_kernels.finish(rows, ts, r, g, threshold, ranks),
             lambda: r.add_(g)], device)
    finally:
        compiled.COMPILE_MIN_NUMEL = old
    gb = 4 * n / 1e9
    return {"encode": gb / t_enc, "decode": gb / t_dec, "probe": gb / t_probe}


def measure_tf(n, device, ranks=2, path="compiled", threshold=0.5):
    """Returns a dict of GB/s figures for one size, device and path (TensorFlow)."""
    import tensorflow as tf
    from horovod_twobit.tensorflow.codec import kernels as tfk

    old = tfk.COMPILE_MIN_NUMEL
    tfk.COMPILE_MIN_NUMEL = 0 if path == "compiled" else 1 << 62
    try:
        with tf.device("/%s:0" % device.type.upper().replace("CUDA", "GPU")):
            g = tf.random.normal([n])
            r = tf.Variable(tf.zeros([n]))
            a = tf.Variable(tf.zeros([n]))

            def encode():
                return tfk.encode(g, r.read_value(), threshold)[0]

            def finish(rows, ts, bad, count):  # as the communicator does after the gather
                out, new = tfk.finish(rows, ts, bad, count, g, r.read_value(), threshold, True, 1.0)
                r.assign(new)
                return out

            def add():
                a.assign_add(g, read_value=False)

            enc, fin, probe = (tf.function(f, autograph=False) for f in (encode, finish, add))
            rows = tf.stack([enc()] * ranks)
            ts = tf.fill([ranks], tf.constant(threshold, tf.float32))
            bad, count = tf.constant(False), tf.constant(float(ranks))
            # a one-value read waits for the device (eager CPU calls are synchronous anyway)
            times = time_round_robin([lambda: enc()[:1].numpy(),
                                       lambda: fin(rows, ts, bad, count)[:1].numpy(),
                                       lambda: (probe(), a[:1].numpy())], device)
    finally:
        tfk.COMPILE_MIN_NUMEL = old
    gb = 4 * n / 1e9
    return {"encode": gb / times[0], "decode": gb / times[1], "probe": gb / times[2]}


def _tf_gpu():
    import tensorflow as tf
    return bool(tf.config.list_physical_devices("GPU"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1K,64K,1M,16M,64M")
    p.add_argument("--ranks", type=int, help="payloads summed (default 2; with --owner: 8)")
    p.add_argument("--device", default="cpu,cuda")
    p.add_argument("--paths", default="compiled,eager")
    p.add_argument("--frameworks", default="torch,tensorflow")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--owner", action="store_true",
                   help="instead: the scatter exchange's owner encode, 3-bit against 2-bit "
                        "(horovod_twobit.benchmarks.owner_encode; --ranks default 8)")
    args = p.parse_args(argv)
    if args.owner:
        from horovod_twobit.benchmarks.owner_encode import table
        return table(args.sizes.split(","), args.ranks or 8)
    args.ranks = args.ranks or 2
    devices = [torch.device(d) for d in args.device.split(",")
               if d != "cuda" or torch.cuda.is_available()]
    rows = []
    header = ("| framework | device | values | path | encode GB/s | decode-sum GB/s | probe GB/s "
              "| encode / probe | decode-sum / probe |")
    print(header)
    print("|" + "---|" * 9)
    for fw, dev, size, path in itertools.product(args.frameworks.split(","), devices,
                                                 args.sizes.split(","), args.paths.split(",")):
        if fw == "tensorflow" and dev.type == "cuda" and not _tf_gpu():
            continue
        m = (measure if fw == "torch" else measure_tf)(parse_size(size), dev, args.ranks, path)
        line = "| %s | %s | %s | %s | %.3g | %.3g | %.3g | %.0f %% | %.0f %% |" % (
            fw, dev.type, size.strip(), path, m["encode"], m["decode"], m["probe"],
            100 * m["encode"] / m["probe"], 100 * m["decode"] / m["probe"])
        print(line, flush=True)
        rows.append(line)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join([header, "|" + "---|" * 9] + rows) + "\n")


if __name__ == "__main__":
    main()
