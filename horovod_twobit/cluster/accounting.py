"""What the links carry: tc rates in bits per second, and byte counters, per host from the
root-side veths (``VirtualCluster.counters``) or, inside a host, of its own interface
(``iface_bytes``, for workers that measure around a loop)."""

import re

from horovod_twobit.cluster.errors import ClusterError

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(|k|m|g|t)(bit|bps)$", re.I)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(rate):
    """Bits per second of a tc rate such as ``100mbit``, ``1gbit``, ``12.5mbps``."""
    m = _RATE.match(str(rate).strip())
    if not m:
        raise ValueError("rate must look like 100mbit, 1gbit or 12.5mbps (tc units), got %r" % (rate,))
    bits = float(m.group(1)) * _SCALE[m.group(2).lower()] * (8 if m.group(3).lower() == "bps" else 1)
    if bits <= 0:
        raise ValueError("rate must be positive, got %r" % (rate,))
    return bits


def iface_bytes(iface="hvd0"):
    """(rx_bytes, tx_bytes) of ``iface`` in the calling process's network namespace, from
    /proc/net/dev (which always shows the caller's namespace). Workers of a job call it to measure
    what their host sent and received around a loop."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                v = rest.split()
                return int(v[0]), int(v[8])
    raise ClusterError("no interface %r in this network namespace (/proc/net/dev)" % iface)


def counters(hosts):
    """{host ns: {"tx": bytes the host sent, "rx": bytes it received}} on its link so far, read
    from the root-side veth (whose rx is the host's tx)."""
    out = {}
    for h in hosts:
        base = "/sys/class/net/%s/statistics/" % h.root_veth
        with open(base + "rx_bytes") as f:
            tx = int(f.read())
        with open(base + "tx_bytes") as f:
            rx = int(f.read())
        out[h.ns] = {"tx": tx, "rx": rx}
    return out
