"""Step time on models with many small tensors, on localhost (the network is free): what TwoBit's
per-call cost adds to a step, with and without buckets.

Models (both frameworks):
  cnn          a ResNet-style CNN: a stem and 8 residual blocks of two 3x3 convolutions with
               BatchNorm, 32 channels, 16x16 inputs (53 parameter tensors in PyTorch)
  transformer  a transformer encoder: 8 layers, d_model 64, 4 heads, LayerNorms and biases
               (99 parameter tensors in PyTorch)
  mlp          a small MLP: 128 inputs, 25 hidden Dense / Linear layers of 128 units with ReLU and
               a 10-way output layer (52 parameter tensors, 0.42 M parameters); use ``--batch 64``
               for a step of a few milliseconds, where a fixed per-step cost shows most
Methods: none, fp16 (Horovod's Compression.fp16), twobit (TwoBitCompressor(0.01)) and auto
(TwoBitCompressor("auto")), the last two bucketed (the default) and alone (bucket_bytes=0);
``twobit/SIZE`` and ``auto/SIZE`` (e.g. ``twobit/256K``, ``auto/16M``) set bucket_bytes;
``twobit_fallback`` and ``auto_fallback`` (also with ``/SIZE``) add ``fallback="auto"``,
``twobit_always`` ``fallback="always"`` (every bucket plain: the plain exchange's own cost).
A method followed by ``#TAG`` (``none#2``) is another instance of the same method, with its own
model and names: the difference between the two is the bench's own spread (an A/A pair). A
table gives each fallback method's step over the faster of no compression and its twin, and
that faster method's copy's step over it where the run has one: what always picking the
faster would get in the same run.
``--instances K`` builds every method K times (each with its own model, names and, with a
fallback, its own check) and pools their steps: on 2 shared cores two instances of one method
differed by up to 11 % within a run, more than most differences between methods.
``--read-stats`` adds to each of these a ``+stats`` twin that reads ``compressor.stats()`` after
every step, and a table of what that costs (:mod:`horovod_twobit.benchmarks.stats_cost`).

    .venv/bin/python -m examples.bench_buckets --frameworks torch,tensorflow

starts ``horovodrun -np 2`` per framework and prints a table of median step times (ms) with the
ratio to no compression. Each rank uses one thread (``--threads``). TensorFlow trains in a
``tf.function`` with ``hvd.DistributedGradientTape`` (``--tf-loops tape``, the default; ``anew``:
the same through ``horovod_twobit.tensorflow.fallback_function``, traced anew once
``fallback="auto"`` decided), or with
``horovod.tensorflow.keras.DistributedOptimizer`` in the train function ``model.fit`` runs for each
batch (``--tf-loops fit``; its rows say ``(fit)``), or both (``--tf-loops tape,fit``).

Every method of a model is built first, then the methods take turns: ``--rounds`` rounds of
``--steps`` timed steps each (after ``--warmup`` untimed steps per method), so that a change in
the machine's load during the run falls on every method alike rather than on whichever ran then.
The default, 30 rounds of one step, pairs the methods most closely: on 2 shared cores, blocks of
5 steps left fp16 (which does almost nothing here) anywhere between 0.81x and 1.19x of no
compression, single steps within 0.98-1.03x. ``--settle K`` runs K untimed steps of a method
before its timed ones in each round, so that no timed step follows another method's, as in a
job of one model (6 timed steps after 2 untimed did not narrow the spread on 2 shared cores).
The figure is the median over all timed steps of the slower rank.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

from horovod_twobit.benchmarks import stats_cost
from horovod_twobit.benchmarks.models import tf_model, torch_model

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
METHODS = ["none", "fp16", "twobit", "twobit/alone", "auto", "auto/alone"]
# Horovod's optimizers and DistributedGradientTape leave the gradients alone on one rank (no
# allreduce at all), so with one rank no compressor runs and every method times the same step
ONE_RANK = ("needs 2 ranks or more: on one rank Horovod's DistributedOptimizer and "
            "DistributedGradientTape skip the allreduce, so no compressor would run")


def compression(method, hvd, twobit):
    method = method.split("#")[0].split("@")[0]  # another instance of the same method
    if method == "none":
        return hvd.Compression.none
    if method == "fp16":
        return hvd.Compression.fp16
    kind, _, size = method.partition("/")
    fallback = ("auto" if kind.endswith("_fallback") else "always" if kind.endswith("_always")
                else None)
    kind = kind.split("_fallback")[0].split("_always")[0]
    if kind not in ("twobit", "auto"):
        raise ValueError("unknown method %r" % method)
    return twobit(0.01 if kind == "twobit" else "auto", bucket_bytes=bucket_bytes(size),
                  fallback=fallback)


def bucket_bytes(size):
    """None (the default) for "", 0 for "alone", else SIZE with an optional K or M suffix."""
    if not size:
        return None
    if size == "alone":
        return 0
    mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1].upper(), 1)
    return int(size[:-1] if mult > 1 else size) * mult


def interleaved(steps_of, args, comps=None):
    """Runs the methods' step functions in turns (see the module docstring); returns each
    method's list of timed step durations, and of its untimed first steps: ``--warmup``, or
    where a method has ``fallback="auto"`` as many as its checked decision takes and one more
    (at most ``fallback.start_steps()``; until ``comps[method].stats()`` shows it decided, the
    same step on every rank), and the others as many as the most of those, so that each has
    the same start."""
    checked = [m for m in steps_of if "_fallback" in m]
    first = args.warmup
    if checked:
        from horovod_twobit.state import fallback
        first = max(first, fallback.start_steps())
    starts = {}

    def warm(m, most, until_decided):
        starts[m] = []
        decided = None  # the steps run when the stats first showed the check decided
        while len(starts[m]) < most:
            if until_decided and decided is None and comps[m].stats().get("fallback_checks"):
                decided = len(starts[m])
            # one step more than the check took: a fit loop traces anew after it (as
            # TwoBitFallbackCallback does), at the step after the decision
            if decided is not None and len(starts[m]) >= max(args.warmup, decided + 1):
                break
            t0 = time.perf_counter()
            steps_of[m]()
            starts[m].append(time.perf_counter() - t0)
    for m in checked:
        warm(m, first, comps is not None and m in comps)  # (not a ``+stats`` twin)
    first = max([args.warmup] + [len(starts[m]) for m in checked])
    for m in steps_of:
        if m not in checked:
            warm(m, first, False)
    times = {m: [] for m in steps_of}
    order = list(steps_of)
    for rnd in range(args.rounds):
        for m in order[rnd % len(order):] + order[:rnd % len(order)]:
            fn = steps_of[m]
            for _ in range(getattr(args, "settle", 0)):  # untimed: the switch from the last
                fn()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                fn()
                times[m].append(time.perf_counter() - t0)
    return times, starts


def timed(hvd, steps_of, counts, build, args, row, out, read_out, fit=False, start_out=None,
          comps=None):
    """Times the methods of one row in turns (with their ``+stats`` twins under
    ``--read-stats``, each made by ``build(method)`` -> (step, tensors, compressor)) into ``out``:
    {(row, method): (median step, tensors)}, ``read_out``: {(row, twin): median stats()
    read}, and ``start_out``: {(row, method): (first steps, their seconds beyond as many
    steady steps)}, the slower rank's."""
    reads = stats_cost.add_reads(steps_of, counts, build, fit) if args.read_stats else {}
    times, starts = interleaved(steps_of, args, comps)
    pooled, extras = {}, {}  # a method's instances (``--instances``) pooled
    for inst, t in times.items():
        method = inst.split("@")[0]
        pooled.setdefault(method, []).extend(t)
        out[(row, method)] = (None, counts[inst])
        if start_out is not None and starts[inst]:
            extra = sum(starts[inst]) - len(starts[inst]) * statistics.median(t)
            extras.setdefault(method, []).append((len(starts[inst]), extra))
    for method, t in pooled.items():
        out[(row, method)] = (_median_across(hvd, t), out[(row, method)][1])
    for method, got in extras.items():
        extra = statistics.mean(e for _, e in got)
        start_out[(row, method)] = ("/".join(str(n) for n, _ in got),  # per instance
                                    float(max(hvd.allgather_object(extra))))
    for twin, d in stats_cost.timed_reads(reads, times).items():
        read_out[(row, twin)] = _median_across(hvd, d)


