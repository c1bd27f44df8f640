"""Multi-host benchmark on a virtual cluster: Horovod (no compression, fp16, TwoBitCompressor) against
PyTorch DDP with its communication hooks (fp16_compress_hook, quantization_pertensor_hook,
powerSGD_hook), over the same shaped links.

For every rate and model it trains for a fixed number of steps on N hosts (network namespaces with
their own sshd, see horovod_twobit/cluster/) and reports the median step time, the CPU time a host
spends per step, the bytes each host put on the wire per step (its interface counters around each
timed step), and the loss after the steps on a fixed evaluation batch. The Horovod methods of a
model run in one horovodrun job over ssh and take turns step by step (``examples/_cluster_worker.py``;
``--job-per-method`` gives each its own job); DDP jobs are started in every host with
``ip netns exec`` (torch.distributed, gloo backend, MASTER_ADDR = host 0), one per method.
A Horovod method followed by ``#TAG`` (``none#2``) is another instance of it in the same job, with
its own model and names: the two differ by the bench's own spread (an A/A pair).

Needs root (network namespaces). Quick run::

    sudo .venv/bin/python examples/bench_cluster.py --rates 100mbit --models mlp \\
        --methods none,fp16,twobit --steps 5

Everything::

    sudo .venv/bin/python examples/bench_cluster.py

Writes <out>/bench_cluster.md (the table), bench_cluster.png (the plot) and bench_cluster.json.

Hosts that stand for real ones (docs/emulation.md): N hosts share this machine's cores, so by
default every host gets a hard CPU quota of ``Q = cores x headroom / N`` cores (its own CPU cgroup,
``--cpus-per-host``) and the cluster runs with time dilation ``D = 1 / Q`` (``--dilation``: links at
rate / D): each host then stands for a 1-core host on the real-world link, D times slower. The
table gives the measured step and the real-host equivalent (measured / D), and per host and step
the compute, codec and waiting parts (real-host seconds). The quota holds from the first
measured step: a job's start-up and warm-up steps run at the machine's cores
(``--quota-from-start``: under the quota too). ``--cpus-per-host 0`` turns the
emulation off (the hosts share the cores as they come; dilation 1). So that a waiting host does
not take CPU from the others, every method waits with short sleeps (``--spin-wait``: Horovod's own
spinning wait for no compression and fp16). While it runs it prints a line per step (and one
every 20 s of silence).
"""

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from examples._cluster_calibrate import calibrate_worker  # noqa: E402
from examples._cluster_worker import (DDP_TWOBIT, THRESHOLDS, TWOBIT, kind_of,  # noqa: E402
                                     worker)

HOROVOD_METHODS = {"none": "Horovod, no compression", "fp16": "Horovod, Compression.fp16",
                   "twobit": "Horovod, TwoBitCompressor",
                   "auto": 'Horovod, TwoBitCompressor("auto")',
                   "scatter": 'Horovod, TwoBitCompressor(exchange="scatter")',
                   "scatter_auto": 'Horovod, TwoBitCompressor("auto", exchange="scatter")',
                   "twobit_fallback": 'Horovod, TwoBitCompressor(fallback="auto")',
                   "auto_fallback": 'Horovod, TwoBitCompressor("auto", fallback="auto")',
                   "twobit_always": 'Horovod, TwoBitCompressor(fallback="always")'}
DDP_METHODS = {"ddp": "DDP, no hook", "ddp_fp16": "DDP, fp16_compress_hook",
               "ddp_quant": "DDP, quantization_pertensor_hook*", "ddp_powersgd": "DDP, powerSGD_hook**",
               "ddp_powersgd4": "DDP, powerSGD_hook** (rank 4)",
               "ddp_twobit": "DDP, horovod_twobit's 2-bit hook",
               "ddp_twobit_auto": 'DDP, horovod_twobit\'s 2-bit hook ("auto")',
               "ddp_twobit_scatter": 'DDP, horovod_twobit\'s 2-bit hook (exchange="scatter")',
               "ddp_twobit_scatter_auto":
                   'DDP, horovod_twobit\'s 2-bit hook ("auto", exchange="scatter")'}
