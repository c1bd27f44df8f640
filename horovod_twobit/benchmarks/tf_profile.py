"""The ops of a TensorFlow training step by kind, from TensorFlow's profiler
(``examples/bench_buckets.py --profile STEPS``)."""

import collections
import glob
import tempfile

# what a TensorFlow step's ops are, by name scope and op type (TwoBit's ops are in the
# twobit_encode / twobit_finish scopes; Horovod's collectives are their own op types)
CATEGORIES = [("twobit encode", ("twobit_encode/",)), ("twobit finish", ("twobit_finish/",)),
              ("collective", (":HorovodAllreduce", ":HorovodAllgather", ":HorovodGroupedAllreduce",
                              ":HorovodAlltoall")),
              ("optimizer", ("SGD/", "/update", "AssignAddVariableOp", "ResourceApply")),
              ("backward", ("gradient_tape/", "gradients/")),
              ("compression (fp16 casts)", ("Cast",))]


def profile(fn, steps):
    """Runs ``steps`` steps of ``fn`` under TensorFlow's profiler; returns (ms per step of
    each category of ops, ops per step): the ops' own time on the executor's threads, summed
    (with one inter-op thread they run one at a time). Horovod's collectives run asynchronously,
    off these threads: their column reads 0, their time is the step's rest. The XLA calls' time
    is their launch on these threads; ``horovod_twobit.benchmarks.tf_passes`` times the bodies."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    logdir = tempfile.mkdtemp(prefix="twobit-profile-")
    tf.profiler.experimental.start(logdir)
    for _ in range(steps):
        fn()
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(sorted(glob.glob(logdir + "/plugins/profile/*/*.xplane.pb"))[-1], "rb") as f:
        space.ParseFromString(f.read())
    ms, ops = collections.Counter(), 0
    for plane in space.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_Compute") and not line.name.startswith("tf_inter"):
                continue
            for ev in line.events:
                name = plane.event_metadata[ev.metadata_id].name
                if ":" not in name or name.startswith("ExecutorState") or "::" in name:
                    continue  # the executor's own events, not ops
                ops += 1
                cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)),
                           "forward and other")
                ms[cat] += ev.duration_ps / 1e9 / steps
    return dict(ms), ops / steps


def table(results, framework):
    """A markdown table of the profiles in ``results`` ((model, method): (ms, tensors, profile))."""
    cats = [c for c, _ in CATEGORIES] + ["forward and other"]
    lines = ["| model (%s), method | ops per step | %s |" % (framework, " | ".join(cats)),
             "|---|---|" + "---|" * len(cats)]
    for (model, method), got in results.items():
        if len(got) < 3:
            continue
        ms, ops = got[2]
        lines.append("| %s, %s | %.0f | %s |" % (model, method, ops,
                                                 " | ".join("%.2f" % ms.get(c, 0.0) for c in cats)))
    return "\n".join(lines)
