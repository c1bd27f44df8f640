"""Combinations that cannot be correct raise a clear error on every rank, never hang. One 2-rank job
runs every case in turn (tests/workers/torch_errors.py), so each case also shows that the job can
go on after the error."""

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
ACCEPTED = ["sparse_as_dense"]


@pytest.fixture(scope="module")
def outcomes():
    cases = sorted(CASES) + ACCEPTED
    return jobs.case_outcomes(jobs.run(2, "torch_errors.py", *cases, timeout=240), 2, cases)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_error_on_every_rank(outcomes, case):
    kind, pattern = CASES[case]
    for rank, o in enumerate(outcomes[case]):
        assert o.kind == "RAISED", "rank %d: %r" % (rank, o)
        assert o.message.startswith(kind + ": ") and re.search(pattern, o.message), o
        assert o.seconds < 30, o


def test_sparse_as_dense_is_accepted(outcomes):
    assert [o.kind for o in outcomes["sparse_as_dense"]] == ["OK", "OK"]
