"""Writes tests/vectors/old_checkpoints/: compressor checkpoints written by horovod-twobit as it
was before the package was split into sub-packages (commit f4752ea, where ``TwoBitCompressor``
still held its own state), and what that code computed after restoring them.
tests/test_old_checkpoints.py checks that the current code loads them and continues bit for bit.

Run it with the OLD code (a worktree of commit f4752ea outside this repository), in one process
(Horovod with one rank)::

    git worktree add /tmp/oldtree f4752ea
    cd /tmp/oldtree && PYTHONPATH=/tmp/oldtree \\
        python /path/to/tests/vectors/make_old_checkpoints.py /path/to/tests/vectors/old_checkpoints

It refuses to run when ``horovod_twobit`` is imported from anything but a clean git tree.

For each binding (torch, tensorflow) and configuration (``fixed``: threshold 0.5, allgather;
``auto``: threshold "auto", allgather; ``auto_scatter``: threshold "auto", exchange "scatter",
whose owners' residuals exist with one rank too) a compressor exchanges three tensors (``a``:
17 values alone with ``hvd.allreduce``; ``g.0`` and ``g.1``: 100 and 1000 values with
``hvd.grouped_allreduce(name="g")``) for 3 steps, is saved, and exchanges 3 more steps. Saved:

- torch: ``torch_<config>.pt``, ``torch.save(compressor.state_dict(), path)``;
- tensorflow: ``tf_<config>/ckpt``, ``tf.train.Checkpoint(twobit=compressor).write(prefix)``,
  and ``tf_<config>_state.npz``, ``compressor.state_dict()`` flattened: ``residuals/<name>``,
  ``owner_residuals/<bucket>`` and the scalars ``format_version``, ``threshold``, ``rank``,
  ``size``, ``owner_format_version``;
- ``inputs.npz``: ``step<i>/<name>``, the float32 inputs of steps 0-5;
- ``expected.npz``: the float32 bits (uint32) of steps 3-5 as the uninterrupted old compressor
  computed them, ``<binding>/<config>/out/step<i>/<name>``, and of its state after step 5,
  ``<binding>/<config>/residuals/<name>`` and ``<binding>/<config>/owner_residuals/<bucket>``;
- ``manifest.json``: the commit and command that made them, the configurations, and what the
  old code itself found on restoring its checkpoints (the same bits as not stopping; different
  ones without the residuals, and, with the scatter exchange, without the owners' residuals).
"""

import json
import os
import subprocess
import sys
import warnings

import numpy as np

CONFIGS = {
    "fixed": {"threshold": 0.5},
    "auto": {"threshold": "auto"},
    "auto_scatter": {"threshold": "auto", "exchange": "scatter"},
}
# name -> (values, scale): scales below, near and above the fixed threshold 0.5
TENSORS = {"a": (17, 0.3), "g.0": (100, 0.15), "g.1": (1000, 0.6)}
SEED = 20261128
BEFORE, AFTER = 3, 3  # steps before the checkpoint, steps after it


def make_inputs():
    rng = np.random.default_rng(SEED)
    return [{n: (rng.standard_normal(size) * scale).astype(np.float32)
             for n, (size, scale) in TENSORS.items()} for _ in range(BEFORE + AFTER)]


def bits(a):
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def same(a, b):
    """Whether two {name: array} are the same names with the same float32 bits."""
    return a.keys() == b.keys() and all(np.array_equal(bits(a[k]), bits(b[k])) for k in a)


class Torch:
    name, short = "torch", "torch"

    def __init__(self):
        import torch
        import horovod.torch as hvd
        from horovod_twobit.torch import TwoBitCompressor
        self.torch, self.hvd, self.cls = torch, hvd, TwoBitCompressor
        hvd.init()

    def build(self, config):
        return self.cls(**config)

    def step(self, c, x):
        t = self.torch
        a = self.hvd.allreduce(t.tensor(x["a"]), name="a", compression=c)
        g = self.hvd.grouped_allreduce([t.tensor(x["g.0"]), t.tensor(x["g.1"])], name="g",
                                       compression=c)
        return {"a": a.numpy().copy(), "g.0": g[0].numpy().copy(), "g.1": g[1].numpy().copy()}

    def state(self, c):
        sd = c.state_dict()
        return ({k: v.numpy().copy() for k, v in sd["residuals"].items()},
                {k: v.numpy().copy() for k, v in sd.get("owner_residuals", {}).items()})

    def save(self, c, out, cfg):
        path = os.path.join(out, "torch_%s.pt" % cfg)
        self.torch.save(c.state_dict(), path)
        return {"state_dict": os.path.basename(path)}

    def restorers(self, out, files):
        path = os.path.join(out, files["state_dict"])

        def load(c):
            c.load_state_dict(self.torch.load(path))

        def no_owners(c):
            sd = self.torch.load(path)
            sd.pop("owner_residuals", None)
            c.load_state_dict(sd)

        return {"state_dict": load}, no_owners


