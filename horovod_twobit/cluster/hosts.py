"""The hosts' network: one network namespace per host, joined to a bridge in the root namespace by
a veth pair, with its own address, a shaped link and its own ``/etc/hosts``.

Layout (defaults; ``iface`` and ``subnet`` are parameters)::

    root namespace                                   namespace hvd0-h<i>  (one per host)
    bridge "hvd0" 10.77.0.1/24  --  veth "hvd0-h<i>" <====> veth "hvd0"  10.77.0.<11+i>/24
    horovodrun (rendezvous)         tc: tbf (to host)        tc: tbf (from host) [+ netem delay]
                                                             sshd (own config, host key, keys)

* The bridge in the root namespace and the veth inside every host are both named ``iface``, and
  jobs get ``--network-interface iface``: horovodrun then picks the bridge's address for its
  rendezvous server and the hosts' addresses for Gloo.
* Horovod's Gloo process-set contexts bind to the address the machine's hostname resolves to (all
  namespaces share the hostname, which resolves to 127.0.0.1). ``ip netns exec NS`` bind-mounts
  ``/etc/netns/NS/hosts`` over ``/etc/hosts``, so each host gets one mapping the hostname to its own
  address, and ``sshd`` (hence every process of a job) is started through ``ip netns exec``.
* Links are shaped on both ends of every veth with ``tbf`` at ``rate``: each host has ``rate`` up
  and ``rate`` down, like a switch port. ``delay`` (netem) is added on the host's side only, so the
  one-way latency between two hosts is ``delay``.

Traffic only flows between the namespaces and the bridge address in the root namespace; the hosts
have no default route.
"""

import ipaddress
import os
import re
import socket
import subprocess

from horovod_twobit.cluster.accounting import parse_rate
from horovod_twobit.cluster.errors import ClusterError
from horovod_twobit.cluster.processes import _run

_DELAY = re.compile(r"^\d+(?:\.\d+)?(us|usec|ms|msec|s|sec)$")


class Host:
    __slots__ = ("index", "ns", "addr", "root_veth", "sshd_pid")

    def __init__(self, index, ns, addr, root_veth, sshd_pid=None):
        self.index, self.ns, self.addr, self.root_veth, self.sshd_pid = index, ns, addr, root_veth, sshd_pid

    def __repr__(self):
        return "Host(%d, ns=%s, addr=%s)" % (self.index, self.ns, self.addr)


def make_hosts(n_hosts, iface, net):
    """(bridge address, [Host]) of ``n_hosts`` hosts in the /24 ``net``: the bridge takes .1, host
    i takes .(11 + i); namespace and root-side veth of host i are both named ``<iface>-h<i>``."""
    base = int(net.network_address)
    bridge_addr = str(ipaddress.ip_address(base + 1))
    hosts = [Host(i, "%s-h%d" % (iface, i), str(ipaddress.ip_address(base + 11 + i)),
                  "%s-h%d" % (iface, i)) for i in range(n_hosts)]
    return bridge_addr, hosts


def check_free(iface, hosts, subnet):
    """Raises ClusterError when the bridge, a namespace or the subnet is taken already."""
    if os.path.exists("/sys/class/net/%s" % iface):
        raise ClusterError(
            "an interface named %r already exists in the root namespace (another virtual "
            "cluster, or a leftover): remove it with `python -m horovod_twobit.cluster down "
            "--iface %s`, or pick another iface" % (iface, iface))
    existing = set(_run(["ip", "netns", "list"]).stdout.split())
    clash = [h.ns for h in hosts if h.ns in existing]
    if clash:
        raise ClusterError("network namespaces %s already exist: remove them with `python -m "
                           "horovod_twobit.cluster down --iface %s`" % (clash, iface))
    routes = _run(["ip", "-4", "route", "show", "to", "match", str(subnet.network_address)])
    for line in routes.stdout.splitlines():
        if line.split() and line.split()[0] != "default":
            raise ClusterError("the subnet %s is already routed here (%s): pick another subnet"
                               % (subnet, line.strip()))


def create_network(iface, bridge_addr, hosts, mtu, rate, delay, dilation=1.0):
    """The bridge, then every host's namespace, veth pair, address, shaping and /etc/netns files.
    ``rate`` and ``delay`` are the real-world link's; the links get them dilated (``dilate``)."""
    ip = ["ip"]
    _run(ip + ["link", "add", iface, "type", "bridge"])
    _run(ip + ["link", "set", iface, "mtu", str(mtu)])
    _run(ip + ["addr", "add", "%s/24" % bridge_addr, "dev", iface])
    _run(ip + ["link", "set", iface, "up"])
    for h in hosts:
        _run(ip + ["netns", "add", h.ns])
        _run(ip + ["link", "add", h.root_veth, "type", "veth", "peer", "name", iface,
                   "netns", h.ns])
        _run(ip + ["link", "set", h.root_veth, "mtu", str(mtu), "master", iface, "up"])
        _run(ip + ["-n", h.ns, "link", "set", "lo", "up"])
        _run(ip + ["-n", h.ns, "link", "set", iface, "mtu", str(mtu)])
        _run(ip + ["-n", h.ns, "addr", "add", "%s/24" % h.addr, "dev", iface])
        _run(ip + ["-n", h.ns, "link", "set", iface, "up"])
        _no_ipv6(h, iface)
        _shape(h, iface, rate, delay, mtu, dilation)
        _write_netns_files(h, hosts, iface, bridge_addr)


