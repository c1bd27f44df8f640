"""The stack installs and works: real horovodrun jobs with Gloo and MPI, PyTorch and TensorFlow."""

import os
import re
import subprocess

import pytest

import jobs

REPO = os.path.dirname(jobs.HERE)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("mpi", [False, True], ids=["gloo", "mpi"])
def test_allreduce_and_allgather(framework, mpi):
    res = jobs.run(2, "smoke.py", framework, mpi=mpi, timeout=180)
    for rank in range(2):
        assert "rank %d of 2 %s: OK" % (rank, framework) in res.output, res


def test_check_build_lists_everything():
    out = subprocess.run([jobs.horovodrun(), "--check-build"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120).stdout
    for fw in ("TensorFlow", "PyTorch", "MPI", "Gloo"):
        assert re.search(r"\[X\] %s\b" % fw, out), out


def _commands(text):
    return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(REPO, "README.md")).read()
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", readme, re.S).group(1)
    demo_cmd, test_cmd = _commands(block)[:2]
    assert "test" in test_cmd and "demo" in demo_cmd
    assert _commands(open(os.path.join(REPO, ".ci", "run")).read())[-1] == test_cmd


def test_dockerfile_runs_setup_and_the_ci_test_command():
    docker = open(os.path.join(REPO, "docker", "Dockerfile")).read()
    assert re.search(r"^FROM .*python:3\.11.*bookworm", docker, re.M)
    assert re.search(r"^RUN .*bash scripts/setup\.sh", docker, re.M)
    ci_cmd = _commands(open(os.path.join(REPO, ".ci", "run")).read())[-1]
    cmd = re.search(r'^CMD \[(.*)\]', docker, re.M).group(1)
    words = [w.strip().strip('"') for w in cmd.split(",")]
    assert " ".join(words) == ci_cmd
