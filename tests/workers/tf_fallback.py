"""The fallback (TwoBitCompressor(..., fallback=...)) in a real TensorFlow job, as
tests/workers/torch_fallback.py: hvd.DistributedGradientTape in a tf.function, with buckets
(bucket_bytes=2048: a bucket of three tensors and a tensor alone), a NaN in the last rank's l0_b
gradient at step 2. Per configuration (--configs THRESHOLD:EXCHANGE:MODE): "always" sends every
bucket uncompressed; "switch" forces the decisions step by step (compressed, compressed, plain,
plain, compressed, plain), tracing the step anew each time (a traced function keeps its
decisions); "auto" measures the link and decides. Saves local and aggregated gradients, residuals
after each step, the decisions, the stats' exchanges and the final weights to
OUT/<index>/rank<r>.npz."""

import json
import logging

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_twobit.tensorflow import TwoBitCompressor
from configs import SWITCH, checked_schedule, parse_args, run_each

NAMES = ["l0_w", "l0_b", "l1_w", "l1_b"]
SHAPES = [(12, 40), (40,), (40, 6), (6,)]
args = parse_args()
hvd.init()
rank = hvd.rank()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
logging.basicConfig(level=logging.INFO, format="rank %d %%(message)s" % rank)


class Forced(dict):
    """Decisions forced by the test: every bucket asked about gets ``mode``."""
    mode = "compressed"

    def get(self, key, default=None):
        self[key] = self.mode
        return self.mode


def run(spec):
    threshold, exchange, mode = spec.split(":")
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.3, name=n)
                 for n, s in zip(NAMES, SHAPES)]
    hvd.broadcast_variables(variables, root_rank=0)
    c = TwoBitCompressor(threshold if threshold == "auto" else float(threshold),
                         bucket_bytes=2048, exchange=exchange,
                         fallback="always" if mode == "always" else "auto")
    steps = checked_schedule(mode)
    if mode == "switch":
        c.state.decisions = Forced()
        c.state.check_fallback = False  # the forced decisions hold as they are

    def train_step(x, y, f):
        w0, b0, w1, b1 = variables
        with tf.GradientTape(persistent=True) as tape:
            pred = tf.matmul(tf.tanh(tf.matmul(x, w0) + b0), w1) + b1
            loss = tf.reduce_mean(tf.square(pred - y)) * 3.0 + tf.reduce_sum(b0 * f)
        local = tape.gradient(loss, variables)
        agg = hvd.DistributedGradientTape(tape, compression=c).gradient(loss, variables)
        ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in agg])
        for v, g in zip(variables, agg):
            v.assign_sub(tf.where(ok, 0.1 * g, tf.zeros_like(g)))  # skipped when not finite
        return local, agg

    first_fn = step_fn = tf.function(train_step)
    rec = {}
    for step in range(steps):
        if mode == "switch":
            Forced.mode = SWITCH[step]
            step_fn = tf.function(train_step)  # traced anew: decided anew
        if mode == "checked" and step == steps - 1:
            # traced anew after the check decided: its buckets keep the mode kept, unchecked
            step_fn = tf.function(train_step)
        data = np.random.default_rng(1000 * rank + step)
        x = data.standard_normal((16, 12)).astype(np.float32)
        y = data.standard_normal((16, 6)).astype(np.float32)
        f = np.zeros(40, np.float32)
        if step == 2 and rank == hvd.size() - 1:
            f[5] = np.nan
        local, agg = step_fn(x, y, f)
        for n, lg, ag in zip(NAMES, local, agg):
            rec["local/%d/%s" % (step, n)] = lg.numpy().reshape(-1)
            rec["agg/%d/%s" % (step, n)] = ag.numpy().reshape(-1)
        for k, r in c.state_dict()["residuals"].items():
            rec["res/%d/%s" % (step, k)] = np.asarray(r).reshape(-1).copy()
        st = c.stats()
        keys = sorted(st["buckets"])
        rec["decisions/%d" % step] = np.array([c.decisions[(k, hvd.size())] for k in keys])
        rec["exchanges/%d" % step] = np.array([st["buckets"][k]["exchange"] for k in keys])
        rec["groups"] = np.array([",".join(st["buckets"][k]["tensors"]) for k in keys])
        rec["plain_bytes/%d" % step] = np.int64(st["bytes_last_step"].get("plain", 0))
    for n, v in zip(NAMES, variables):
        rec["w/" + n] = v.numpy().reshape(-1)
    rec["link"] = np.array(json.dumps([repr(v) for v in c.state.links.values()]))
    rec["link_allgather"] = np.array([v.allgather for v in c.state.links.values()],
                                     dtype=np.float64)
    rec["repr"] = np.array(repr(c))
    rec["checks"] = np.array(json.dumps(c.stats().get("fallback_checks")))
    # where the checked decision's step starts: its timestamp runs once the gradients it reduces
    # are there (their ops among its control inputs), not wherever the executor puts it
    graph = first_fn.get_concrete_function(x, y, f).graph
    # the step traced after the decision: no check's ops, no checked exchange (a Case op)
    retraced = step_fn.get_concrete_function(x, y, f).graph.get_operations()
    rec["retraced_check_ops"] = np.int64(sum("FallbackCheck" in op.name or op.type == "Case"
                                             for op in retraced))
    rec["checks_made"] = np.int64(c.state.checks_made)
    starts = [op for op in graph.get_operations()
              if op.type == "Timestamp" and "FallbackCheck" in op.name]
    grads_of = {op.name for op in graph.get_operations() if "gradient_tape" in op.name}
    rec["check_starts"] = np.array([sum(d.name in grads_of for d in op.control_inputs)
                                    for op in starts], dtype=np.int64)
    # and the mode every checked exchange takes is read after it (an exchange cannot start
    # before the step's start is read, whatever its mode)
    rec["mode_after_start"] = np.array([_after(ch.mode.op, ch.t0.op) for ch in c.state.checks],
                                       dtype=bool)
    return rec


def _after(op, start):
    """Whether ``start`` is among ``op``'s inputs or control inputs, at any depth, as the step
    runs: a cond is lowered to Switch and Merge there, where the branch not taken passes on
    without its branch's inputs, so only a cond's condition counts."""
    seen, todo = set(), [op]
    while todo:
        cur = todo.pop()
        attr = cur.node_def.attr.get("_lower_using_switch_merge")  # set where lowered
        lowered = cur.type in ("If", "StatelessIf") and attr is not None and attr.b
        inputs = cur.inputs[:1] if lowered else cur.inputs
        for dep in [t.op for t in inputs] + list(cur.control_inputs):
            if dep is start:
                return True
            if dep.name not in seen:
                seen.add(dep.name)
                todo.append(dep)
    return False


run_each(args.out, args.configs, run, rank)
print("rank %d done" % rank, flush=True)
