"""TensorFlow codec cost of one bucket, without Horovod or communication: the small Keras MLP's
52 gradients (``examples/bench_buckets.py --models mlp``) through one ``BucketExchange`` in a
``tf.function``, N ranks' payloads simulated by this rank's payload N times.

    python -m horovod_twobit.benchmarks.tf_passes --thresholds 0.01,auto

Prints, per threshold, the median time of a ``tf.function`` that returns the 52 tensors
unchanged (the call's own cost), of the encode alone, and of the encode and the finish; with
``HOROVOD_TWOBIT_COMPILE=0`` the same without XLA.
"""

import argparse
import os
import statistics
import time

# the small MLP's parameter shapes: 25 Dense layers of 128 units on 128 inputs, a 10-way output
MLP_SHAPES = [(128, 128), (128,)] * 25 + [(128, 10), (10,)]


def timed(fn, args, repeat, clock=time.perf_counter):
    fn(args)  # trace (and compile)
    times = []
    for _ in range(repeat):
        t = clock()
        out = fn(args)
        (out[0] if isinstance(out, (list, tuple)) else out).numpy()
        times.append(clock() - t)
    return 1e3 * statistics.median(times)


def measure(threshold, nranks=2, repeat=200, shapes=MLP_SHAPES, clock=time.perf_counter):
    """{"call": ms, "encode": ms, "encode+finish": ms} for one bucket of ``shapes``."""
    import tensorflow as tf
    import horovod.tensorflow.mpi_ops as mpi_ops
    from horovod_twobit.tensorflow import TwoBitCompressor
    from horovod_twobit.tensorflow.exchange.bucket import BucketExchange
    gs = [tf.random.normal(s) * 0.01 for s in shapes]
    keys = ["v%d" % i for i in range(len(shapes))]
    comp = TwoBitCompressor(threshold)

    def exchange(gs):
        return BucketExchange(comp, gs, keys, mpi_ops.Average, 1.0, 1.0, nranks)

    def both(gs):
        ex = exchange(gs)
        return ex.finish(tf.concat([ex.payload] * nranks, 0))

    fns = {"call": lambda gs: [tf.identity(g) for g in gs],
           "encode": lambda gs: exchange(gs).payload, "encode+finish": both}
    return {name: timed(tf.function(fn, autograph=False), gs, repeat, clock) for name, fn in fns.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thresholds", default="0.01,auto")
    ap.add_argument("--np", type=int, default=2, help="ranks simulated")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time per call (steadier on a shared machine)")
    args = ap.parse_args(argv)
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    xla = os.environ.get("HOROVOD_TWOBIT_COMPILE", "1") != "0"
    print("| threshold | XLA | call | encode | encode + finish |\n|---|---|---|---|---|")
    for t in args.thresholds.split(","):
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        got = measure(t if t == "auto" else float(t), args.np, args.repeat, clock=clock)
        print("| %s | %s | %.2f ms | %.2f ms | %.2f ms |" % (
            t, "yes" if xla else "no", got["call"], got["encode"], got["encode+finish"]),
            flush=True)


if __name__ == "__main__":
    main()
