"""The worker side of ``examples/bench_cluster.py``: the models, torch's quantization hook fixed
for gloo, and the training loop each host runs.

Horovod methods of one model share one job (``--method a,b,c``): every method builds its own copy
of the model (same initial weights, its own tensor names) and the methods take turns step by step
(step i of every method, in an order that rotates with i, each step after a barrier), so a change
in the machine's load falls on every method alike. For each method and step the worker records the wall time, the CPU time of
its process (all its threads: the training thread and Horovod's) and the bytes its host's
interface sent and received, and splits the step into compute (forward and backward, less the
codec's part of it), codec (TwoBit's encode and decode, timed around the codec's functions, see
``CodecClock``) and waiting (the rest: the exchange, and the host's CPU quota where it is out).
Rank 0 prints a ``bench-progress:`` line after every step. DDP methods run one per job.
"""

import json
import os
import resource
import threading
import time

# the TwoBitCompressor methods: (fixed threshold or "auto", exchange)
TWOBIT = {"twobit": ("fixed", "allgather"), "auto": ("auto", "allgather"),
          "scatter": ("fixed", "scatter"), "scatter_auto": ("auto", "scatter"),
          "twobit_fallback": ("fixed", "allgather"), "auto_fallback": ("auto", "allgather"),
          "twobit_always": ("fixed", "allgather")}


def kind_of(method):
    """A method's kind: ``twobit#2``, another instance of ``twobit`` (its own model and names:
    an A/A pair with it, the bench's own spread), is ``twobit``."""
    return method.split("#")[0]


# about 3x the mean |gradient| of each model at step 0
THRESHOLDS = {"mlp": 1e-3, "cnn": 1e-2, "resnet": 1e-2, "transformer": 1e-2, "digits": 7e-3,
              "charlstm": 6e-4}
# models with many small tensors, from examples/bench_buckets.py (its names)
MANY_TENSORS = {"resnet": "cnn", "transformer": "transformer"}
# the time-to-accuracy study's models (examples/time_to_accuracy.py): examples/convergence.py's
# digits MLP and character LSTM, on their own data, cross-entropy, each with the study's
# optimizer (convergence.OPTIMIZERS[model][optimizer], not --lr) and the LSTM's gradient clipping
STUDY_MODELS = {"digits": ("mlp", "momentum"), "charlstm": ("lstm", "adam")}
# this project's DDP hook: (threshold, exchange), as TWOBIT's Horovod rows
DDP_TWOBIT = {"ddp_twobit": ("fixed", "allgather"), "ddp_twobit_auto": ("auto", "allgather"),
              "ddp_twobit_scatter": ("fixed", "scatter"),
              "ddp_twobit_scatter_auto": ("auto", "scatter")}
# DDP's PowerSGD rows: the rank of the approximation
POWERSGD_RANKS = {"ddp_powersgd": 1, "ddp_powersgd4": 4}