def kept(comps, row, starts):
    """Adds to ``starts`` what each fallback method's check kept, and its modes' figures (per
    instance, ``--instances``)."""
    said = {}
    for inst, comp in comps.items():
        method = inst.split("@")[0]
        checks = comp.stats().get("fallback_checks") if "_fallback" in method else None
        if checks and (row, method) in starts:
            said.setdefault(method, []).extend(
                "%s (%s)" % (c["kept"], ", ".join("%s %.1f ms" % kv
                                                   for kv in c["median_span_ms"].items()))
                for c in checks)
    for method, got in said.items():
        starts[(row, method)] += ("; ".join(got),)


def instances(args):
    """The methods' instances to build: each method, or ``--instances`` K of it (METHOD@k)."""
    methods = args.methods.split(",")
    if args.instances <= 1:
        return methods
    return ["%s@%d" % (m, k) for m in methods for k in range(1, args.instances + 1)]


def twin_of(method):
    """The method a fallback method (``twobit_fallback/256K``) is checked against: the same
    without the fallback (``twobit/256K``)."""
    return method.replace("_fallback", "")


def start_table(starts):
    """What the fallback's start (the link's measurement, the checked decision's schedule)
    costs: each fallback method's first steps beyond as many steady steps, less its twin's."""
    lines = ["| model, method | first steps | beyond as many steady steps (s) | "
             "the same without the fallback (s) | the fallback's start (s) | kept (the check's "
             "figures) |", "|---|---|---|---|---|---|"]
    for (row, method), got in sorted(starts.items()):
        n, extra = got[:2]
        twin = starts.get((row, twin_of(method)))
        if "_fallback" not in method or twin is None:
            continue
        lines.append("| %s, %s | %s | %.2f | %.2f | %.2f | %s |"
                     % (row, method, n, extra, twin[1], extra - twin[1],
                        got[2] if len(got) > 2 else "model (not checked)"))
    return "\n".join(lines) if len(lines) > 2 else ""


