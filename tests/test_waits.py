"""TwoBit's waits (horovod_twobit.torch.exchange.progress.wait) poll with sleeps that double up to a
longest one, and bench_cluster's hosts dilate them as they dilate Horovod's."""

import os
import sys

import pytest

from horovod_twobit.torch.exchange import progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from examples import _cluster_worker  # noqa: E402


def test_waits_sleep_doubling_up_to_the_longest(monkeypatch):
    slept = []
    monkeypatch.setattr(progress.time, "sleep", slept.append)
    monkeypatch.setattr(progress, "POLL_S", (1e-3, 4e-3))
    polls = iter([False] * 5 + [True])
    progress.wait(lambda: next(polls))
    assert slept == [1e-3, 2e-3, 4e-3, 4e-3, 4e-3]


def test_the_default_polls_are_20_us_doubling_up_to_half_a_millisecond(monkeypatch):
    slept = []
    monkeypatch.setattr(progress.time, "sleep", slept.append)
    polls = iter([False] * 7 + [True])
    progress.wait(lambda: next(polls))
    assert slept == pytest.approx([2e-5, 4e-5, 8e-5, 1.6e-4, 3.2e-4, 5e-4, 5e-4])


@pytest.mark.parametrize("dilation", ["1", "2.5", "5"])
def test_a_dilated_cluster_polls_d_times_less_often(monkeypatch, dilation):
    monkeypatch.setattr(progress, "POLL_S", progress.POLL_S)  # restored after the test
    monkeypatch.setenv("HVDTB_CLUSTER_DILATION", dilation)
    d = float(dilation)
    for _ in range(2):  # set, not compounded, when the worker asks twice
        assert _cluster_worker.dilated_twobit_waits() == pytest.approx((2e-5 * d, 5e-4 * d))
        assert progress.POLL_S == pytest.approx((2e-5 * d, 5e-4 * d))