class CodecClock:
    """Wall seconds spent in TwoBit's codec (any thread): wraps the module functions the
    exchanges call for encoding, the scatter owners' reduction and decoding. Measurement only;
    the functions' results are untouched."""

    FUNCTIONS = {"codec": ("encode_payload", "finish_payload"),
                 "codec.scatter": ("chunk_payloads", "owner_reduce", "finish_reduced")}

    def __init__(self):
        self.seconds = 0.0
        self._lock = threading.Lock()
        import importlib
        for mod, names in self.FUNCTIONS.items():
            m = importlib.import_module("horovod_twobit.torch." + mod)
            for name in names:
                setattr(m, name, self._timed(getattr(m, name)))

    def _timed(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    self.seconds += dt
        timed.__wrapped__ = fn
        return timed


def progress(rank, text):
    if rank == 0:
        print("bench-progress: " + text, flush=True)


def build(model, args):
    """(net, batch): the model, and batch(rank, step, size) -> (x, y), a regression onto a fixed
    random linear map of the inputs (a teacher), the same on every run."""
    import torch
    torch.manual_seed(0)
    nn = torch.nn
    if model in MANY_TENSORS:  # examples/bench_buckets.py's models, many small tensors
        from examples.bench_buckets import torch_model
        net, data, _ = torch_model(MANY_TENSORS[model])
        if model == "transformer":  # token ids: the teacher reads their one-hot average
            t = teacher((100,))

            def batch(rank, step, size):
                g = torch.Generator().manual_seed(100003 * rank + step)
                x = torch.randint(0, 100, (size, 32), generator=g)
                return x, torch.nn.functional.one_hot(x, 100).float().mean(1) @ t
            return net, batch
        shape = (3, 16, 16)
    elif model == "mlp":
        h = args.mlp_hidden
        net = nn.Sequential(nn.Linear(args.mlp_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                            nn.Linear(h, 10))
        shape = (args.mlp_in,)
    elif model == "cnn":
        c = args.cnn_channels
        net = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(2 * c * 4 * 4, 10))
        shape = (3, 32, 32)
    elif model in STUDY_MODELS:
        return study_model(model)
    else:
        raise ValueError("unknown model %r (%s)" % (model, ", ".join(THRESHOLDS)))
    t = teacher(shape)

    def batch(rank, step, size):
        g = torch.Generator().manual_seed(100003 * rank + step)
        x = torch.randn((size,) + shape, generator=g)
        return x, x.reshape(size, -1) @ t
    return net, batch


def study_model(model):
    """(net, batch) of a STUDY_MODELS model: examples/convergence.py's net with its initial
    weights (seed 0), and batch(rank, step, size) -> (x, y) drawn from its training data (the
    digits' training set, whole; the text's training part)."""
    import torch
    from examples import convergence
    if model == "digits":
        xtr, ytr, _, _ = convergence.digits_data(0, 1)
        net = convergence.mlp_net()

        def batch(rank, step, size):
            g = torch.Generator().manual_seed(100003 * rank + step)
            idx = torch.randint(0, len(xtr), (size,), generator=g)
            return xtr[idx], ytr[idx]
        return net, batch
    train, _, vocab = convergence.text_data()
    net = convergence.CharLSTM(vocab)

    def batch(rank, step, size):
        g = torch.Generator().manual_seed(100003 * rank + step)
        return convergence.lstm_batch(train, torch.randint(
            0, len(train) - convergence.LSTM_SEQ - 1, (size,), generator=g))
    return net, batch


def loss_of(model, out, y):
    """The training loss: cross-entropy for STUDY_MODELS (per character for the LSTM), the
    squared error to the teacher's targets for the others."""
    if model in STUDY_MODELS:
        from examples import convergence
        return convergence.lstm_loss(out, y)  # cross-entropy over the last dimension
    return ((out - y) ** 2).mean()


def optimizer(net, args):
    """SGD at --lr, or a STUDY_MODELS model's own optimizer."""
    import torch
    if args.model in STUDY_MODELS:
        from examples import convergence
        short, kind = STUDY_MODELS[args.model]
        return convergence.base_optimizer(net, kind, convergence.OPTIMIZERS[short][kind])
    return torch.optim.SGD(net.parameters(), lr=args.lr)


def teacher(shape):
    """A fixed linear map from inputs to 10 targets: the task every method learns."""
    import torch
    g = torch.Generator().manual_seed(123)
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n, 10, generator=g) / n ** 0.5


def eval_loss(net, batch, model=None):
    import torch
    with torch.no_grad():
        x, y = batch(999, 999, 256)
        return float(loss_of(model, net(x), y))