def fallback_table(results):
    """Each fallback method's step over the faster of no compression and its twin (the same
    method without the fallback), and, where the run has a copy of that faster method
    (``none#2``, ``twobit#2``...), the copy's step over it: what a fallback that always picked
    the faster method would get in the same run, the bound's fair yardstick (the faster of
    two noisy medians is biased low)."""
    lines = ["| model | method | over the faster | the faster | its copy over it |",
             "|---|---|---|---|---|"]
    for (row, method), got in sorted(results.items(), key=lambda kv: kv[0]):
        t = got[0]  # (with --profile a value has more items)
        if "_fallback" not in method or "#" in method:
            continue
        pair = [m for m in ("none", twin_of(method)) if (row, m) in results]
        if len(pair) < 2:
            continue
        faster = min(pair, key=lambda m: results[(row, m)][0])
        best = results[(row, faster)][0]
        copies = sorted(m for r, m in results if r == row and m.startswith(faster + "#"))
        copy = ("%.2fx (%s)" % (results[(row, copies[0])][0] / best, copies[0]) if copies
                else "")
        lines.append("| %s | %s | %.2fx | %s | %s |" % (row, method, t / best, faster, copy))
    return "\n".join(lines) if len(lines) > 2 else ""


def run_torch(args):
    import torch
    import horovod.torch as hvd
    from horovod_twobit.torch import TwoBitCompressor
    torch.set_num_threads(args.threads)
    hvd.init()
    out, reads, starts = {}, {}, {}
    for model_name in args.models.split(","):
        def build(method, model_name=model_name):
            return torch_step(model_name, method, args, torch, hvd, TwoBitCompressor)
        steps_of, counts, comps = {}, {}, {}
        for method in instances(args):
            steps_of[method], counts[method], comps[method] = build(method)
        timed(hvd, steps_of, counts, build, args, model_name, out, reads, start_out=starts,
              comps=comps)
        kept(comps, model_name, starts)
    return out, reads, starts, hvd.rank()