ALL_METHODS = dict(HOROVOD_METHODS, **DDP_METHODS)
DEFAULT_METHODS = "none,fp16,twobit,ddp_fp16,ddp_quant,ddp_powersgd"


# The share of this machine's cores the hosts' quotas add up to by default: the rest is left to
# what runs outside the hosts' cgroups (the kernel's network work in softirq, the launcher). See
# docs/emulation.md for how it was measured.
HEADROOM = 0.8


def emulation(args):
    """(cpus per host or None, dilation) from --cpus-per-host, --dilation, --headroom."""
    from horovod_twobit.cluster import cpu
    if args.cpus_per_host is not None and args.cpus_per_host <= 0:
        return None, args.dilation or 1.0
    if args.cpus_per_host is None and not cpu.backends():
        print("bench_cluster: no CPU cgroup with CFS bandwidth control here (cgroup v1 cpu or v2 "
              "cpu.max): the hosts run without a CPU quota, and the figures follow this "
              "machine's CPU", file=sys.stderr)
        return None, args.dilation or 1.0
    q = args.cpus_per_host or (os.cpu_count() or 1) * args.headroom / args.hosts
    return q, args.dilation or 1.0 / q


SPIN = ("import json, sys, time\n"
        "end, c0, w0 = time.time() + float(sys.argv[1]), time.process_time(), time.time()\n"
        "while time.time() < end:\n    pass\n"
        "print(json.dumps({'cpu': time.process_time() - c0, 'wall': time.time() - w0}))")


def measure_headroom(args, shares=(1.0, 0.9, 0.8, 0.7, 0.5), seconds=6.0):
    """Every host spins for ``seconds`` at Q = cores x h / hosts for each h: prints the CPU each
    host got over its quota (1.0: the hosts get what they are given)."""
    from horovod_twobit.cluster import VirtualCluster
    cores = os.cpu_count() or 1
    with VirtualCluster(n_hosts=args.hosts, rate=None, iface=args.iface, subnet=args.subnet,
                        cpus_per_host=cores / args.hosts, cpu_period_us=args.cpu_period_us) as c:
        for h in shares:
            q = cores * h / args.hosts
            c.set_cpus_per_host(q)
            load = os.getloadavg()[0]
            res = c.run_on_hosts(lambda host: [sys.executable, "-c", SPIN, seconds], timeout=120)
            got = [json.loads(line.split("] ", 1)[1]) for line in res.output.splitlines()
                   if "] {" in line]
            print("headroom %.2f: %.3f cores per host; CPU got / quota per host: %s (load %.1f)"
                  % (h, q, ", ".join("%.3f" % (g["cpu"] / g["wall"] / q) for g in got), load),
                  flush=True)
    return 0


class Progress:
    """The job's output stream: everything goes to the log; rank 0's ``bench-progress:`` lines
    are also printed, and a line every ``quiet`` seconds of silence."""

    def __init__(self, log, what, quiet=20.0):
        self.log, self.what, self.quiet = log, what, quiet
        self.t0 = self.last = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def write(self, text):
        self.log.write(text)
        for line in text.splitlines():
            if "bench-progress: " in line:
                self._say(line.split("bench-progress: ", 1)[1])

    def flush(self):
        self.log.flush()

    def _say(self, text):
        self.last = time.time()
        print("    [%s, %.0f s] %s" % (self.what, self.last - self.t0, text), flush=True)

    def _beat(self):
        while not self._stop.wait(1.0):
            if time.time() - self.last > self.quiet:
                self._say("running (starting, broadcasting, or a long step)")

    def close(self):
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------- driver
class QuotaHeldBack:
    """The hosts run without their CPU quota (at the machine's cores) from a job's start until
    its workers' warm-up ends (``<signal>.warm``); then the quota is set again and
    ``<signal>.quota`` tells the workers to go on: start-up and the warm-up's compilations, which
    nothing times, take seconds instead of a minute at a quarter of a core, and every step that
    is measured (the timed steps, and a fallback's checked decision) runs under the quota."""

    def __init__(self, cpu):
        self.cpu, self.cpus, self.period = cpu, cpu.cpus, cpu.period_us
        self.done, self.thread = threading.Event(), None

    def start(self, signal):
        self.cpu.set_cpus(max(float(os.cpu_count() or 1), self.cpus), self.period)
        self.thread = threading.Thread(target=self._watch, args=(signal,), daemon=True)
        self.thread.start()

    def _watch(self, signal):
        while not self.done.wait(0.01):
            if os.path.exists(signal + ".warm"):
                self.cpu.set_cpus(self.cpus, self.period)
                open(signal + ".quota", "w").close()
                return

    def stop(self):
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        self.cpu.set_cpus(self.cpus, self.period)  # whatever happened, the quota again