def quantization_pertensor_hook(process_group, bucket):
    """torch's ``quantization_pertensor_hook`` (uint8 per-tensor min/max quantization, allgather,
    dequantize and average), with two fixes needed on the gloo backend (torch 2.13):

    * the stock hook indexes ``fut.wait()[0]``, which on gloo is rank 0's tensor rather than the
      list of all ranks' ("IndexError: index 2 is out of bounds" on more than 2 ranks);
    * it issues and waits for its second all_gather inside a future callback; with several
      buckets (the 21M-parameter MLP, 4 ranks) the job hung there.

    Here both all_gathers run in the hook itself, in bucket order, and the result is returned as a
    completed future: same bytes on the wire, no overlap of this bucket's exchange with backward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks import (
        _dequantize_per_tensor_backend, _quantize_per_tensor_backend)
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), group.size()
    tensor = bucket.buffer()
    observer = torch.ao.quantization.MinMaxObserver()
    observer(tensor)
    s, z = observer.calculate_qparams()
    s_and_z = torch.tensor([float(s), float(z)], dtype=torch.float32)
    all_s_and_z = [torch.zeros_like(s_and_z) for _ in range(world)]
    dist.all_gather(all_s_and_z, s_and_z, group=group)
    q = _quantize_per_tensor_backend(tensor, all_s_and_z[rank][0], all_s_and_z[rank][1])
    quantized = [torch.zeros_like(q) for _ in range(world)]
    dist.all_gather(quantized, q, group=group)
    out = torch.zeros_like(tensor, dtype=torch.float32)
    for r, qr in enumerate(quantized):
        out += _dequantize_per_tensor_backend(qr, all_s_and_z[r][0], all_s_and_z[r][1])
    fut = torch.futures.Future()
    fut.set_result((out / world).to(tensor.dtype))
    return fut


def horovod_setup(args, methods):
    """[(method, net, batch, optimizer)] for every Horovod method, and a barrier."""
    import torch
    import horovod.torch as hvd
    hvd.init()
    runs = []
    for method in methods:
        net, batch = build(args.model, args)
        if runs:  # the same start for every method, without broadcasting the model again
            net.load_state_dict(runs[0][1].state_dict())
        else:
            hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        base = kind_of(method)
        if base in TWOBIT:
            from horovod_twobit.torch import TwoBitCompressor
            kind, exchange = TWOBIT[base]
            threshold = args.threshold or THRESHOLDS[args.model]
            compression = TwoBitCompressor(threshold if kind == "fixed" else "auto",
                                           exchange=exchange, bucket_bytes=args.bucket_bytes,
                                           fallback="auto" if base.endswith("_fallback")
                                           else "always" if base.endswith("_always")
                                           else None)
        else:
            compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[base]
        opt = hvd.DistributedOptimizer(
            optimizer(net, args),
            named_parameters=[(method + "." + n, p) for n, p in net.named_parameters()],
            compression=compression)
        runs.append((method, net, net, batch, opt))

    if args.spin_wait:
        dilated_twobit_waits()  # sleeping_waits() dilates them otherwise
    else:
        sleeping_waits()

    def barrier():
        hvd.allreduce(torch.zeros(1), name="barrier", op=hvd.Sum)
    return runs, hvd.rank(), hvd.size(), barrier


def warmup_steps(method, warmup):
    """The most untimed steps of ``method``: ``warmup``, or with ``fallback="auto"`` the steps
    its checked decision may take (:func:`checking` ends them sooner), so that the timed steps
    are the mode it kept."""
    if kind_of(method).endswith("_fallback"):
        from horovod_twobit.state import fallback
        return max(warmup, fallback.start_steps())
    return warmup


def checking(run):
    """Whether ``run``'s compressor has a fallback whose checked decision is not made yet (the
    same on every rank: they decide at the same step)."""
    comp = getattr(run[4], "_compression", None)
    return (getattr(comp, "fallback", None) == "auto"
            and not comp.stats().get("fallback_checks"))


def fallback_record(compression):
    """What a ``TwoBitCompressor(..., fallback=...)`` decided, per bucket ("compressed" or
    "plain"), and the links it measured (their reprs); None for other compressions."""
    decisions = getattr(compression, "decisions", None)
    if not decisions:
        return None
    return {"decisions": {"%s, %d ranks" % key: got for key, got in decisions.items()},
            "links": [repr(link) for link in getattr(compression, "_links", {}).values()],
            "checks": compression.stats().get("fallback_checks")}


def dilation():
    """The time dilation D of the virtual cluster this process runs on (its jobs' environment,
    ``HVDTB_CLUSTER_DILATION``), 1 off one: wall seconds / D are a real host's."""
    return float(os.environ.get("HVDTB_CLUSTER_DILATION", "1") or 1)


def probe_setup(model, methods):
    """What the probes (``examples/probe_*.py``) start with on every rank: bench_cluster's worker
    options for ``model`` (its parser's defaults), one intra-op thread, :func:`horovod_setup` of
    ``methods`` and the cluster's dilation D (1 off a virtual cluster).
    Returns (worker options, runs, rank, size, barrier, D)."""
    import torch
    from examples.bench_cluster import parser as bench_parser
    wargs = bench_parser().parse_args(["--model", model])
    torch.set_num_threads(1)
    runs, rank, size, barrier = horovod_setup(wargs, methods)
    return wargs, runs, rank, size, barrier, dilation()


def dilated_twobit_waits():
    """On a dilated cluster (docs/emulation.md) a real host's polls come D times less often in
    the cluster's time: TwoBit's waits (``horovod_twobit.torch.exchange.progress``: 20 us doubling up to
    0.5 ms) then sleep D times longer. Returns (first, longest) sleep in seconds."""
    from horovod_twobit.torch.exchange import progress as twobit_waits
    d = dilation()
    twobit_waits.POLL_S = tuple(d * s for s in twobit_waits.DEFAULT_POLL_S)
    return twobit_waits.POLL_S