class TF:
    name, short = "tensorflow", "tf"

    def __init__(self):
        import tensorflow as tf
        import horovod.tensorflow as hvd
        from horovod_twobit.tensorflow import TwoBitCompressor
        self.tf, self.hvd, self.cls = tf, hvd, TwoBitCompressor
        hvd.init()

    def build(self, config):
        return self.cls(**config)

    def step(self, c, x):
        tf = self.tf
        a = self.hvd.allreduce(tf.constant(x["a"]), name="a", compression=c)
        g = self.hvd.grouped_allreduce([tf.constant(x["g.0"]), tf.constant(x["g.1"])], name="g",
                                       compression=c)
        return {"a": a.numpy().copy(), "g.0": g[0].numpy().copy(), "g.1": g[1].numpy().copy()}

    def state(self, c):
        sd = c.state_dict()
        return ({k: np.array(v, np.float32) for k, v in sd["residuals"].items()},
                {k: np.array(v, np.float32) for k, v in sd.get("owner_residuals", {}).items()})

    def save(self, c, out, cfg):
        prefix = self.tf.train.Checkpoint(twobit=c).write(os.path.join(out, "tf_%s" % cfg, "ckpt"))
        sd = c.state_dict()
        flat = {k: np.asarray(v) for k, v in sd.items()
                if k not in ("residuals", "owner_residuals")}
        flat.update(("residuals/" + k, np.asarray(v)) for k, v in sd["residuals"].items())
        flat.update(("owner_residuals/" + k, np.asarray(v))
                    for k, v in sd.get("owner_residuals", {}).items())
        np.savez(os.path.join(out, "tf_%s_state.npz" % cfg), **flat)
        return {"checkpoint": os.path.relpath(prefix, out), "state_dict": "tf_%s_state.npz" % cfg}

    def restorers(self, out, files):
        tf = self.tf
        prefix = os.path.join(out, files["checkpoint"])
        npz = os.path.join(out, files["state_dict"])

        def read(c):
            return tf.train.Checkpoint(twobit=c).read(prefix)

        def load(c, owners=True):
            c.load_state_dict(state_from_npz(npz, owners))

        return {"checkpoint": read, "state_dict": load}, lambda c: load(c, owners=False)


def state_from_npz(path, owners=True):
    """The state_dict() saved flat by ``TF.save``."""
    with np.load(path) as z:
        sd = {"residuals": {}, "owner_residuals": {}}
        for k in z.files:
            group, _, name = k.partition("/")
            if name:
                sd[group][name] = z[k]
            else:
                v = z[k]
                sd[k] = str(v) if v.dtype.kind == "U" else v.item()
    if not owners or not sd["owner_residuals"]:
        sd.pop("owner_residuals")
        sd.pop("owner_format_version", None)
    return sd


def git(tree, *args):
    return subprocess.run(["git", "-C", tree] + list(args), capture_output=True, text=True,
                          check=True).stdout.strip()