def torch_step(model_name, method, args, torch, hvd, TwoBitCompressor):
    """(a function that runs one synchronous training step, the number of parameter tensors, the
    compression); the parameters are named after ``method``, so instances do not share names."""
    net, data, classes = torch_model(model_name)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    comp = compression(method, hvd, TwoBitCompressor)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.01),
        named_parameters=[(method + "." + n, p) for n, p in net.named_parameters()],
        compression=comp)
    torch.manual_seed(hvd.rank())
    x, y = data(args.batch), torch.randint(0, classes, (args.batch,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return step, len(list(net.parameters())), comp


def run_tf(args):
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    from horovod_twobit.benchmarks import tf_profile
    from horovod_twobit.tensorflow import TwoBitCompressor
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    hvd.init()
    out, reads, starts = {}, {}, {}
    for model_name in args.models.split(","):
        for loop in args.tf_loops.split(","):
            if loop not in ("tape", "anew", "fit"):
                raise ValueError("unknown TensorFlow loop %r (tape, anew or fit)" % loop)
            row = model_name if loop == "tape" else "%s (%s)" % (model_name, loop)
            def build(method, model_name=model_name, loop=loop):
                return tf_step(model_name, loop, method, args, tf, hvd, hvd_keras,
                               TwoBitCompressor)
            steps_of, counts, comps = {}, {}, {}
            for method in instances(args):
                steps_of[method], counts[method], comps[method] = build(method)
            timed(hvd, steps_of, counts, build, args, row, out, reads, fit=loop == "fit",
                  start_out=starts, comps=comps)
            kept(comps, row, starts)
            if args.profile:
                for method, fn in steps_of.items():
                    base, _, k = method.partition("@")  # with --instances: the first of each
                    if k in ("", "1"):
                        out[(row, base)] += (tf_profile.profile(fn, args.profile),)
    return out, reads, starts, hvd.rank()


def tf_step(model_name, loop, method, args, tf, hvd, hvd_keras, TwoBitCompressor):
    """(a function that runs one synchronous training step, the number of trainable tensors,
    the compression)."""
    net, data = tf_model(model_name)
    comp = compression(method, hvd, TwoBitCompressor)
    tf.random.set_seed(hvd.rank())
    x, y = data(args.batch), tf.random.uniform((args.batch,), 0, 10, tf.int32)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if loop == "fit":
        # the function model.fit calls for each batch, with Horovod's Keras optimizer
        opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), compression=comp,
                                             sparse_as_dense=True)
        net.compile(optimizer=opt, loss=loss_fn)
        batches = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
        # as TwoBitFallbackCallback does: the train function traced anew once it decided
        train = _anew(lambda: net.make_train_function(force=True), comp, TwoBitCompressor)
        return (lambda: train(batches)["loss"].numpy()), len(net.trainable_variables), comp
    opt = tf.keras.optimizers.SGD(0.01)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=comp, sparse_as_dense=True)
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))
        return loss

    # "anew": traced anew once it decided (fallback_function's mechanism), as the docs tell a
    # custom loop to
    train = (_anew(lambda: tf.function(train_step), comp, TwoBitCompressor) if loop == "anew"
             else tf.function(train_step))
    return (lambda: train(x, y).numpy()), len(net.trainable_variables), comp


def _anew(make, comp, TwoBitCompressor):
    """The traced function ``make()`` gives, made anew once after ``comp``'s
    ``fallback="auto"`` checks all decided (as ``fallback_function`` and
    ``TwoBitFallbackCallback`` do); as it is for other compressions."""
    if not isinstance(comp, TwoBitCompressor):
        return make()
    from horovod_twobit.tensorflow.retrace import FallbackFunction
    return FallbackFunction(make, comp)


def _median_across(hvd, times):
    """The larger of the ranks' median step times (a step ends when the slowest rank's does)."""
    import numpy as np
    med = statistics.median(times)
    return float(np.max(hvd.allgather_object(med)))