def sleeping_waits():
    """Makes every method's ``DistributedOptimizer`` wait by polling with short sleeps.

    Horovod's own wait spins (it yields the CPU and polls again at once). Here the hosts share
    the machine's cores, so a rank that spins while its step waits on the network takes CPU from
    the ranks that have work (their Gloo threads moving bytes, their codec): the benchmark would
    then measure the host's spinning neighbours. With a core per host that cost would not exist.
    TwoBit's own waits sleep already; this gives no compression and fp16 the same wait, so that
    the methods differ only in what they send and compute (``--spin-wait`` keeps Horovod's).
    Both poll D times less often on a dilated cluster (:func:`dilated_twobit_waits`)."""
    import horovod.torch as hvd
    import horovod.torch.optimizer as hvd_optimizer
    inner = hvd_optimizer.synchronize
    first, most = dilated_twobit_waits()

    def synchronize(handle):
        delay = first
        while isinstance(handle, int) and not hvd.poll(handle):  # Horovod's own handles
            time.sleep(delay)
            delay = min(2 * delay, most)
        return inner(handle)
    hvd_optimizer.synchronize = synchronize


def ddp_setup(args, method):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method="tcp://%s:%d" % (args.master, args.port),
                            rank=args.rank, world_size=args.world)
    net, batch = build(args.model, args)
    model = DDP(net, **ddp_options(method))  # broadcasts rank 0's parameters
    register_hook(model, method, args.threshold or THRESHOLDS.get(args.model))
    opt = optimizer(model, args)
    return [(method, net, model, batch, opt)], args.rank, args.world, dist.barrier


def ddp_options(method):
    """DistributedDataParallel's keyword arguments for a DDP method."""
    # powerSGD_hook issues its allreduces from future callbacks: with several buckets in
    # flight they reach gloo in different orders on different ranks (a collective mismatch
    # that crashes the job), so it gets one bucket for the whole model.
    return {"bucket_cap_mb": 4096} if method in POWERSGD_RANKS else {}


def register_hook(model, method, threshold=None):
    """Registers a DDP method's communication hook on ``model`` (none for "ddp"); ``threshold``:
    the fixed threshold of "ddp_twobit"."""
    if method == "ddp_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "ddp_quant":
        model.register_comm_hook(None, quantization_pertensor_hook)
    elif method in POWERSGD_RANKS:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=POWERSGD_RANKS[method],
                                            start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif method in DDP_TWOBIT:  # this project's hook (torch/ddp.py)
        from horovod_twobit.torch import ddp as twobit_ddp
        kind, exchange = DDP_TWOBIT[method]
        twobit_ddp.register(model, twobit_ddp.TwoBitState(
            "auto" if kind == "auto" else threshold, exchange=exchange))
    elif method != "ddp":
        raise ValueError("unknown DDP method %r" % method)


def study_step(model):
    """(finish_step(opt, params, clip, synchronize), clip): what a step does after the backward
    pass, examples/convergence.py's for STUDY_MODELS (the LSTM clips its gradients' norm), a
    plain ``opt.step()`` for the others."""
    if model in STUDY_MODELS:
        from examples import convergence
        return convergence.finish_step, convergence.LSTM_CLIP if model == "charlstm" else None
    return (lambda opt, params, clip, synchronize: opt.step()), None


