"""Restores the checkpoints of tests/vectors/old_checkpoints (written by the code before the
package was split into sub-packages) into fresh compressors of this code and runs the steps
that followed them; tests/test_old_checkpoints.py compares with what the old code computed.

    old_checkpoints.py BINDING FIXTURE_DIR OUT_DIR

BINDING is torch or tensorflow. One rank. For each configuration of the fixture's manifest and
each way to restore (torch: ``load_state_dict(torch.load(path))``; tensorflow:
``tf.train.Checkpoint(twobit=c).read(prefix)`` before any residual exists, and
``load_state_dict`` of the saved ``state_dict()``), and two controls (``fresh``: nothing
restored; ``no_owners``: the state_dict without its scatter owners' residuals), writes to
OUT_DIR ``results.npz`` (float32 bits as uint32: ``<config>/<how>/out/step<i>/<name>``, and the
state after the last step, ``<config>/<how>/residuals/<name>`` and
``<config>/<how>/owner_residuals/<bucket>``) and ``results.json`` (per config and way: the
horovod-twobit warnings, the error a restore or step raised, the checkpoint status's
``assert_consumed()`` failure, the state_dict's threshold, rank and size)."""

import json
import os
import sys
import traceback
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "vectors"))

from make_old_checkpoints import bits, state_from_npz  # noqa: E402

binding, fixture, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
with open(os.path.join(fixture, "manifest.json")) as f:
    manifest = json.load(f)
with np.load(os.path.join(fixture, "inputs.npz")) as z:
    inputs = [{n: z["step%d/%s" % (i, n)] for n in manifest["tensors"]}
              for i in range(manifest["steps_before"] + manifest["steps_after"])]
after = list(range(manifest["steps_before"], manifest["steps_before"] + manifest["steps_after"]))

if binding == "torch":
    import torch
    import horovod.torch as hvd
    from horovod_twobit.torch import TwoBitCompressor

    def step(c, x):
        a = hvd.allreduce(torch.tensor(x["a"]), name="a", compression=c)
        g = hvd.grouped_allreduce([torch.tensor(x["g.0"]), torch.tensor(x["g.1"])], name="g",
                                  compression=c)
        return {"a": a.numpy(), "g.0": g[0].numpy(), "g.1": g[1].numpy()}

    def restorers(files):
        path = os.path.join(fixture, files["state_dict"])

        def no_owners(c):
            sd = torch.load(path)
            sd.pop("owner_residuals", None)
            sd.pop("owner_format_version", None)
            c.load_state_dict(sd)

        return {"state_dict": lambda c: c.load_state_dict(torch.load(path)),
                "no_owners": no_owners}

    def as_array(v):
        return v.numpy()
else:
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from horovod_twobit.tensorflow import TwoBitCompressor

    def step(c, x):
        a = hvd.allreduce(tf.constant(x["a"]), name="a", compression=c)
        g = hvd.grouped_allreduce([tf.constant(x["g.0"]), tf.constant(x["g.1"])], name="g",
                                  compression=c)
        return {"a": a.numpy(), "g.0": g[0].numpy(), "g.1": g[1].numpy()}

    def restorers(files):
        prefix = os.path.join(fixture, files["checkpoint"])
        npz = os.path.join(fixture, files["state_dict"])
        return {"checkpoint": lambda c: tf.train.Checkpoint(twobit=c).read(prefix),
                "state_dict": lambda c: c.load_state_dict(state_from_npz(npz)),
                "no_owners": lambda c: c.load_state_dict(state_from_npz(npz, owners=False))}

    def as_array(v):
        return np.asarray(v)

import horovod_twobit  # noqa: E402

hvd.init()
arrays, report = {}, {"module": horovod_twobit.__file__}
configs = manifest["configs"]
for cfg, args in configs.items():
    ways = dict(restorers(manifest["bindings"][binding][cfg]), fresh=lambda c: None)
    if not manifest["bindings"][binding][cfg]["owner_residual_values"]:
        del ways["no_owners"]
    for how, restore in ways.items():
        key = "%s/%s/" % (cfg, how)
        rec = report[key[:-1]] = {"warnings": [], "error": None, "status": None}
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            try:
                c = TwoBitCompressor(**args)
                status = restore(c)
                for i in after:
                    o = step(c, inputs[i])
                    arrays.update((key + "out/step%d/%s" % (i, n), bits(v)) for n, v in o.items())
                if status is not None and how == "checkpoint":
                    try:
                        status.assert_consumed()
                        rec["status"] = "consumed"
                    except AssertionError as e:
                        rec["status"] = "not consumed: %s" % e
                sd = c.state_dict()
                for group in ("residuals", "owner_residuals"):
                    arrays.update((key + group + "/" + n, bits(as_array(v)))
                                  for n, v in sd.get(group, {}).items())
                rec.update((k, sd.get(k)) for k in ("threshold", "rank", "size"))
            except Exception:
                rec["error"] = traceback.format_exc()
        rec["warnings"] = [str(w.message) for w in got if "horovod-twobit" in str(w.message)]

os.makedirs(out_dir, exist_ok=True)
np.savez(os.path.join(out_dir, "results.npz"), **arrays)
with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(report, f, indent=1)
print("rank %d wrote %d arrays for %d runs" % (hvd.rank(), len(arrays), len(report) - 1))
