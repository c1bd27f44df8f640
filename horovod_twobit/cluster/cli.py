"""The command line, ``python -m horovod_twobit.cluster``::

    python -m horovod_twobit.cluster run --hosts 4 --rate 100mbit -- python train.py
    python -m horovod_twobit.cluster up --hosts 2 --rate 1gbit     # stays up; prints how to use it
    python -m horovod_twobit.cluster up --hosts 4 --rate 1gbit --cpus-per-host 0.25 --dilation 4
    python -m horovod_twobit.cluster run --existing -- python train.py
    python -m horovod_twobit.cluster status                          # shows the cluster that is up
    python -m horovod_twobit.cluster down                            # removes it (or leftovers)
"""

import argparse
import os
import shlex
import sys

from horovod_twobit.cluster import cpu
from horovod_twobit.cluster.cleanup import _leftovers, teardown
from horovod_twobit.cluster.errors import ClusterError, ClusterUnavailable
from horovod_twobit.cluster.virtual_cluster import VirtualCluster


def _main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m horovod_twobit.cluster",
                                 description="A virtual multi-host cluster (network namespaces, "
                                             "shaped links, sshd) for horovodrun jobs.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--iface", default="hvd0", help="bridge/veth name (default hvd0)")

    def shape(p):
        p.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
        p.add_argument("--rate", default="1gbit", help="link rate per host, tc units; 'none' for "
                                                       "unshaped (default 1gbit)")
        p.add_argument("--delay", default=None, help="one-way latency added per host, e.g. 5ms")
        p.add_argument("--subnet", default="10.77.0.0/24")
        p.add_argument("--mtu", type=int, default=1500)
        p.add_argument("--cpus-per-host", type=float, default=None, metavar="Q",
                       help="hard CPU quota per host in cores (CFS bandwidth limit in the host's "
                            "own cgroup); default: none, the hosts share the machine")
        p.add_argument("--dilation", type=float, default=1.0, metavar="D",
                       help="time dilation: links run at rate/D with delay*D, so that with "
                            "--cpus-per-host 1/D a host stands for a 1-core real host, D times "
                            "slower; --rate and --delay stay the real-world link's (default 1)")
        p.add_argument("--cpu-period-us", type=int, default=None,
                       help="CFS period of the CPU quota (default 100000)")

    p_up = sub.add_parser("up", help="create a cluster and leave it running")
    common(p_up)
    shape(p_up)
    p_run = sub.add_parser("run", help="run horovodrun across the hosts (creating a cluster for "
                                       "the job unless --existing)")
    common(p_run)
    shape(p_run)
    p_run.add_argument("--existing", action="store_true", help="use the cluster `up` left running")
    p_run.add_argument("--np-per-host", type=int, default=1)
    p_run.add_argument("--mpi", action="store_true", help="horovodrun --mpi (default: --gloo)")
    p_run.add_argument("--timeout", type=float, default=None, help="seconds")
    p_run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p_down = sub.add_parser("down", help="remove the cluster (or the leftovers of one)")
    common(p_down)
    p_st = sub.add_parser("status", help="show the cluster that is up")
    common(p_st)
    args = ap.parse_args(argv)

    if args.cmd in ("up", "run"):
        rate = None if str(args.rate).lower() == "none" else args.rate
    try:
        if args.cmd == "up":
            c = VirtualCluster(args.hosts, rate, args.delay, args.iface, args.subnet, args.mtu,
                               args.cpus_per_host, args.dilation, args.cpu_period_us)
            with c:
                print(c.describe())
                print("\nrun a job:  %s -m horovod_twobit.cluster run --existing --iface %s -- "
                      "python train.py" % (sys.executable, args.iface))
                print("or by hand: PATH=%s:$PATH %s" % (c.bin_dir, " ".join(
                    shlex.quote(a) for a in c.horovodrun_argv(1, ["python", "train.py"]))))
                print("remove it:  %s -m horovod_twobit.cluster down --iface %s"
                      % (sys.executable, args.iface))
                c.detach()
            return 0
        if args.cmd == "run":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not cmd:
                ap.error("run needs a command after --")
            if args.existing:
                c = VirtualCluster.attach(args.iface)
                res = c.horovodrun(args.np_per_host, cmd, mpi=args.mpi, timeout=args.timeout,
                                   stream=sys.stdout)
            else:
                with VirtualCluster(args.hosts, rate, args.delay, args.iface, args.subnet, args.mtu,
                                    args.cpus_per_host, args.dilation, args.cpu_period_us) as c:
                    print(c.describe(), flush=True)
                    res = c.horovodrun(args.np_per_host, cmd, mpi=args.mpi, timeout=args.timeout,
                                       stream=sys.stdout)
                    print("bytes per host (tx/rx): " + ", ".join(
                        "%s %d/%d" % (k, v["tx"], v["rx"]) for k, v in c.counters().items()))
                    if c.cpu is not None:
                        print("CPU throttled per host: " + ", ".join(
                            "%s %.2f s" % (k, v["throttled_s"]) for k, v in c.cpu_stats().items()))
                    if c.dilation != 1:
                        print("job %.1f s, real-host equivalent %.1f s (dilation %g)"
                              % (res.seconds, res.seconds / c.dilation, c.dilation))
            if res.timed_out:
                print("timed out after %ss" % args.timeout, file=sys.stderr)
                return 124
            return res.returncode
        if args.cmd == "down":
            if os.geteuid() != 0:
                raise ClusterUnavailable("removing a virtual cluster needs root")
            try:
                c = VirtualCluster.attach(args.iface)
                c.down()
                print("removed virtual cluster %s" % args.iface)
            except ClusterError:
                names = _leftovers(args.iface)
                groups = cpu.leftovers(args.iface)
                errors = teardown(args.iface, names)
                print("removed leftovers of %s: %s" % (args.iface, names + groups or "none"))
                if errors:
                    print("\n".join(errors), file=sys.stderr)
                    return 1
            return 0
        if args.cmd == "status":
            c = VirtualCluster.attach(args.iface)
            c.detach()
            print(c.describe())
            return 0
    except (ClusterUnavailable, ClusterError, ValueError) as e:
        print("horovod_twobit.cluster: %s" % e, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the cluster was removed", file=sys.stderr)
        return 130
    return 0

