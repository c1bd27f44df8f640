"""ssh into the hosts: the cluster's keys and client config in its temporary directory, one
``sshd`` per host, and root's known_hosts left as it was found.

* Every host runs its own ``sshd`` (own config, host key and authorized_keys, listening on the
  host's address only), started through ``ip netns exec`` so that it and every process of a job
  live in the host's namespace and see its ``/etc/hosts``.
* ssh never touches root's ``~/.ssh``: a wrapper named ``ssh`` first on the jobs' PATH runs
  ``/usr/bin/ssh -F <cluster config>`` (the cluster's client key, its own known_hosts, no host-key
  prompts). Entries that show up in root's known_hosts for the cluster's addresses anyway are
  removed on teardown.
"""

import os
import pwd
import shlex
import shutil
import socket
import subprocess
import time

from horovod_twobit.cluster.errors import ClusterError
from horovod_twobit.cluster.processes import _run

SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
SSH_KEYGEN = "/usr/bin/ssh-keygen"


def client_key(workdir):
    return os.path.join(workdir, "id_ed25519")


def client_config(workdir):
    return os.path.join(workdir, "ssh_config")


def wrapper_dir(workdir):
    return os.path.join(workdir, "bin")


def make_keys(workdir, hosts):
    """The client key, authorized_keys, client config and ``ssh`` wrapper, and every host's key."""
    key, ssh_config, bin_dir = client_key(workdir), client_config(workdir), wrapper_dir(workdir)
    _run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "hvdtb-cluster", "-f", key])
    shutil.copy(key + ".pub", os.path.join(workdir, "authorized_keys"))
    os.makedirs(bin_dir)
    with open(ssh_config, "w") as f:
        f.write("Host *\n"
                "  User root\n"
                "  IdentityFile %s\n"
                "  IdentitiesOnly yes\n"
                "  UserKnownHostsFile %s\n"
                "  GlobalKnownHostsFile /dev/null\n"
                "  StrictHostKeyChecking no\n"
                "  HashKnownHosts no\n"
                "  BatchMode yes\n"
                "  PasswordAuthentication no\n"
                "  ConnectTimeout 20\n"
                "  LogLevel ERROR\n" % (key, os.path.join(workdir, "known_hosts")))
    wrapper = os.path.join(bin_dir, "ssh")
    with open(wrapper, "w") as f:
        f.write("#!/bin/sh\n# horovod_twobit.cluster: ssh with the cluster's own config\n"
                "exec %s -F %s \"$@\"\n" % (SSH, shlex.quote(ssh_config)))
    os.chmod(wrapper, 0o755)
    for h in hosts:
        hk = os.path.join(workdir, "h%d" % h.index, "ssh_host_ed25519_key")
        os.makedirs(os.path.dirname(hk))
        _run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", h.ns, "-f", hk])


def make_privsep_dir():
    """Creates sshd's privilege separation directory /run/sshd if missing; True when it did."""
    if not os.path.isdir("/run/sshd"):
        os.makedirs("/run/sshd", mode=0o755)
        return True
    return False


def start_sshd(workdir, h, wrap=None):
    """Starts host ``h``'s sshd in its namespace and returns its Popen (pid in ``h.sshd_pid``).
    ``wrap(h, argv)``: the command line that runs ``argv`` (``ip netns exec ...``) in the host's
    CPU cgroup, with the same pid."""
    d = os.path.join(workdir, "h%d" % h.index)
    cfg = os.path.join(d, "sshd_config")
    with open(cfg, "w") as f:
        f.write("Port 22\n"
                "ListenAddress %s\n"
                "HostKey %s\n"
                "PidFile %s\n"
                "AuthorizedKeysFile %s\n"
                "PermitRootLogin prohibit-password\n"
                "PubkeyAuthentication yes\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "PrintMotd no\n"
                "UseDNS no\n"
                "MaxStartups 200\n"
                "MaxSessions 200\n"
                "LogLevel ERROR\n"
                % (h.addr, os.path.join(d, "ssh_host_ed25519_key"), os.path.join(d, "sshd.pid"),
                   os.path.join(workdir, "authorized_keys")))
    log = open(os.path.join(d, "sshd.log"), "ab")
    argv = ["ip", "netns", "exec", h.ns, SSHD, "-D", "-e", "-f", cfg]
    proc = subprocess.Popen(wrap(h, argv) if wrap else argv,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)
    log.close()
    h.sshd_pid = proc.pid  # the wrapper and ip netns exec exec sshd: same pid
    return proc


def wait_ssh(workdir, h, proc, timeout=30):
    """Waits until host ``h``'s sshd answers, then logs in once through the wrapper."""
    deadline = time.time() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise ClusterError("sshd in %s exited (%s): %s" % (h.ns, proc.returncode,
                                                              sshd_log(workdir, h)))
        try:
            with socket.create_connection((h.addr, 22), timeout=2) as s:
                s.settimeout(5)
                if s.recv(64).startswith(b"SSH-"):
                    break
        except OSError:
            pass
        if time.time() > deadline:
            raise ClusterError("sshd in %s did not answer on %s:22 within %ds: %s"
                               % (h.ns, h.addr, timeout, sshd_log(workdir, h)))
        time.sleep(0.1)
    p = subprocess.run([os.path.join(wrapper_dir(workdir), "ssh"), h.addr, "true"],
                       capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise ClusterError("ssh to %s (%s) failed: %s %s" % (h.ns, h.addr, p.stderr.strip(),
                                                             sshd_log(workdir, h)))


def sshd_log(workdir, h):
    try:
        with open(os.path.join(workdir, "h%d" % h.index, "sshd.log")) as f:
            return f.read()[-2000:]
    except OSError:
        return ""


# ---------------------------------------------------------------------- root's known_hosts
def _root_known_hosts():
    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        home = os.path.expanduser("~")
    return os.path.join(home, ".ssh", "known_hosts")


def read_known_hosts():
    try:
        with open(_root_known_hosts()) as f:
            return f.read().splitlines()
    except OSError:
        return None


def _clean_known_hosts(before, addresses):
    """Removes from root's known_hosts the lines for ``addresses`` that were not there before."""
    path = _root_known_hosts()
    if not os.path.exists(path):
        return
    before = set(before or [])
    with open(path) as f:
        lines = f.read().splitlines()
    drop = set()
    for addr in addresses:
        p = subprocess.run([SSH_KEYGEN, "-F", addr, "-f", path], capture_output=True, text=True)
        for line in p.stdout.splitlines():
            if line and not line.startswith("#"):
                drop.add(line)
    keep = [line for line in lines if line in before or line not in drop]
    if not keep and not before:  # the file is ours alone
        os.remove(path)
    elif len(keep) != len(lines):
        tmp = path + ".hvdtb-tmp"
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in keep))
        os.chmod(tmp, os.stat(path).st_mode & 0o777)
        os.replace(tmp, path)