def quota_held_back(c, args):
    """A :class:`QuotaHeldBack` for a job on ``c``, or None: hosts without a quota, or with
    ``--quota-from-start``."""
    if c.cpus_per_host is None or args.quota_from_start:
        return None
    return QuotaHeldBack(c.cpu)


def run_job(c, args, model, methods, rate, log):
    """Runs the methods (all Horovod, taking turns in one job, or one DDP method); returns one
    result row per method."""
    out = tempfile.mkdtemp(prefix="bench-", dir=args.work)
    common = ["--model", model, "--method", ",".join(methods), "--steps", args.steps, "--warmup",
              args.warmup, "--batch", args.batch, "--lr", args.lr, "--out", out, "--iface", c.iface,
              "--mlp-hidden", args.mlp_hidden, "--mlp-in", args.mlp_in, "--cnn-channels",
              args.cnn_channels, "--threads", args.threads]
    if args.threshold:
        common += ["--threshold", args.threshold]
    if args.bucket_bytes is not None:
        common += ["--bucket-bytes", args.bucket_bytes]
    if args.spin_wait:
        common += ["--spin-wait"]
    if args.run_steps != 1:
        common += ["--run-steps", args.run_steps]
    # HOROVOD_GLOO_TIMEOUT_SECONDS: broadcasting the 21 M-value MLP from rank 0 to 7 hosts at
    # 100 Mbit/s takes longer than Gloo's default 30 s
    held = quota_held_back(c, args)
    if held:
        common += ["--quota-signal", os.path.join(out, "quota")]
    d = c.dilation  # a dilated cluster is D times slower: so are its timeouts
    env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": str(args.threads), "TF_CPP_MIN_LOG_LEVEL": "3",
           "GLOO_SOCKET_IFNAME": c.iface, "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(600 * max(1, d)))}
    script = os.path.abspath(__file__)
    timeout = args.job_timeout * max(1.0, d)
    throttled0 = {k: v["throttled_s"] for k, v in c.cpu_stats().items()}
    stream = Progress(log, "%s %s" % (model, ",".join(methods)))
    try:
        if held:
            held.start(os.path.join(out, "quota"))
        if kind_of(methods[0]) in HOROVOD_METHODS:
            res = c.horovodrun(1, [sys.executable, script, "--worker", "horovod"] + common,
                               timeout=timeout, env=env, stream=stream)
        else:
            master = c.hosts[0].addr
            res = c.run_on_hosts(lambda h: [sys.executable, script, "--worker", "ddp", "--rank",
                                            h.index, "--world", c.n_hosts, "--master", master,
                                            "--port", 29500] + common,
                                 timeout=timeout, env=env, stream=stream)
    finally:
        stream.close()
        if held:
            held.stop()
    throttled = {k: v["throttled_s"] - throttled0.get(k, 0.0) for k, v in c.cpu_stats().items()}
    ranks = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    shutil.rmtree(out, ignore_errors=True)
    if res.returncode != 0 or len(ranks) != c.n_hosts:
        print("  %s %s at %s FAILED (rc=%s):\n%s" % (model, ",".join(methods), rate, res.returncode,
                                                      res.output[-3000:]), flush=True)
        return [{"model": model, "method": m, "rate": rate, "failed": True,
                 "error": res.output[-1000:]} for m in methods]
    rows = []

    def per_host(per_rank, key):
        """The median over hosts of a host's median per step, in real-host seconds."""
        return statistics.median(statistics.median(r[key]) for r in per_rank) / d

    for m in methods:
        hvd_m = kind_of(m) in HOROVOD_METHODS
        per_rank = [r["methods"][m] for r in ranks]
        step_max = [max(r["times"][i] for r in per_rank) for i in range(args.steps)]
        rows.append({"model": model, "method": m, "rate": rate, "failed": False,
                     "params": ranks[0]["params"], "median_step_s": statistics.median(step_max),
                     "real_step_s": statistics.median(step_max) / d, "dilation": d,
                     # every timed step in real-host seconds, in the order they ran: the
                     # methods of a job take turns step by step, so step i of two methods pairs
                     "step_s": [t / d for t in step_max],
                     "cpus_per_host": c.cpus_per_host,
                     # where the quota held from: the job's start, or its first measured step
                     "quota_from": None if c.cpus_per_host is None else
                     "measured" if held else "start",
                     # DDP communicates inside backward: its parts cannot be told apart here
                     "compute_s": per_host(per_rank, "compute") if hvd_m else None,
                     "codec_s": per_host(per_rank, "codec") if hvd_m else None,
                     "wait_s": per_host(per_rank, "wait") if hvd_m else None,
                     "throttled_job_s": throttled,
                     "cpu_step_s": statistics.median(statistics.median(r["cpu"]) for r in per_rank),
                     "sys_step_s": statistics.median(statistics.median(r["sys"]) for r in per_rank),
                     "faults_per_step": statistics.median(statistics.median(r["faults"])
                                                          for r in per_rank),
                     "bytes_per_step": statistics.mean(r["tx"] for r in per_rank) / args.steps,
                     "eval_loss": per_rank[0]["eval_loss"],
                     "eval_loss_start": per_rank[0]["eval_loss_start"],
                     "threshold": per_rank[0]["threshold"], "job_s": res.seconds,
                     # fallback="auto": each bucket's decision and the measured link (rank 0's)
                     "fallback": per_rank[0].get("fallback")})
    return rows