def turns(methods, warmup, steps, in_a_row=1):
    """The timed steps' order: [(first step of the turn, [(method index, step), ...])], each
    method running ``in_a_row`` steps (the last turn fewer when they do not divide ``steps``)
    before the next, the method that goes first rotating from turn to turn."""
    in_a_row, end, out = max(1, int(in_a_row)), warmup + steps, []
    for i0 in range(warmup, end, in_a_row):
        k = (i0 // in_a_row) % methods
        out.append((i0, [(m, i) for m in list(range(k, methods)) + list(range(k))
                         for i in range(i0, min(i0 + in_a_row, end))]))
    return out


def quota_on(rank, signal, barrier, timeout=600.0):
    """Every rank's warm-up is done: rank 0 writes ``signal + ".warm"`` and waits for the driver
    (examples/bench_cluster.py), which then sets the hosts' CPU quota, to write ``signal +
    ".quota"``; every rank goes on after that (a barrier)."""
    if rank == 0:
        open(signal + ".warm", "w").close()
        deadline = time.monotonic() + timeout
        while not os.path.exists(signal + ".quota"):
            if time.monotonic() > deadline:
                raise RuntimeError("the driver set no CPU quota within %.0f s of the warm-up's "
                                   "end (%s.quota never came)" % (timeout, signal))
            time.sleep(0.01)
    barrier()


def worker(args):
    """Trains every method of ``args.method`` (comma-separated) in turns and writes
    ``<out>/rank<r>.json``: per method, the step times, CPU times, bytes and losses."""
    import torch
    from horovod_twobit.cluster import iface_bytes

    torch.set_num_threads(args.threads)
    methods = args.method.split(",")
    clock = CodecClock() if any(kind_of(m) in TWOBIT for m in methods) else None
    if args.worker == "horovod":
        runs, rank, size, barrier = horovod_setup(args, methods)
    else:
        runs, rank, size, barrier = ddp_setup(args, methods[0])
    finish_step, clip = study_step(args.model)
    rec = {m: {"times": [], "cpu": [], "sys": [], "faults": [], "tx": 0, "rx": 0,
               "train_losses": [], "compute": [], "codec": [], "wait": []} for m in methods}

    def step(run, i, r=None):
        _, _, model, batch, opt = run
        x, y = batch(rank, i, args.batch)
        k0 = clock.seconds if clock else 0.0
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(args.model, model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        k1 = clock.seconds if clock else 0.0
        finish_step(opt, model.parameters(), clip, synchronize=args.worker == "horovod")
        t2 = time.perf_counter()
        k2 = clock.seconds if clock else 0.0
        if r is not None:
            codec_s = k2 - k0
            r["compute"].append(max(0.0, t1 - t0 - (k1 - k0)))
            r["codec"].append(codec_s)
            r["wait"].append(max(0.0, t2 - t0 - r["compute"][-1] - codec_s))
        return float(loss.detach())

    def untimed(run, i):
        t0 = time.perf_counter()
        step(run, i)
        progress(rank, "%s warm-up step %d/%d: %.2f s" % (
            run[0], i + 1, warmup_steps(run[0], args.warmup), time.perf_counter() - t0))

    loss0 = eval_loss(runs[0][1], runs[0][3], args.model)
    for run in runs:  # the warm-up steps of every method (start-up's compilations)
        for i in range(args.warmup):
            untimed(run, i)
    barrier()
    if args.quota_signal:  # the driver held the hosts' CPU quota back until here
        quota_on(rank, args.quota_signal, barrier)
    for run in runs:  # under the quota: a fallback's checked decision, which measures steps
        for i in range(args.warmup, warmup_steps(run[0], args.warmup)):
            if not checking(run):
                break
            untimed(run, i)
    barrier()
    for i0, order in turns(len(runs), args.warmup, args.steps, getattr(args, "run_steps", 1)):
        for k, i in order:
            run = runs[k]
            r = rec[run[0]]
            # A rank leaves a collective once it has received everything, while what it sent can
            # still wait in its link's queue: the barrier lets that drain, so that a step neither
            # waits behind the previous method's bytes nor counts them. With --run-steps K a
            # method's K steps run in a row, as in training, after one barrier.
            if i == i0:
                barrier()
            rx0, tx0 = iface_bytes(args.iface)
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            t0, c0 = time.perf_counter(), time.process_time()
            r["train_losses"].append(step(run, i, r))
            r["times"].append(time.perf_counter() - t0)
            r["cpu"].append(time.process_time() - c0)
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            r["sys"].append(u1.ru_stime - u0.ru_stime)  # the kernel's share of "cpu"
            r["faults"].append(u1.ru_minflt - u0.ru_minflt)  # pages first touched
            rx1, tx1 = iface_bytes(args.iface)
            r["tx"] += tx1 - tx0
            r["rx"] += rx1 - rx0
        i = order[-1][1]
        progress(rank, "step %d/%d: %s" % (i - args.warmup + 1, args.steps, ", ".join(
            "%s %.2f s" % (m, rec[m]["times"][-1]) for m in methods)))
    barrier()
    for method, net, _, batch, opt in runs:
        rec[method].update(eval_loss_start=loss0, eval_loss=eval_loss(net, batch, args.model),
                           steps=args.steps,
                           threshold=(args.threshold or THRESHOLDS[args.model])
                           if dict(TWOBIT, **DDP_TWOBIT).get(kind_of(method), ("",))[0]
                           == "fixed"
                           else None,
                           fallback=fallback_record(getattr(opt, "_compression", None)))
    res = {"rank": rank, "size": size, "methods": rec,
           "params": sum(p.numel() for p in runs[0][1].parameters())}
    with open(os.path.join(args.out, "rank%d.json" % rank), "w") as f:
        json.dump(res, f)
    if args.worker == "ddp":
        from horovod_twobit.torch import ddp as twobit_ddp
        twobit_ddp.shutdown()  # a barrier, then destroy_process_group
    return 0
