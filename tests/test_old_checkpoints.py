"""Checkpoints written before the package was split into sub-packages (commit f4752ea, where
``TwoBitCompressor`` still held its own state) load into this code and continue bit for bit.

tests/vectors/old_checkpoints holds, per binding and configuration (threshold 0.5; "auto";
"auto" with the scatter exchange, whose owners' residuals it saves too), a compressor's state
after 3 steps as users save it (torch: ``torch.save(c.state_dict())``; tensorflow:
``tf.train.Checkpoint(twobit=c).write`` and ``c.state_dict()``), and the float32 bits of the
next 3 steps' results and of the residuals after them, as the old code computed them without
stopping (tests/vectors/make_old_checkpoints.py; its manifest names the commit and command).
One horovodrun job of one rank per binding (tests/workers/old_checkpoints.py) restores each
into a fresh compressor of this code and runs the same 3 steps."""

import json
import os

import numpy as np
import pytest

import jobs

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FIXTURE = os.path.join(HERE, "vectors", "old_checkpoints")
with open(os.path.join(FIXTURE, "manifest.json")) as _f:
    MANIFEST = json.load(_f)
SHORT = {"torch": "torch", "tensorflow": "tf"}
WAYS = {"torch": ["state_dict"], "tensorflow": ["checkpoint", "state_dict"]}
CASES = [(b, cfg, how) for b in SHORT for cfg in MANIFEST["configs"] for how in WAYS[b]]
SCATTER = [cfg for cfg, args in MANIFEST["configs"].items() if args.get("exchange") == "scatter"]


def _expected():
    with np.load(os.path.join(FIXTURE, "expected.npz")) as z:
        return {k: z[k] for k in z.files}


def _restored(tmp_path_factory, binding):
    """(arrays, report) of the worker's job for ``binding``: one job shared by its tests."""

    def job():
        out = tmp_path_factory.mktemp("old_checkpoints_" + SHORT[binding])
        jobs.run(1, "old_checkpoints.py", binding, FIXTURE, out, timeout=400)
        with np.load(os.path.join(out, "results.npz")) as z:
            arrays = {k: z[k] for k in z.files}
        with open(os.path.join(out, "results.json")) as f:
            report = json.load(f)
        # this repository's package, not an old tree's
        assert report["module"] == os.path.join(REPO, "horovod_twobit", "__init__.py"), report
        return arrays, report

    return jobs.shared(("old_checkpoints", binding), job)


def _part(arrays, prefix):
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def _differences(want, got):
    """What differs between two {key: uint32 bits}: missing and extra keys, and per key the
    number of values whose bits differ with the first of them (as float32)."""
    out = ["missing: %s" % sorted(set(want) - set(got))] if set(want) - set(got) else []
    if set(got) - set(want):
        out.append("extra: %s" % sorted(set(got) - set(want)))
    for k in sorted(set(want) & set(got)):
        w, g = want[k], got[k]
        if w.shape != g.shape:
            out.append("%s: shape %s, expected %s" % (k, g.shape, w.shape))
            continue
        bad = np.flatnonzero(w != g)
        if bad.size:
            i = bad[0]
            out.append("%s: %d of %d values differ, first [%d] %r (bits %08x), expected %r "
                       "(bits %08x)" % (k, bad.size, w.size, i, g.view(np.float32)[i], g[i],
                                        w.view(np.float32)[i], w[i]))
    return out


def test_fixture_is_complete():
    """The fixture: every file the manifest names, and what the old code found on restoring its
    own checkpoints (the same bits as not stopping; without the residuals, or the scatter
    owners' residuals, other bits)."""
    assert MANIFEST["commit"].startswith("f4752ea")
    expected = _expected()
    for binding, short in SHORT.items():
        for cfg in MANIFEST["configs"]:
            entry = MANIFEST["bindings"][binding][cfg]
            for how in WAYS[binding]:
                path = os.path.join(FIXTURE, entry[how])
                assert os.path.exists(path if how == "state_dict" else path + ".index"), path
                assert entry["restored_same_as_uninterrupted"][how] is True
            assert entry["without_residuals_differs"] is True
            assert entry["nonzero_residuals"] == sorted(MANIFEST["tensors"])
            prefix = "%s/%s/" % (short, cfg)
            outs = _part(expected, prefix + "out/")
            assert len(outs) == MANIFEST["steps_after"] * len(MANIFEST["tensors"])
            assert sorted(_part(expected, prefix + "residuals/")) == sorted(MANIFEST["tensors"])
            owners = sorted(_part(expected, prefix + "owner_residuals/"))
            assert owners == sorted(entry["owner_residual_values"])
            if cfg in SCATTER:
                assert owners and entry["nonzero_owner_residuals"] == owners
                assert entry["without_owner_residuals_differs"] is True
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(FIXTURE) for f in fs)
    assert size < 400 * 1024, size


@pytest.mark.slow  # a process per binding restores and steps them (10-13 s each)
@pytest.mark.parametrize("binding,config,how", CASES)
def test_old_checkpoint_continues_bit_for_bit(tmp_path_factory, binding, config, how):
    arrays, report = _restored(tmp_path_factory, binding)
    rec = report["%s/%s" % (config, how)]
    assert rec["error"] is None, rec["error"]
    assert rec["warnings"] == [], rec["warnings"]
    if how == "checkpoint":
        assert rec["status"] == "consumed", rec["status"]
    args = MANIFEST["configs"][config]
    assert (rec["threshold"], rec["rank"], rec["size"]) == (args["threshold"], 0, 1)
    want = _part(_expected(), "%s/%s/" % (SHORT[binding], config))
    got = _part(arrays, "%s/%s/" % (config, how))
    diff = _differences(want, got)
    assert not diff, "restored from the old %s %s (%s), this code continues differently:\n%s" % (
        binding, config, how, "\n".join(diff))


@pytest.mark.slow
@pytest.mark.parametrize("binding", list(SHORT))
def test_without_the_old_state_the_steps_differ(tmp_path_factory, binding):
    """The comparison can fail: a compressor that restored nothing, or (scatter) not the owners'
    residuals, computes other bits than the recorded ones."""
    arrays, report = _restored(tmp_path_factory, binding)
    expected = _expected()
    for config in MANIFEST["configs"]:
        controls = ["fresh"] + (["no_owners"] if config in SCATTER else [])
        for how in controls:
            rec = report["%s/%s" % (config, how)]
            assert rec["error"] is None, rec["error"]
            want = _part(expected, "%s/%s/out/" % (SHORT[binding], config))
            got = _part(arrays, "%s/%s/out/" % (config, how))
            assert sorted(got) == sorted(want)
            assert _differences(want, got), (config, how)
