"""Combinations that cannot be correct raise a clear error on every rank, never hang."""

import re

import pytest

import jobs

CASES = {
    "threshold": ("PayloadMismatchError", r"different thresholds \[0\.5, 0\.25\].*same threshold"),
    "size": ("PayloadMismatchError", r"different sizes|ends before"),
    "size_same_words": ("PayloadMismatchError", r"different sizes \[33, 34\]"),
    "noname": ("ValueError", r"pass name="),
    "class": ("TypeError", r"pass an instance"),
    "op": ("ValueError", r"op=hvd.Average and op=hvd.Sum only \(got hvd.Max\)"),
    "adasum": ("ValueError", r"Adasum"),
    "sparse": ("ValueError", r"sparse_as_dense=True"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_on_every_rank(case):
    kind, pattern = CASES[case]
    res = jobs.run(2, "torch_errors.py", case, timeout=120)
    for rank in range(2):
        line = [l for l in res.output.splitlines() if "RAISED rank %d " % rank in l]
        assert line, "rank %d did not raise: %r" % (rank, res)
        assert kind in line[0] and re.search(pattern, line[0]), line[0]
    assert res.seconds < 60


def test_sparse_as_dense_is_accepted():
    res = jobs.run(2, "torch_errors.py", "sparse_as_dense", timeout=120)
    assert "OK rank 0" in res.output and "OK rank 1" in res.output
