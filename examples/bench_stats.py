"""What reading ``compressor.stats()`` after every step adds to the step, measured more closely
than the difference of two medians of ``bench_buckets --read-stats``: four instances of the same
model, optimizer and compressor take turns, step by step, for ``--rounds`` rounds. ``never`` and
``never2`` are never read (their difference is the noise between instances); ``every`` is read
after each of its steps (the read inside its timed step); ``once`` was read after two steps in a
row before the timing, as reads that come every step are, and is then only stepped: its steps do
what such reads turn on (in TensorFlow the steps' handover), without the reads. Run with two
ranks and Gloo, as ``bench_buckets`` runs its jobs::

    horovodrun -np 2 -H localhost:2 --gloo python -m examples.bench_stats --framework torch \\
        --method twobit --rounds 300

On localhost the network is free: the figures are bounded by the CPU the ranks share. With
Open MPI instead, Horovod's background thread polls inside its collectives, taking CPU from the
ranks' own threads on a machine with no core to spare (here 2 ranks on 2 cores: the same MLP
step 10.1-10.8 ms against 6.4-6.9 ms with Gloo, or with ``OMPI_MCA_mpi_yield_when_idle=1``), and
every microsecond of a rank's own work then costs several in the step. Rank 0
prints each instance's median step (ms, the slower rank's) and the differences of
``every`` and ``once`` to the two never-read instances: the whole cost of reading every step, and
the step's own share of it; then the same for the CPU time per step (each process's, all its
threads, summed over the ranks): the work a read adds, whatever the scheduling of the ranks on
the shared cores. Models and methods are those of :mod:`examples.bench_buckets`
(``twobit``: a threshold of 0.01; ``auto``); TensorFlow trains with ``DistributedGradientTape``."""

import argparse
import os
import statistics
import time

from examples.bench_buckets import ONE_RANK, tf_step, torch_step

INSTANCES = ("never", "every", "once", "never2")


def measure(steps, rounds, warmup=5, cpu=None):
    """{instance: step durations}: ``steps`` {instance: (step, compressor)} take turns, the
    starting instance rotating each round; ``every``'s step includes its read. ``cpu``: a dict
    that gets {instance: the process's CPU time (all its threads) per step} likewise."""
    for step, _ in steps.values():
        for _ in range(warmup):
            step()
    for k in ("every", "once"):  # two reads a step apart: reads that come every step
        steps[k][1].stats()
        steps[k][0]()
        steps[k][1].stats()
    times, order = {k: [] for k in steps}, list(steps)
    cpu_times = {k: [] for k in steps}
    for rnd in range(rounds):
        for k in order[rnd % len(order):] + order[:rnd % len(order)]:
            step, comp = steps[k]
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            if k == "every":
                comp.stats()
            times[k].append(time.perf_counter() - t0)
            cpu_times[k].append(time.process_time() - c0)
    if cpu is not None:
        cpu.update(cpu_times)
    return times


def _builder(args):
    if args.framework == "torch":
        import torch
        import horovod.torch as hvd
        from horovod_twobit.torch import TwoBitCompressor
        torch.set_num_threads(args.threads)
        return hvd, lambda: torch_step(args.model, args.method, args, torch, hvd, TwoBitCompressor)
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    from horovod_twobit.tensorflow import TwoBitCompressor
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    return hvd, lambda: tf_step(args.model, "tape", args.method, args, tf, hvd, hvd_keras,
                                TwoBitCompressor)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--framework", choices=("torch", "tensorflow"), default="torch")
    ap.add_argument("--model", default="mlp", help="mlp, cnn or transformer")
    ap.add_argument("--method", default="twobit", help="twobit or auto (bench_buckets' methods)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    hvd, build = _builder(args)
    hvd.init()
    if hvd.size() < 2:
        raise SystemExit("bench_stats " + ONE_RANK + " (run it under horovodrun -np 2)")
    steps = {}
    for k in INSTANCES:
        step, _, comp = build()
        steps[k] = (step, comp)
    cpu = {}
    times = measure(steps, args.rounds, cpu=cpu)
    per_rank = {k: hvd.allgather_object(statistics.median(t)) for k, t in times.items()}
    med = {k: max(v) for k, v in per_rank.items()}
    # CPU time per step (the process's, all threads), summed over the ranks: what a read adds
    # to the work, whatever the scheduling of the ranks on the shared cores
    cpu_med = {k: sum(hvd.allgather_object(statistics.median(t))) for k, t in cpu.items()}
    if hvd.rank() == 0:
        print("%s %s, %s, %d rounds, %d ranks on localhost sharing %d cores (no network: bound "
              "by the CPU): median step (ms) %s" % (
                  args.framework, args.model, args.method, args.rounds, hvd.size(),
                  os.cpu_count(), ", ".join("%s %.2f" % (k, 1e3 * v) for k, v in med.items())),
              flush=True)
        for k in ("every", "once"):
            print("  %s: %+.2f / %+.2f ms against never / never2" % (
                k, 1e3 * (med[k] - med["never"]), 1e3 * (med[k] - med["never2"])), flush=True)
        print("  CPU per step, both ranks (ms): %s" % ", ".join(
            "%s %.2f" % (k, 1e3 * v) for k, v in cpu_med.items()), flush=True)
        for k in ("every", "once"):
            print("  %s CPU: %+.2f / %+.2f ms against never / never2" % (
                k, 1e3 * (cpu_med[k] - cpu_med["never"]), 1e3 * (cpu_med[k] - cpu_med["never2"])),
                flush=True)
    return med


if __name__ == "__main__":
    main()
