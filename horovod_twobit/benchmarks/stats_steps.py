"""What reading ``compressor.stats()`` after every step adds to the step, measured more closely
than the difference of two benchmark medians: four instances of the same model, optimizer and
compressor take turns, step by step, for ``--rounds`` rounds; ``never`` and ``never2`` are never
read, ``every`` is read after each of its steps (the read inside its timed step), ``once`` was
read once before the timing (so its steps do what a first read turns on) and is then only
stepped. Run with two ranks::

    horovodrun -np 2 -H localhost:2 python -m horovod_twobit.benchmarks.stats_steps \\
        --framework torch --threshold 0.01 --rounds 300

It prints, on rank 0, each instance's median step (ms, the slower rank's) and the differences
of ``every`` and ``once`` to the two never-read instances: the whole cost of reading every step,
and the step's own share of it."""

import argparse
import statistics
import time

INSTANCES = ("never", "every", "once", "never2")


def _torch(model, threshold, batch, name):
    import torch
    import horovod.torch as hvd
    from horovod_twobit.benchmarks.models import torch_model
    from horovod_twobit.torch import TwoBitCompressor
    net, data, classes = torch_model(model)
    comp = TwoBitCompressor(threshold)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.01), compression=comp,
        named_parameters=[(name + "." + n, p) for n, p in net.named_parameters()])
    x, y = data(batch), torch.randint(0, classes, (batch,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return step, comp


def _tf(model, threshold, batch, name):
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from horovod_twobit.benchmarks.models import tf_model
    from horovod_twobit.tensorflow import TwoBitCompressor
    net, data = tf_model(model)
    comp = TwoBitCompressor(threshold)
    x, y = data(batch), tf.random.uniform((batch,), 0, 10, tf.int32)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(0.01)

    @tf.function
    def step_fn():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=comp, sparse_as_dense=True)
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))
        return loss
    return (lambda: step_fn().numpy()), comp


def measure(steps, rounds, warmup=5):
    """{instance: step durations}: ``steps`` {instance: (step, compressor)} take turns, the
    starting instance rotating each round; ``every``'s step includes its read."""
    for step, _ in steps.values():
        for _ in range(warmup):
            step()
    for k in ("every", "once"):
        steps[k][1].stats()
    times, order = {k: [] for k in steps}, list(steps)
    for rnd in range(rounds):
        for k in order[rnd % len(order):] + order[:rnd % len(order)]:
            step, comp = steps[k]
            t0 = time.perf_counter()
            step()
            if k == "every":
                comp.stats()
            times[k].append(time.perf_counter() - t0)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--framework", choices=("torch", "tensorflow"), default="torch")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--threshold", default="0.01")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args(argv)
    threshold = args.threshold if args.threshold == "auto" else float(args.threshold)
    if args.framework == "torch":
        import torch
        import horovod.torch as hvd
        torch.set_num_threads(1)
        make = _torch
    else:
        import tensorflow as tf
        import horovod.tensorflow as hvd
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        make = _tf
    hvd.init()
    steps = {k: make(args.model, threshold, args.batch, k) for k in INSTANCES}
    times = measure(steps, args.rounds)
    per_rank = {k: hvd.allgather_object(statistics.median(t)) for k, t in times.items()}
    med = {k: max(v) for k, v in per_rank.items()}
    if hvd.rank() == 0:
        print("%s %s, threshold %s, %d rounds: median step (ms) %s" % (
            args.framework, args.model, args.threshold, args.rounds,
            ", ".join("%s %.2f" % (k, 1e3 * v) for k, v in med.items())))
        print("  per rank: %s" % ", ".join(
            "%s %s" % (k, "/".join("%.2f" % (1e3 * x) for x in v)) for k, v in per_rank.items()))
        for k in ("every", "once"):
            print("  %s: %+.2f / %+.2f ms against never / never2" % (
                k, 1e3 * (med[k] - med["never"]), 1e3 * (med[k] - med["never2"])))
    return med


if __name__ == "__main__":
    main()