def table(results, framework):
    methods = list(dict.fromkeys(m for _, m in results))
    lines = ["| model (%s) | tensors | %s |" % (framework, " | ".join(methods)),
             "|---|---|" + "---|" * len(methods)]
    for model in sorted({m for m, _ in results}):
        base = results.get((model, "none"), (None, 0))[0]
        cells = []
        for method in methods:
            if (model, method) not in results:
                cells.append("")
                continue
            t = results[(model, method)][0]
            cells.append("%.1f (%.2fx)" % (1e3 * t, t / base) if base else "%.1f" % (1e3 * t))
        n = results[next(k for k in results if k[0] == model)][1]
        lines.append("| %s | %d | %s |" % (model, n, " | ".join(cells)))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default="torch,tensorflow")
    ap.add_argument("--models", default="cnn,transformer")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=1, help="timed steps per method and round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per method first")
    ap.add_argument("--settle", type=int, default=0,
                    help="untimed steps per method and round before its timed ones, so that "
                         "they run after steps of their own, as in a job of one model")
    ap.add_argument("--instances", type=int, default=1,
                    help="build every method this many times and pool their steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tf-loops", default="tape",
                    help="TensorFlow training loops: tape (DistributedGradientTape in a "
                         "tf.function), anew (the same through fallback_function, traced anew "
                         "once fallback=\"auto\" decided), fit (the Keras DistributedOptimizer in "
                         "fit's train function, traced anew once it decided, as "
                         "TwoBitFallbackCallback does), comma-separated")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="TensorFlow: after timing, trace this many steps of each method (with "
                         "--instances, of its first instance) with TensorFlow's profiler and "
                         "print the ops' time per step by kind (ms)")
    ap.add_argument("--read-stats", action="store_true",
                    help="also time every compressed method with compressor.stats() read after "
                         "each step (Keras fit: TwoBitStatsCallback(every=1)) and print the "
                         "overhead as a percentage of the step")
    ap.add_argument("--worker", choices=["torch", "tensorflow"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.np < 2:
        ap.error(ONE_RANK)
    if args.worker:
        results, reads, starts, rank = (run_torch if args.worker == "torch" else run_tf)(args)
        if rank == 0:
            print(table(results, args.worker), flush=True)
            for extra in (start_table(starts), fallback_table(results)):
                if extra:
                    print("\n" + extra, flush=True)
            if reads:
                print("\n" + stats_cost.table(results, reads, args.worker), flush=True)
            if args.profile and args.worker == "tensorflow":
                from horovod_twobit.benchmarks import tf_profile
                print("\n" + tf_profile.table(results, args.worker), flush=True)
        return
    print("machine: %s, %d cores, Python %s; %d ranks on localhost, %d thread(s) each; "
          "median of %d rounds x %d steps per method (x %d instances), interleaved, after %d%s"
          % (platform.processor() or platform.machine(), os.cpu_count(),
             platform.python_version(), args.np, args.threads, args.rounds, args.steps,
             args.instances, args.warmup,
             ", each round's after %d untimed" % args.settle if args.settle else ""), flush=True)
    bindir = os.path.dirname(sys.executable)
    # Horovod's response cache holds 1,024 names by default: a job of one model uses far fewer,
    # but every method and instance here has its own names (five methods of 3 instances on the
    # transformer: about 930, one per tensor and plain method), and a cache cycled through more
    # names than it holds evicts each before its next use, so every collective is negotiated
    # anew, which costs a method in proportion to its names rather than its bytes
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               HOROVOD_CACHE_CAPACITY=os.environ.get("HOROVOD_CACHE_CAPACITY", "16384"),
               TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    for fw in args.frameworks.split(","):
        cmd = [os.path.join(bindir, "horovodrun"), "-np", str(args.np), "-H",
               "localhost:%d" % args.np, "--gloo", sys.executable, "-m", "examples.bench_buckets",
               "--worker", fw] + [a for a in (argv if argv is not None else sys.argv[1:])]
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        rows = [line.split("]<stdout>:", 1)[-1] for line in res.stdout.splitlines()
                if "<stdout>:|" in line or line.endswith("<stdout>:")]
        if res.returncode != 0 or not rows:
            sys.exit("%s benchmark failed:\n%s" % (fw, (res.stdout + res.stderr)[-4000:]))
        print("\n".join(rows) + "\n", flush=True)


if __name__ == "__main__":
    main()