def calibrate_hosts(c, args, rate, log):
    """Every host's codec rates measured at once inside the cluster, in real-host seconds, and
    a one-value allreduce among them, idle and with their cores busy
    (``examples._cluster_calibrate.calibrate_worker``): the
    step-time model's profile of this cluster's hosts
    (``horovod_twobit.advisor.cluster_profile.from_cluster``), or None where the job failed."""
    from horovod_twobit.advisor import cluster_profile
    out = tempfile.mkdtemp(prefix="calibrate-", dir=args.work)
    d = c.dilation
    env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": str(args.threads), "TF_CPP_MIN_LOG_LEVEL": "3",
           "GLOO_SOCKET_IFNAME": c.iface, "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(600 * max(1, d)))}
    stream = Progress(log, "calibrate")
    try:
        res = c.horovodrun(1, [sys.executable, os.path.abspath(__file__), "--worker", "calibrate",
                               "--out", out, "--threads", args.threads, "--steps", args.steps,
                               "--calibrate-sizes", args.calibrate_sizes,
                               "--calibrate-min-wall", args.calibrate_min_wall],
                           timeout=args.job_timeout * max(1.0, d), env=env, stream=stream)
    finally:
        stream.close()
    ranks = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    shutil.rmtree(out, ignore_errors=True)
    if res.returncode != 0 or len(ranks) != c.n_hosts:
        print("  calibration at %s FAILED (rc=%s):\n%s" % (rate, res.returncode,
                                                           res.output[-3000:]), flush=True)
        return None
    one = statistics.median(r["allreduce1_s"] for r in ranks)
    prof = cluster_profile.from_cluster([r["profile"] for r in ranks], one, c.n_hosts,
                                  name="cluster-%dh-%s" % (c.n_hosts, rate),
                                  framework_cpu=[r["framework_cpu"] for r in ranks], rate=rate,
                                  straggler_s=ranks[0]["straggler_s"],
                                  half_sum=[r["half_sum"] for r in ranks],
                                  allreduce1_loaded_s=statistics.median(
                                      r["allreduce1_loaded_s"] for r in ranks))
    prof["cluster"] = {"hosts": c.n_hosts, "rate": rate, "cpus_per_host": c.cpus_per_host,
                       "dilation": d, "allreduce1_per_host_s": [r["allreduce1_s"] for r in ranks],
                       "allreduce1_loaded_per_host_s": [r["allreduce1_loaded_s"] for r in ranks]}
    path = os.path.join(args.out, "profile-%dh-%s.json" % (c.n_hosts, rate))
    with open(path, "w") as f:
        json.dump(prof, f, indent=1, sort_keys=True)
    enc = prof["codec"]
    fw = prof["framework_s"]
    print("  calibrated %d hosts in %.0f s: one-value allreduce %.2f ms real-host "
          "(collective_s %.2f ms; %.2f ms while the hosts compute), slowest host's lead %.2f ms, "
          "message %.1f us, float16 sum %.2f ns/value (NumPy's %.2f), encode %.2f ns/value, "
          "\"auto\" encode %.2f ns/value; framework CPU per step + per tensor: %s; wrote %s" % (
              c.n_hosts, res.seconds, 1e3 * one, 1e3 * prof["collective_s"],
              1e3 * prof["collective_loaded_s"],
              1e3 * prof["straggler_s"], 1e6 * prof["message_s"],
              1e9 * prof["sum_fp16_s"], 1e9 * prof["sum_fp16_proxy_s"],
              1e9 * enc["encode"][2], 1e9 * enc["encode_auto"][2],
              ", ".join("%s %.2f ms + %.0f us" % (k, 1e3 * v[0], 1e6 * v[1])
                        for k, v in fw.items()), path), flush=True)
    return prof


