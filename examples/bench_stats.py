"""What reading ``compressor.stats()`` after every step adds to the step, measured more closely
than the difference of two medians of ``bench_buckets --read-stats``: four instances of the same
model, optimizer and compressor take turns of ``--turn`` steps in a row, in an order drawn each
round, for ``--rounds`` rounds, in four roles. ``never`` and ``never2`` are never read (their
difference is the noise); ``every`` is read after each of its steps (the read inside its timed
step; within a turn, what a read leaves to the next step falls on its own next step, as in a
training loop); ``once`` was read after two steps in a row before the timing, as reads that come
every step are, and is then only stepped: its steps do what such reads turn on (in TensorFlow
the norms), without the reads. The roles rotate among the instances in ``--blocks`` blocks of
rounds, so that one instance's steps being slower than another's is not taken for a role's
cost. Run with two ranks and Gloo, as ``bench_buckets`` runs its jobs::

    horovodrun -np 2 -H localhost:2 --gloo python -m examples.bench_stats --framework torch \\
        --method twobit --rounds 300

On localhost the network is free: the figures are bounded by the CPU the ranks share. With
Open MPI instead, Horovod's background thread polls inside its collectives, taking CPU from the
ranks' own threads on a machine with no core to spare (here 2 ranks on 2 cores: the same MLP
step 10.1-10.8 ms against 6.4-6.9 ms with Gloo, or with ``OMPI_MCA_mpi_yield_when_idle=1``), and
every microsecond of a rank's own work then costs several in the step. Rank 0
prints each role's median step (ms, the slower rank's) and the differences of ``every``,
``once`` and ``never2`` to the two never-read roles, as differences of medians and paired (turn
by turn, :func:`differences`): the whole cost of reading every step, the step's own share of it,
and the noise; then the same for the CPU time per step (each process's, all its
threads, summed over the ranks): the work a read adds, whatever the scheduling of the ranks on
the shared cores. Models and methods are those of :mod:`examples.bench_buckets`
(``twobit``: a threshold of 0.01; ``auto``); TensorFlow trains with ``DistributedGradientTape``."""

import argparse
import os
import random
import statistics
import time

from examples.bench_buckets import ONE_RANK, tf_step, torch_step

INSTANCES = ("never", "every", "once", "never2")


def settle(step, comp, watched):
    """Turns ``comp``'s watch on (two reads a step apart: reads that come every step) or off (a
    read after three unread steps)."""
    if watched:
        comp.stats()
        step()
        comp.stats()
    else:
        for _ in range(3):
            step()
        comp.stats()


