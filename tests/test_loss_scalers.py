"""Loss scalers end to end, in real horovodrun jobs: one forced overflow (+Inf in one rank's scaled
gradient at step OVERFLOW) with PyTorch's torch.amp.GradScaler and with Keras mixed precision's
LossScaleOptimizer. With TwoBitCompressor the overflow skips that step only, the scale recovers,
and the loss after the run is within a small tolerance of the same run without compression, which
goes through the same overflow (with "auto"; a fixed threshold meets the scaled gradients and
trains slowly, but goes on training)."""

import numpy as np
import pytest
import torch

import jobs

pytestmark = pytest.mark.slow
STEPS, OVERFLOW = 40, 10
CONFIGS = ("none", "0.5", "auto")
TOLERANCE = 0.15  # "auto": relative to the uncompressed run's final loss (measured: 11 %, 1 %)


def _runs(tmp_path_factory, worker, *extra):
    def job():
        out = tmp_path_factory.mktemp(worker[:-3])
        jobs.run(2, worker, "--out", out, "--steps", STEPS, "--overflow", OVERFLOW,
                 "--configs", *CONFIGS, *extra, timeout=600)
        return {c: dict(np.load(str(out / ("%d.npz" % i)))) for i, c in enumerate(CONFIGS)}
    return jobs.shared((worker,) + extra, job)


def check(runs, config):
    base, run = runs["none"], runs[config]
    for name, r in (("none", base), (config, run)):
        assert np.flatnonzero(r["skipped"]).tolist() == [OVERFLOW], (name, r["skipped"])
        assert r["scale"][OVERFLOW + 1] == r["scale"][OVERFLOW] / 2, (name, r["scale"])
        assert r["scale"][-1] >= r["scale"][OVERFLOW], (name, r["scale"])  # it recovered
        assert np.isfinite(r["loss"]).all(), (name, r["loss"])
    # training went on after the overflow (a run stuck on skipped steps keeps its loss exactly)
    after = run["loss"][OVERFLOW + 1:]
    assert after[-1] < 0.99 * after[0] and (np.diff(after) < 0).mean() > 0.9, run["loss"]
    if config == "auto":
        # and arrived where the uncompressed run did. (A fixed threshold meets the *scaled*
        # gradients, so it sends +-t / scale: it trains, slowly, as the scale grows.)
        assert abs(run["loss"][-1] - base["loss"][-1]) <= TOLERANCE * base["loss"][-1], (
            run["loss"][-1], base["loss"][-1])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("config", CONFIGS[1:])
def test_torch_grad_scaler_recovers_after_an_overflow(tmp_path_factory, device, config):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    check(_runs(tmp_path_factory, "torch_loss_scaler.py", "--device", device), config)


@pytest.mark.parametrize("config", CONFIGS[1:])
def test_keras_loss_scale_optimizer_recovers_after_an_overflow(tmp_path_factory, config):
    check(_runs(tmp_path_factory, "tf_loss_scaler.py"), config)