def jobs(methods, args):
    """The methods grouped into jobs: the Horovod ones together (unless --job-per-method), every
    DDP method alone."""
    hvd = [m for m in methods if kind_of(m) in HOROVOD_METHODS]
    grouped = [hvd] if hvd and not args.job_per_method else [[m] for m in hvd]
    return grouped + [[m] for m in methods if kind_of(m) not in HOROVOD_METHODS]


def fmt_bytes(b):
    return "%.2f MB" % (b / 1e6) if b >= 1e5 else "%.1f kB" % (b / 1e3)


def table(results, args):
    lines = ["| rate | model | method | median step, measured (s) | real-host step (s) | speed-up "
             "vs Horovod none | compute / codec / waiting per host (s) | CPU per host per step (s) "
             "| sent per host per step | loss after %d steps (start) |"
             % (args.warmup + args.steps), "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r["rate"], r["model"]): r for r in results if r["method"] == "none" and not r["failed"]}
    for r in results:
        kind, tag = kind_of(r["method"]), r["method"][len(kind_of(r["method"])):]
        label = ALL_METHODS[kind] + (" " + tag if tag else "")
        if (kind in TWOBIT or kind in DDP_TWOBIT) and r.get("threshold"):
            label += " (t=%g)" % r["threshold"]
        if r["failed"]:
            lines.append("| %s | %s | %s | failed | | | | | | |" % (r["rate"], r["model"], label))
            continue
        b = base.get((r["rate"], r["model"]))
        real = r.get("real_step_s", r["median_step_s"])
        speed = "%.2fx" % (b.get("real_step_s", b["median_step_s"]) / real) if b else ""
        cpu = "%.3f" % r["cpu_step_s"] if "cpu_step_s" in r else ""
        parts = ("%.3f / %.3f / %.3f" % (r["compute_s"], r["codec_s"], r["wait_s"])
                 if r.get("compute_s") is not None else "")
        lines.append("| %s | %s (%s params) | %s | %.3f | %.3f | %s | %s | %s | %s | %.4f (%.4f) |" % (
            r["rate"], r["model"], "%.1fM" % (r["params"] / 1e6) if r["params"] >= 1e6
            else "%.1fk" % (r["params"] / 1e3), label, r["median_step_s"], real, speed, parts, cpu,
            fmt_bytes(r["bytes_per_step"]), r["eval_loss"], r["eval_loss_start"]))
    return "\n".join(lines)


def plot(results, path, hosts):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if not r["failed"]]
    models = list(dict.fromkeys(r["model"] for r in ok))
    rates = list(dict.fromkeys(r["rate"] for r in ok))
    if not ok:
        return
    fig, axes = plt.subplots(len(models), len(rates), figsize=(5.5 * len(rates), 4 * len(models)),
                             squeeze=False)
    for i, model in enumerate(models):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            rows = [r for r in ok if r["model"] == model and r["rate"] == rate]
            names = [kind_of(r["method"]) for r in rows]
            colors = ["tab:red" if n in TWOBIT or n in DDP_TWOBIT else "tab:blue" if n in HOROVOD_METHODS
                      else "tab:gray" for n in names]
            bars = ax.bar(range(len(rows)), [r.get("real_step_s", r["median_step_s"]) for r in rows],
                          color=colors)
            for b_, r in zip(bars, rows):
                ax.annotate(fmt_bytes(r["bytes_per_step"]), (b_.get_x() + b_.get_width() / 2,
                                                             b_.get_height()),
                            ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(names, rotation=30, ha="right")
            ax.set_ylabel("median step, real-host equivalent (s)")
            ax.set_title("%s @ %s" % (model, rate))
    fig.suptitle("%d-host virtual cluster: median step time (bars), bytes sent per host per step "
                 "(labels); red = TwoBit, blue = Horovod, gray = DDP" % hosts)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine():
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        cpu = "?"
    import torch
    return "%s, %d cores (%s), Linux %s, Python %s, torch %s" % (
        platform.node() or "?", os.cpu_count(), cpu, platform.release(),
        platform.python_version(), torch.__version__)


def driver(args):
    from horovod_twobit.cluster import VirtualCluster, unavailable_reason
    reason = unavailable_reason()
    if reason:
        print("bench_cluster: %s" % reason, file=sys.stderr)
        return 2
    methods = [m for m in args.methods.split(",") if m]
    # METHOD#TAG: another instance of a Horovod method (an A/A pair), in the same job
    bad = [m for m in methods if kind_of(m) not in ALL_METHODS
           or (m != kind_of(m) and kind_of(m) not in HOROVOD_METHODS)]
    if bad:
        print("unknown methods %s (choose from %s)" % (bad, ", ".join(ALL_METHODS)), file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    previous = []
    if args.append and os.path.exists(os.path.join(args.out, "bench_cluster.json")):
        with open(os.path.join(args.out, "bench_cluster.json")) as f:
            previous = json.load(f)["results"]
    args.work = tempfile.mkdtemp(prefix="bench-cluster-")
    log = open(os.path.join(args.out, "bench_cluster.log"), "w")
    results = []
    profiles, failed_calibrations = {}, []
    if args.append and os.path.exists(os.path.join(args.out, "bench_cluster.json")):
        with open(os.path.join(args.out, "bench_cluster.json")) as f:
            profiles = json.load(f).get("profiles", {})
    cpus, dilation = emulation(args)
    started = time.time()
    try:
        for rate in args.rates.split(","):
            with VirtualCluster(n_hosts=args.hosts, rate=rate, iface=args.iface, subnet=args.subnet,
                                cpus_per_host=cpus, dilation=dilation,
                                cpu_period_us=args.cpu_period_us) as c:
                print(c.describe(), flush=True)
                if args.calibrate:
                    prof = calibrate_hosts(c, args, rate, log)
                    if prof is None:
                        failed_calibrations.append(rate)
                    else:
                        profiles[rate] = prof
                for model in [m for m in args.models.split(",") if m]:
                    for group in jobs(methods, args):
                        t0 = time.time()
                        rows = run_job(c, args, model, group, rate, log)
                        results += rows
                        for r in rows:
                            if not r["failed"]:
                                print("  %-4s %-13s %-7s step %.3f s measured, %.3f s real-host "
                                      "(compute/codec/wait %s), CPU %.3f s, %s/step/host, loss "
                                      "%.4f (job %.0f s)" % (
                                          model, r["method"], rate, r["median_step_s"],
                                          r["real_step_s"], "n/a" if r["compute_s"] is None else
                                          "%.3f/%.3f/%.3f" % (r["compute_s"], r["codec_s"],
                                                              r["wait_s"]),
                                          r["cpu_step_s"], fmt_bytes(r["bytes_per_step"]),
                                          r["eval_loss"], time.time() - t0), flush=True)
        print("benchmark took %.0f s" % (time.time() - started), flush=True)
    finally:
        log.close()
        shutil.rmtree(args.work, ignore_errors=True)
    if previous:  # new rows replace the same (rate, model, method); order: rate, model, method
        new = {(r["rate"], r["model"], r["method"]) for r in results}
        results = [r for r in previous if (r["rate"], r["model"], r["method"]) not in new] + results
        order = list(ALL_METHODS)
        rates = list(dict.fromkeys(r["rate"] for r in previous + results))
        results.sort(key=lambda r: (rates.index(r["rate"]), r["model"] != "mlp", r["model"],
                                    order.index(kind_of(r["method"])), r["method"]))
        methods = list(dict.fromkeys(r["method"] for r in results))
    emulated = ("Every host had a hard CPU quota of %.3g cores (its own CPU cgroup) and the "
                "cluster ran with time dilation %.3g (links at rate / %.3g): each host stands for "
                "a host with %.3g cores on the real-world link, and the real-host step is the "
                "measured one / %.3g; compute, codec and waiting are real-host seconds, CPU is "
                "CPU seconds." % (cpus, dilation, dilation, cpus * dilation, dilation)
                if cpus else "No CPU quota: the hosts share the cores as they come (dilation %g)."
                % dilation)
    md = ["# horovod-twobit: %d-host virtual cluster benchmark" % args.hosts, "",
          "Machine: %s. All %d hosts share these cores. %s" % (machine(), args.hosts, emulated),
          "Steps: %d warm-up + %d timed, batch %d per host, SGD lr %g, %s; median over the timed "
          "steps of the slowest host's step time; CPU = the median of a host's process CPU time "
          "per step (all its threads), median over hosts; bytes = the host's interface tx "
          "counter around the timed steps (headers and control traffic included), mean over "
          "hosts." % (args.warmup, args.steps, args.batch, args.lr,
                      "one job per method" if args.job_per_method else
                      "the Horovod methods of a model in one job, taking turns step by step"
                      if args.run_steps == 1 else
                      "the Horovod methods of a model in one job, taking turns of %d steps in a "
                      "row" % args.run_steps), "",
          table(results, args), ""]
    if "ddp_quant" in methods:
        md += ["\\* torch's hook fails on gloo in torch 2.13 (it reads `fut.wait()[0]`, rank 0's "
               "tensor, as the list of all ranks', and with several buckets its callback-issued "
               "all_gathers can hang); this runs the same algorithm (same bytes) with both "
               "all_gathers issued in the hook, in bucket order, without overlap.", ""]
    if "ddp_powersgd" in methods or "ddp_powersgd4" in methods:
        md += ["\\*\\* rank 1 (ddp_powersgd4: rank 4), compressing from step 2 on (warm-up "
               "steps are plain allreduce), with one DDP bucket for the whole model: with "
               "several buckets its callback-issued allreduces reach gloo in different orders on "
               "different ranks and the job crashes (torch 2.13).", ""]
    text = "\n".join(md)
    print("\n" + text)
    with open(os.path.join(args.out, "bench_cluster.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "bench_cluster.json"), "w") as f:
        json.dump({"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "work"},
                   "results": results, "profiles": profiles}, f, indent=1)
    plot(results, os.path.join(args.out, "bench_cluster.png"), args.hosts)
    print("wrote %s/bench_cluster.{md,png,json}" % args.out)
    return 0 if all(not r["failed"] for r in results) and not failed_calibrations else 1


def parser():
    """The command line (driver and worker options); tests build their ``args`` from it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rates", default="100mbit,1gbit", help="comma-separated tc rates")
    ap.add_argument("--models", default="mlp,cnn",
                    help="mlp (>= 20M params), cnn (small), resnet (53 tensors, BatchNorm), "
                         "transformer (99 tensors, LayerNorm); digits, charlstm: "
                         "examples/convergence.py's MLP and LSTM on their data, with the "
                         "time-to-accuracy study's optimizers (examples/time_to_accuracy.py)")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help="comma-separated, from: %s; a Horovod method followed by #TAG is "
                         "another instance of it (an A/A pair)" % ", ".join(ALL_METHODS))
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (PowerSGD starts "
                                                           "compressing at step 2)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--threshold", type=float, default=None,
                    help="TwoBit threshold (default: %s)" % THRESHOLDS)
    ap.add_argument("--bucket-bytes", type=int, default=None,
                    help="TwoBitCompressor's bucket_bytes (default: its own default)")
    ap.add_argument("--mlp-hidden", type=int, default=4096)
    ap.add_argument("--mlp-in", type=int, default=1024)
    ap.add_argument("--cnn-channels", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per host")
    ap.add_argument("--cpus-per-host", type=float, default=None, metavar="Q",
                    help="hard CPU quota per host in cores (default: cores x headroom / hosts); "
                         "0: none, the hosts share the cores as they come")
    ap.add_argument("--dilation", type=float, default=None, metavar="D",
                    help="time dilation: links at rate / D (default 1 / Q, so that a host stands "
                         "for a 1-core host; 1 without a quota)")
    ap.add_argument("--cpu-period-us", type=int, default=10000,
                    help="CFS period of the quota (default %(default)s: a step of the small models "
                         "lasts about 0.1 s on a dilated cluster, and a host that has used its "
                         "quota waits up to a period; with the kernel's 100 ms the CNN's steps "
                         "scattered by up to 50 %%)")
    ap.add_argument("--headroom", type=float, default=HEADROOM,
                    help="share of the machine's cores the default quotas add up to (default "
                         "%(default)s)")
    ap.add_argument("--job-timeout", type=float, default=900)
    ap.add_argument("--iface", default="hvd0")
    ap.add_argument("--subnet", default="10.77.0.0/24")
    ap.add_argument("--out", default=os.path.join(REPO, "build", "bench_cluster"))
    ap.add_argument("--spin-wait", action="store_true",
                    help="keep Horovod's spinning wait for every method (default: every method "
                         "waits with short sleeps, as if each host had its own cores)")
    ap.add_argument("--run-steps", type=int, default=1, metavar="K",
                    help="timed steps a method runs in a row, after one barrier, before the next "
                         "method's turn (default 1: the methods take turns step by step, each "
                         "step after a barrier); K > 1 times steps as training runs them")
    ap.add_argument("--job-per-method", action="store_true",
                    help="one horovodrun job per Horovod method instead of one per model with the "
                         "methods taking turns step by step")
    ap.add_argument("--append", action="store_true",
                    help="merge into <out>/bench_cluster.json: rows of this run replace the same "
                         "rate/model/method, the others stay")
    ap.add_argument("--calibrate", action="store_true",
                    help="first, on every cluster (rate), measure the hosts' codec rates and a "
                         "one-value allreduce (idle, and with the hosts' cores busy) in real-host "
                         "seconds: the step-time model's profile "
                         "of these hosts (<out>/profile-<N>h-<rate>.json, and \"profiles\" in "
                         "bench_cluster.json, which `advise validate` uses); --models '' runs "
                         "only this")
    ap.add_argument("--calibrate-sizes", default="4096,65536,262144,1048576,4194304,16777216",
                    help="bucket sizes (values) --calibrate times (default %(default)s)")
    ap.add_argument("--calibrate-min-wall", type=float, default=0.25,
                    help="wall seconds each of --calibrate's readings spans at least, many CPU "
                         "quota periods (default %(default)s)")
    ap.add_argument("--measure-headroom", action="store_true",
                    help="only measure: every host spins at quotas adding up to 1.0 ... 0.5 of "
                         "the cores and the CPU each got is printed against its quota")
    ap.add_argument("--quota-from-start", action="store_true",
                    help="hold the hosts' CPU quota from each job's start (default: start-up and "
                         "the warm-up steps run at the machine's cores, the quota from the first "
                         "measured step: a fallback's checked decision and the timed steps)")
    # worker mode (started by the driver in every host)
    ap.add_argument("--quota-signal", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["horovod", "ddp", "calibrate"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    if args.worker == "calibrate":
        return calibrate_worker(args)
    if args.worker:
        return worker(args)
    if args.measure_headroom:
        return measure_headroom(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