def _no_ipv6(h, iface):
    """IPv6 off on the cluster's links: no router solicitations or MLD reports in the counters."""
    for path, ns in (("/proc/sys/net/ipv6/conf/%s/disable_ipv6" % h.root_veth, None),
                     ("/proc/sys/net/ipv6/conf/%s/disable_ipv6" % iface, iface),
                     ("/proc/sys/net/ipv6/conf/%s/disable_ipv6" % iface, h.ns)):
        if ns == h.ns:
            subprocess.run(["ip", "netns", "exec", h.ns, "sh", "-c", "echo 1 > %s" % path],
                           capture_output=True, timeout=20)
        elif os.path.exists(path):
            with open(path, "w") as f:
                f.write("1")


# A TCP segment as the stack hands it to a NIC (TSO/GSO: 64 KiB, plus the headers of its ~45
# packets), with room to spare.
GSO_BYTES = 96 * 1024


def tbf_burst(rate, mtu):
    """The token bucket of a link, in bytes: at least 2 ms worth at ``rate``, four packets, and one
    whole 64 KiB TSO segment. tbf cuts a segment larger than its bucket into MTU-size packets in
    software, where a NIC would take it whole: at 100 Mbit/s (a 2 ms bucket of 25 kB) that cost
    this 2-core machine about 14 ms of CPU per MB sent per host (8 hosts exchanging 4 MB per pair,
    the kernel's time included), against about 8 ms with whole segments; the hosts share that CPU
    with their training."""
    return max(4 * (mtu + 100), int(parse_rate(rate) / 8 * 0.002), GSO_BYTES)


_DELAY_US = {"us": 1, "usec": 1, "ms": 1000, "msec": 1000, "s": 1000000, "sec": 1000000}


def dilate(rate, delay, dilation):
    """(rate, delay) of the links for a real-world ``rate`` and ``delay`` under time dilation
    ``dilation`` (DieCast): the rate divided by it, the delay multiplied by it, in tc units
    (``"25000000bit"``, ``"4000us"``); None stays None, dilation 1 changes nothing."""
    if dilation == 1:
        return rate, delay
    if rate is not None:
        rate = "%dbit" % round(parse_rate(rate) / dilation)
    if delay is not None:
        m = _DELAY.match(str(delay))
        if not m:
            raise ValueError("delay must look like 5ms or 200us (tc units), got %r" % (delay,))
        delay = "%dus" % round(float(str(delay)[:m.start(1)]) * _DELAY_US[m.group(1)] * dilation)
    return rate, delay


def _tbf(rate, mtu, dev, ns=None, parent=None, dilation=1.0):
    # The bucket and the queue hold what they would on the real-world link: the bucket's bytes
    # come from the real rate, the queue's time limit stretches with the clock.
    burst = tbf_burst(rate, mtu)
    argv = ["tc"] + (["-n", ns] if ns else []) + ["qdisc", "add", "dev", dev]
    argv += ["parent", parent, "handle", "10:"] if parent else ["root", "handle", "1:"]
    _run(argv + ["tbf", "rate", dilate(rate, None, dilation)[0], "burst", str(burst), "latency",
                 "%dms" % round(100 * dilation)])


def _shape(h, iface, rate, delay, mtu, dilation=1.0):
    if rate is not None:
        _tbf(rate, mtu, h.root_veth, dilation=dilation)  # bridge -> host
    if delay is not None:
        try:
            _run(["tc", "-n", h.ns, "qdisc", "add", "dev", iface, "root", "handle", "1:",
                  "netem", "delay", dilate(None, delay, dilation)[1], "limit", "100000"])
        except ClusterError as e:
            if "unknown" in str(e).lower():
                raise ClusterError("delay needs the netem qdisc, which this kernel lacks "
                                   "(sch_netem): run without delay") from None
            raise
        if rate is not None:
            _tbf(rate, mtu, iface, ns=h.ns, parent="1:1", dilation=dilation)
    elif rate is not None:
        _tbf(rate, mtu, iface, ns=h.ns, dilation=dilation)  # host -> bridge


def _write_netns_files(h, hosts, iface, bridge_addr):
    d = os.path.join("/etc/netns", h.ns)
    os.makedirs(d, exist_ok=True)
    hostname = socket.gethostname()
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
             "%s %s" % (h.addr, hostname)]
    lines += ["%s %s" % (o.addr, o.ns) for o in hosts]
    lines.append("%s %s-launcher" % (bridge_addr, iface))
    with open(os.path.join(d, "hosts"), "w") as f:
        f.write("# written by horovod_twobit.cluster for %s; removed on teardown\n" % h.ns)
        f.write("\n".join(lines) + "\n")
