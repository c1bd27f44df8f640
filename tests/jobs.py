"""Runs real ``horovodrun`` jobs for the tests: no mocked Horovod anywhere."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
BIN = os.path.dirname(sys.executable)


def horovodrun():
    exe = os.path.join(BIN, "horovodrun")
    if not os.path.exists(exe):
        exe = shutil.which("horovodrun")
    if exe is None:
        pytest.fail("horovodrun not found: run bash scripts/test.sh, which installs Horovod")
    return exe


def job_env(extra=None):
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
        "OMP_NUM_THREADS": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "10",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30",
    })
    env.update(extra or {})
    return env


class Result:
    def __init__(self, proc, seconds):
        self.returncode = proc.returncode
        self.output = proc.stdout_text
        self.seconds = seconds

    def __repr__(self):
        return "rc=%s after %.1fs\n%s" % (self.returncode, self.seconds, self.output[-6000:])


_BUILT = []


def built():
    """What Horovod was built with (``gloo,mpi``), from Horovod's own checks, once per session:
    ``launch.py`` hands it to each launch so that none imports TensorFlow to find out again."""
    if not _BUILT:
        code = ("from horovod.common.util import gloo_built, mpi_built; "
                "print(','.join(n for n, f in (('gloo', gloo_built), ('mpi', mpi_built)) if f()))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=job_env(), timeout=120)
        if out.returncode != 0:
            pytest.fail("cannot ask Horovod what it was built with:\n%s" % out.stderr[-3000:])
        _BUILT.append((out.stdout.strip().splitlines() or [""])[-1])  # "" if neither was built
    return _BUILT[0]


def run(np_, script, *args, mpi=False, timeout=240, env=None, check=True):
    """Runs ``horovodrun -np N`` on localhost with Gloo (or MPI) and returns its Result."""
    horovodrun()  # fails clearly when Horovod is not installed
    cmd = [sys.executable, os.path.join(HERE, "launch.py"), "-np", str(np_),
           "-H", "localhost:%d" % np_]
    cmd += ["--mpi", "--mpi-args=--oversubscribe"] if mpi else ["--gloo"]
    cmd += [sys.executable, os.path.join(WORKERS, script)] + [str(a) for a in args]  # absolute paths stay
    return _launch("horovodrun", cmd, script, dict(env or {}, HOROVOD_TWOBIT_TEST_BUILT=built()),
                   timeout, check)


def torchrun(np_, script, *args, timeout=240, env=None, check=True):
    """Runs a worker under ``torchrun --standalone --nproc_per_node N`` (torch.distributed, no
    Horovod) and returns its Result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(np_), os.path.join(WORKERS, script)] + [str(a) for a in args]
    return _launch("torchrun", cmd, script, env, timeout, check)


def _launch(launcher, cmd, script, env, timeout, check):
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=job_env(env), start_new_session=True)
    try:
        proc.stdout_text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("%s %s did not finish within %ss:\n%s" % (launcher, script, timeout,
                                                             out[-6000:]))
    res = Result(proc, time.time() - t0)
    if check and res.returncode != 0:
        pytest.fail("%s %s failed: %r" % (launcher, script, res))
    return res


_SHARED = {}


def shared(key, make):
    """``make()``, run once per ``key`` in a test session and shared by every test that asks (one
    horovodrun job that runs several tests' configurations: one launch and one framework import
    instead of one per test). A failure is kept too, and raised to each of those tests."""
    if key not in _SHARED:
        try:
            _SHARED[key] = True, make()
        except (Exception, pytest.fail.Exception) as e:
            _SHARED[key] = False, e
    ok, value = _SHARED[key]
    if not ok:
        raise value
    return value


_CASE = re.compile(r"\b(RAISED|OK|NO ERROR) rank (\d+) case (\S+?)(?: after ([\d.]+)s)?(?:: (.*))?$")


class Outcome:
    """What one rank printed for one case: ``kind`` (RAISED, OK or NO ERROR), ``seconds`` and
    ``message`` (``Type: text``) for a raise."""

    def __init__(self, kind, seconds, message):
        self.kind, self.seconds, self.message = kind, seconds, message

    def __repr__(self):
        return "%s after %ss: %s" % (self.kind, self.seconds, self.message)


def case_outcomes(res, np_, cases):
    """{case: [Outcome of rank 0, of rank 1, ...]} from a job of tests/workers/*_errors.py that
    prints ``RAISED|OK|NO ERROR rank R case C ...`` once per rank and case. Fails naming the first
    rank that printed nothing for a case (it hung, or died)."""
    seen = {}
    for line in res.output.splitlines():
        m = _CASE.search(line)
        if m:
            kind, rank, case, seconds, message = m.groups()
            seen.setdefault((case, int(rank)), Outcome(kind, seconds and float(seconds), message))
    missing = [(c, r) for c in cases for r in range(np_) if (c, r) not in seen]
    if missing:
        pytest.fail("rank %d printed nothing for case %s: %r" % (missing[0][1], missing[0][0], res))
    return {c: [seen[(c, r)] for r in range(np_)] for c in cases}


def demo_accuracies(output):
    """(uncompressed, TwoBit) final test accuracies a digits demo printed (examples/_digits.py)."""
    m = re.search(r"final test accuracy: uncompressed ([0-9.]+), TwoBit\([^)]*\) ([0-9.]+)", output)
    assert m, output[-3000:]
    return float(m.group(1)), float(m.group(2))


def check_demo_accuracies(output, floor=0.9, margin=0.03):
    """A demo's full run learned: both accuracies above ``floor``, TwoBit's within ``margin``
    of the uncompressed run's (15 epochs: 0.96 / 0.97 in PyTorch, 0.95 / 0.95 in Keras)."""
    plain, twobit = demo_accuracies(output)
    assert plain >= floor and twobit >= floor and twobit >= plain - margin, (plain, twobit)