def main(out):
    import horovod_twobit
    tree = os.path.dirname(os.path.dirname(os.path.abspath(horovod_twobit.__file__)))
    commit = git(tree, "rev-parse", "HEAD")
    if git(tree, "status", "--porcelain", "--untracked-files=no"):
        sys.exit("horovod_twobit comes from %s, which has local changes: run this with a clean "
                 "worktree of the old commit" % tree)
    os.makedirs(out, exist_ok=True)
    inputs = make_inputs()
    np.savez(os.path.join(out, "inputs.npz"),
             **{"step%d/%s" % (i, n): v for i, x in enumerate(inputs) for n, v in x.items()})
    expected = {}
    manifest = {
        "README": ("Checkpoints written by horovod-twobit at commit %s (%s), with Horovod of one "
                   "rank, by the command below (this repository's "
                   "tests/vectors/make_old_checkpoints.py run with a worktree of that commit "
                   "first on the path; its docstring describes the files); "
                   "tests/test_old_checkpoints.py checks that the current code restores them and "
                   "continues bit for bit."
                   % (commit[:7], git(tree, "log", "-1", "--format=%cs %s"))),
        "commit": commit,
        "command": ("git worktree add /tmp/oldtree %s && cd /tmp/oldtree && "
                    "PYTHONPATH=/tmp/oldtree python <repo>/tests/vectors/make_old_checkpoints.py "
                    "<repo>/tests/vectors/old_checkpoints" % commit[:7]),
        "seed": SEED, "steps_before": BEFORE, "steps_after": AFTER,
        "tensors": {n: {"values": size, "scale": scale} for n, (size, scale) in TENSORS.items()},
        "calls": ['hvd.allreduce(a, name="a", compression=c)',
                  'hvd.grouped_allreduce([g.0, g.1], name="g", compression=c)'],
        "configs": CONFIGS, "bindings": {},
    }
    for binding in (Torch(), TF()):
        entry = manifest["bindings"][binding.name] = {}
        for cfg, args in CONFIGS.items():
            c = binding.build(args)
            for x in inputs[:BEFORE]:
                binding.step(c, x)
            files = binding.save(c, out, cfg)
            saved_res, saved_own = binding.state(c)
            outs = [binding.step(c, x) for x in inputs[BEFORE:]]
            res, own = binding.state(c)
            key = "%s/%s/" % (binding.short, cfg)
            for i, o in zip(range(BEFORE, BEFORE + AFTER), outs):
                expected.update((key + "out/step%d/%s" % (i, n), bits(v)) for n, v in o.items())
            expected.update((key + "residuals/" + n, bits(v)) for n, v in res.items())
            expected.update((key + "owner_residuals/" + n, bits(v)) for n, v in own.items())

            # the old code restoring its own checkpoint: the same bits as not stopping
            restorers, no_owners = binding.restorers(out, files)
            restored = {}
            for how, restore in restorers.items():
                d = binding.build(args)
                with warnings.catch_warnings(record=True) as got:
                    warnings.simplefilter("always")
                    status = restore(d)
                    o2 = [binding.step(d, x) for x in inputs[BEFORE:]]
                    if status is not None:
                        status.assert_consumed()
                mine = [str(w.message) for w in got if "horovod-twobit" in str(w.message)]
                assert not mine, mine
                r2, w2 = binding.state(d)
                restored[how] = (all(same(p, q) for p, q in zip(outs, o2)) and same(res, r2)
                                 and same(own, w2))
                assert restored[how], (binding.name, cfg, how)
            # and what makes the test able to fail: without the residuals (or without the
            # owners' ones) the steps differ
            d = binding.build(args)
            fresh = [binding.step(d, x) for x in inputs[BEFORE:]]
            entry[cfg] = dict(files, **{
                "restored_same_as_uninterrupted": restored,
                "without_residuals_differs": not all(same(p, q) for p, q in zip(outs, fresh)),
                "residual_values": {n: int(v.size) for n, v in saved_res.items()},
                "nonzero_residuals": sorted(n for n, v in saved_res.items() if v.any()),
                "owner_residual_values": {n: int(v.size) for n, v in saved_own.items()},
                "nonzero_owner_residuals": sorted(n for n, v in saved_own.items() if v.any()),
            })
            assert entry[cfg]["without_residuals_differs"], (binding.name, cfg)
            if saved_own:
                d = binding.build(args)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    no_owners(d)
                    o3 = [binding.step(d, x) for x in inputs[BEFORE:]]
                entry[cfg]["without_owner_residuals_differs"] = not all(
                    same(p, q) for p, q in zip(outs, o3))
            print(binding.name, cfg, json.dumps(entry[cfg]), flush=True)
    np.savez(os.path.join(out, "expected.npz"), **expected)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(os.path.abspath(sys.argv[1]))