def measure(steps, rounds, warmup=5, cpu=None, blocks=4, seed=0, turn=1):
    """{role: step durations}: ``steps`` {instance: (step, compressor)}, one instance per role of
    :data:`INSTANCES`, take turns of ``turn`` steps in a row, in an order drawn each round
    (``seed``: the same on every rank), so that no role always follows another; within a turn
    what a read leaves to the next step (the other rank's read, caches) falls on its own role's
    next step, as in a training loop that reads after every step. The roles rotate among the
    instances in ``blocks`` blocks of rounds (with 4 blocks each instance plays each role once),
    so that whatever makes one instance's steps slower than another's for the same work (two
    never-read instances differed by up to 0.4 ms of the MLP's 12 ms step) falls on every role
    alike.
    Before each block each instance is settled into its role: ``every`` and ``once`` read after
    two steps in a row (reads every step: the watch on), ``never`` and ``never2`` read after three
    unread steps (the watch off). ``every``'s timed step includes its read. ``cpu``: a dict that
    gets {role: the process's CPU time (all its threads) per step} likewise."""
    for step, _ in steps.values():
        for _ in range(warmup):
            step()
    names, blocks = list(steps), max(1, min(blocks, rounds))
    order = random.Random(seed)  # the same on every rank: the ranks step the same instance
    times, cpu_times = {k: [] for k in INSTANCES}, {k: [] for k in INSTANCES}
    for b in range(blocks):
        role = {names[(j + b) % len(names)]: r for j, r in enumerate(INSTANCES)}
        for k in names:
            settle(*steps[k], watched=role[k] in ("every", "once"))
        for rnd in range(b * rounds // blocks, (b + 1) * rounds // blocks):
            for k in order.sample(names, len(names)):
                step, comp = steps[k]
                for _ in range(turn):
                    c0, t0 = time.process_time(), time.perf_counter()
                    step()
                    if role[k] == "every":
                        comp.stats()
                    times[role[k]].append(time.perf_counter() - t0)
                    cpu_times[role[k]].append(time.process_time() - c0)
    if cpu is not None:
        cpu.update(cpu_times)
    return times


def loop(step, comp, rounds, block=8, pause=0.0):
    """A training loop's view: one instance, ``rounds`` pairs of blocks of ``block`` steps, one
    block read after every step (the watch on), the other unread (the watch off), in turns,
    each block settled first as :func:`measure` settles the roles. ``pause`` (seconds): a busy
    wait after each step of the read blocks instead of the read (what any pause between steps
    costs). Returns (the unread blocks' steps, the read blocks' steps, the reads' or pauses'
    durations), per step."""
    out, spent = {True: [], False: []}, []
    for rnd in range(rounds):
        for read in ((True, False) if rnd % 2 else (False, True)):
            settle(step, comp, watched=read)
            step()
            if read and not pause:
                comp.stats()
            t0 = time.perf_counter()
            for _ in range(block):
                step()
                if read:
                    t1 = time.perf_counter()
                    if pause:
                        while time.perf_counter() - t1 < pause:
                            pass
                    else:
                        comp.stats()
                    spent.append(time.perf_counter() - t1)
            out[read].append((time.perf_counter() - t0) / block)
    return out[False], out[True], spent


def differences(per, role, group=1):
    """``role``'s step (``per``: {role: step durations, round by round}) against ``never`` and
    ``never2``: the differences of the medians, then paired: the median over groups of ``group``
    steps (a round's turn) of the difference of the two roles' mean steps in the group, so that
    what drifts over a run (the other rank, the machine) falls out."""
    def means(xs):
        return [statistics.fmean(xs[i:i + group]) for i in range(0, len(xs) - group + 1, group)]
    out = [statistics.median(per[role]) - statistics.median(per[k]) for k in ("never", "never2")]
    return out + [statistics.median([a - b for a, b in zip(means(per[role]), means(per[k]))])
                  for k in ("never", "never2")]


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
    ap.add_argument("--turn", type=int, default=4, help="steps of an instance in a row")
    ap.add_argument("--loop", action="store_true",
                    help="time one instance's blocks of 8 steps, read after each step or not "
                         "(loop), instead of the four roles")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="with --loop: a busy wait of this many seconds instead of each read")
    ap.add_argument("--blocks", type=int, default=4,
                    help="blocks of rounds between which the roles rotate (4: each instance "
                         "plays each role once)")
    args = ap.parse_args(argv)
    hvd, build = _builder(args)
    hvd.init()
    if hvd.size() < 2:
        raise SystemExit("bench_stats " + ONE_RANK + " (run it under horovodrun -np 2)")
    if args.loop:
        step, _, comp = build()
        for _ in range(5):
            step()
        unread, read, spent = loop(step, comp, args.rounds, pause=args.pause)
        pairs = [a - b for a, b in zip(read, unread)]
        got = hvd.allgather_object((statistics.median(unread), statistics.median(pairs),
                                    statistics.fmean(pairs), statistics.median(spent)))
        if hvd.rank() == 0:
            for r, g in enumerate(got):
                print("rank %d: step %.2f ms; read after every step (%s): %+.3f ms a step "
                      "(median of block pairs; mean %+.3f), the %s itself %.3f ms" % (
                          r, 1e3 * g[0], args.method, 1e3 * g[1], 1e3 * g[2],
                          "pause" if args.pause else "read", 1e3 * g[3]), flush=True)
        return got
    steps = {}
    for i in range(len(INSTANCES)):
        step, _, comp = build()
        steps[i] = (step, comp)
    cpu = {}
    times = measure(steps, args.rounds, cpu=cpu, blocks=args.blocks, turn=args.turn)
    # a step ends when the slower rank's does; CPU time per step (the process's, all threads)
    # is summed over the ranks: what a read adds to the work, whatever the scheduling of the
    # ranks on the shared cores
    ranks = hvd.allgather_object((times, cpu))
    wall = {k: [max(r[0][k][i] for r in ranks) for i in range(len(times[k]))] for k in times}
    work = {k: [sum(r[1][k][i] for r in ranks) for i in range(len(cpu[k]))] for k in cpu}
    med = {k: statistics.median(t) for k, t in wall.items()}
    if hvd.rank() == 0:
        print("%s %s, %s, %d rounds in %d blocks, %d ranks on localhost sharing %d cores (no "
              "network: bound by the CPU): median step (ms) %s" % (
                  args.framework, args.model, args.method, args.rounds, args.blocks, hvd.size(),
                  os.cpu_count(), ", ".join("%s %.2f" % (k, 1e3 * v) for k, v in med.items())),
              flush=True)
        for what, per in (("", wall), (" CPU", work)):
            if what:
                print("  CPU per step, both ranks (ms): %s" % ", ".join(
                    "%s %.2f" % (k, 1e3 * statistics.median(t)) for k, t in per.items()),
                    flush=True)
            for k in ("every", "once", "never2"):
                diffs = tuple(1e3 * x for x in differences(per, k, args.turn))
                print("  %s%s: %+.2f / %+.2f ms against never / never2 (medians), paired %+.2f / "
                      "%+.2f ms" % ((k, what) + diffs), flush=True)
    return med


if __name__ == "__main__":
    main()
