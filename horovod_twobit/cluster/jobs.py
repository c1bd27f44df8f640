"""Jobs on the hosts: the ``horovodrun`` command line and environment, running it from the root
namespace with its output collected (and streamed), running a command in every host at once through
``ip netns exec`` (no ssh: e.g. torch.distributed), and ending what a job leaves behind."""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from horovod_twobit.cluster.processes import _kill_group, _kill_ns_processes


class Result:
    """What a job did: returncode, combined output, wall seconds."""

    def __init__(self, returncode, output, seconds, argv):
        self.returncode = returncode
        self.output = output
        self.seconds = seconds
        self.argv = argv

    @property
    def timed_out(self):
        return self.returncode is None

    def __repr__(self):
        return "rc=%s after %.1fs\n%s" % (self.returncode, self.seconds, self.output[-6000:])


def job_env(bin_dir, extra=None):
    """Environment for jobs: ``bin_dir`` (the ssh wrapper) first on PATH, Open MPI allowed to run
    as root."""
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    path = [p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p != bin_dir]
    env["PATH"] = os.pathsep.join([bin_dir] + path)
    return env


def select_hosts(all_hosts, hosts):
    """``hosts``: None (all), a count of the first hosts, or a list of indices."""
    if hosts is None:
        return list(all_hosts)
    if isinstance(hosts, int):
        if not 1 <= hosts <= len(all_hosts):
            raise ValueError("the cluster has %d hosts, asked for %d" % (len(all_hosts), hosts))
        return all_hosts[:hosts]
    return [all_hosts[i] for i in hosts]


def horovodrun_argv(sel, np_per_host, command, iface, key, mpi=False, extra_args=()):
    """The horovodrun command line for ``command`` (a list) on the hosts ``sel``."""
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(exe):
        exe = shutil.which("horovodrun") or "horovodrun"
    argv = [exe, "-np", str(np_per_host * len(sel)),
            "-H", ",".join("%s:%d" % (h.addr, np_per_host) for h in sel),
            "--network-interface", iface, "--ssh-identity-file", key, "--disable-cache"]
    if mpi:
        # horovodrun already sets btl_tcp_if_include; keep Open MPI's own out-of-band traffic
        # (daemons <-> mpirun) on the cluster's interface too.
        argv += ["--mpi", "--mpi-args=--oversubscribe -mca oob_tcp_if_include %s" % iface]
    else:
        argv += ["--gloo"]
    return argv + list(extra_args) + [str(a) for a in command]


def kill_stragglers(hosts):
    """Ends every process in the hosts except their sshd listeners."""
    _kill_ns_processes([h.ns for h in hosts], keep={h.sshd_pid for h in hosts})


def run_job(argv, env, timeout, stream, after):
    """Runs ``argv`` in its own process group, collecting (and streaming) its output; then kills
    the group and calls ``after()`` (which ends what it left in the hosts)."""
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    chunks = []

    def pump():
        for line in proc.stdout:
            chunks.append(line)
            if stream is not None:
                stream.write(line)
                stream.flush()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    rc = None
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        chunks.append("\n[horovod_twobit.cluster: killed after %ss]\n" % timeout)
    finally:
        _kill_group(proc)  # also mpirun/ssh children left in the launcher's process group
        t.join(timeout=10)
        after()
    return Result(rc, "".join(chunks), time.time() - t0, argv)


def run_on_hosts(sel, start, workdir, timeout, stream, after):
    """Starts ``start(host, logfile)`` (a Popen in its own session) for every host in ``sel`` and
    waits for all, then calls ``after()``; see VirtualCluster.run_on_hosts."""
    t0 = time.time()
    procs = []
    out_dir = tempfile.mkdtemp(prefix="hvdtb-job-", dir=workdir)
    try:
        for h in sel:
            f = open(os.path.join(out_dir, "h%d.log" % h.index), "w+")
            p = start(h, f)
            procs.append((h, p, f))
        deadline = None if timeout is None else t0 + timeout
        rcs = []
        timed_out = False
        for h, p, f in procs:
            try:
                rcs.append(p.wait(timeout=None if deadline is None else max(0.1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
            if rcs[-1] != 0:  # one failed: the others would hang in a collective
                break
    finally:
        for h, p, f in procs:
            if p.poll() is None:
                _kill_group(p)
        after()
    output = []
    for h, p, f in procs:
        f.seek(0)
        text = f.read()
        f.close()
        output.append("".join("[%s] %s\n" % (h.ns, line) for line in text.splitlines()))
        if stream is not None:
            stream.write(output[-1])
    shutil.rmtree(out_dir, ignore_errors=True)
    rc = None if timed_out else next((r for r in (p.returncode for _, p, _ in procs) if r != 0), 0)
    return Result(rc, "".join(output), time.time() - t0, None)
