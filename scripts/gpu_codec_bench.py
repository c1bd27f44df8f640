"""The PyTorch codec's passes on one device, as the communicator calls them (``codec.encode_payload``,
``codec.finish_payload``, the scatter owner's ``owner_reduce``), with the Triton kernels and with
the compiled torch ops (HOROVOD_TWOBIT_TRITON=0's path), against the same run's probe
(``r.add_(g)``: read g and r, write r). scripts/gpu_check.sh runs it on a GPU.

    python scripts/gpu_codec_bench.py [--device cuda] [--sizes 1M,16M,64M,256M]
        [--model-values 25M] [--bucket-bytes 4M] [--paths triton,torch] [--json FILE]

Rows, in GB/s of float32 gradient (4 bytes a value) and as a share of the probe:
- ``tensor``: one tensor of n values, fixed threshold 0.5 and "auto" (its default blocks):
  encode, finish with 2 and 8 ranks' payloads, the scatter owner's reduce of 8 senders' chunks
  (n / 8 values each: its GB/s counts the 8 chunks' values);
- ``model``: one step's codec for a model of ``--model-values`` values in tensors of ResNet-50's
  sizes, in buckets of ``--bucket-bytes``: every bucket's encode and finish (2 and 8 ranks),
  in ms, and how many times its bytes at the probe's rate it takes (encode reads r and g and
  writes 2 bits; finish reads r, g and N payloads and writes r and the result: (24.25 + N / 4)
  bytes a value; the probe moves 12 bytes a value).
Under TRITON_INTERPRET=1 (CPU tensors) it runs, slowly, for a check of the script itself.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from horovod_twobit import wire  # noqa: E402
from horovod_twobit.benchmarks.timing import parse_size, time_round_robin  # noqa: E402
from horovod_twobit.torch import codec  # noqa: E402
from horovod_twobit.torch.codec import compiled, scatter as scatter_codec  # noqa: E402
from horovod_twobit.wire import scatter as sw  # noqa: E402
from horovod_twobit.wire.layout import Layout, model_layouts  # noqa: E402

# ResNet-50's parameter tensors (values), largest first; repeated and cut to the model's size
RESNET50 = [2048000, 2359296, 1048576, 1048576, 589824, 524288, 262144, 147456, 131072, 65536,
            36864, 32768, 16384, 9408, 2048, 2048, 1024, 1024, 512, 512, 256, 256, 128, 64]


def _path(name):
    compiled.TRITON = "force" if name == "triton" else "0"
    if name == "triton" and compiled.triton_path(torch.device("cuda")) is None:
        raise RuntimeError("Triton does not import")


def tensor_rows(n, threshold, device, paths, min_time, min_rounds=5):
    """One tensor of ``n`` values: {path: {encode, finish2, finish8, owner8, probe}} in seconds."""
    auto = threshold == "auto"
    lay = Layout([n], auto, *wire.validate_blocks(threshold))
    g = torch.randn(n, device=device) * 0.3
    r = torch.zeros(n, device=device)
    payload = torch.empty(lay.payload_words, dtype=torch.int32, device=device)
    work = g.clone()
    out = {}
    for name in paths:
        _path(name)
        t, v = codec.encode_payload(lay, r, g, threshold, "lsq", payload)
        gathered = {N: payload.repeat(N) for N in (2, 8)}
        chunks = sw.Chunks(lay, 8)
        send, splits = scatter_codec.chunk_payloads(chunks, payload, threshold)
        own = send[:int(splits[0])].repeat(8)
        owner_r = torch.zeros(chunks.values(0), device=device) if auto else None
        fns = [lambda: codec.encode_payload(lay, r, g, threshold, "lsq", payload),
               lambda: codec.finish_payload(lay, gathered[2], 2, ["t"], r, work, t, v, 2, 1.0),
               lambda: codec.finish_payload(lay, gathered[8], 8, ["t"], r, work, t, v, 8, 1.0),
               lambda: scatter_codec.owner_reduce(chunks, own, [int(splits[0])] * 8, ["t"], 0,
                                                  threshold, "lsq", owner_r),
               lambda: r.add_(g)]
        secs = time_round_robin(fns, torch.device(device), min_time=min_time,
                                min_rounds=min_rounds)
        secs[3] *= 8  # one owner's chunk is an eighth of the values
        out[name] = dict(zip(["encode", "finish2", "finish8", "owner8", "probe"], secs))
        r.zero_()
    return out


def model_rows(values, bucket_bytes, threshold, device, paths, min_time, min_rounds=5):
    """One step's codec over a model's buckets: {path: {step2, step8, probe}} in seconds, the
    probe over the model's values."""
    sizes, total = [], 0
    while total < values:
        for n in RESNET50:
            n = min(n, values - total)
            if n > 0:
                sizes.append(n)
                total += n
    lays = model_layouts(sizes, threshold, bucket_bytes)
    bufs = []
    for lay in lays:
        g = torch.randn(lay.values, device=device) * 0.3
        bufs.append((lay, torch.zeros(lay.values, device=device), g, g.clone(),
                     torch.empty(lay.payload_words, dtype=torch.int32, device=device)))
    big_g, big_r = torch.randn(total, device=device), torch.zeros(total, device=device)
    out = {}
    for name in paths:
        _path(name)

        # each bucket's gathered payloads, as the collective would hand them (made once, so
        # the step times the codec, not a copy)
        gathered = {}
        for lay, r, g, work, p in bufs:
            codec.encode_payload(lay, r, g, threshold, "lsq", p)
            for N in (2, 8):
                gathered[id(p), N] = p.repeat(N)

        def step(N):
            for lay, r, g, work, p in bufs:
                t, v = codec.encode_payload(lay, r, g, threshold, "lsq", p)
                codec.finish_payload(lay, gathered[id(p), N], N, ["t"] * lay.members, r, work, t,
                                     v, N, 1.0)
        secs = time_round_robin([lambda: step(2), lambda: step(8), lambda: big_r.add_(big_g)],
                                torch.device(device), min_time=min_time, min_rounds=min_rounds)
        out[name] = dict(zip(["step2", "step8", "probe"], secs))
    return out, total, len(lays)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", default="1M,16M,64M,256M")
    p.add_argument("--thresholds", default="0.5,auto")
    p.add_argument("--model-values", default="25M")
    p.add_argument("--bucket-bytes", default="4M")
    p.add_argument("--paths", default="triton,torch")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per function and size")
    p.add_argument("--min-rounds", type=int, default=5, help="calls of each function at least")
    p.add_argument("--json", help="write the figures there too")
    args = p.parse_args(argv)
    paths = args.paths.split(",")
    thresholds = [t if t == "auto" else float(t) for t in args.thresholds.split(",")]
    rows, record = [], {"device": args.device, "tensor": [], "model": []}
    if args.device.startswith("cuda"):
        record["device_name"] = torch.cuda.get_device_name(0)
    record["torch"] = torch.__version__
    head = ("| rows | values | threshold | path | encode GB/s | finish 2 GB/s | finish 8 GB/s | "
            "owner 8 GB/s | probe GB/s | encode / probe | finish 2 / probe | 1 M call us |")
    for size in args.sizes.split(","):
        n = parse_size(size)
        for thr in thresholds:
            res = tensor_rows(n, thr, args.device, paths, args.min_time, args.min_rounds)
            for name, s in res.items():
                gb = 4 * n / 1e9
                rate = {k: gb / x for k, x in s.items()}
                rows.append("| tensor | %s | %s | %s | %.3g | %.3g | %.3g | %.3g | %.3g | %.0f %% | "
                            "%.0f %% | %s |" % (size, thr, name, rate["encode"], rate["finish2"],
                                                rate["finish8"], rate["owner8"], rate["probe"],
                                                100 * rate["encode"] / rate["probe"],
                                                100 * rate["finish2"] / rate["probe"],
                                                "%.0f / %.0f" % (1e6 * s["encode"], 1e6 * s["finish2"])
                                                if n == 1 << 20 else ""))
                record["tensor"].append(dict(values=n, threshold=thr, path=name, **s))
            print(rows[-1], flush=True)
    mhead = ("| model | values | threshold | path | buckets | step, 2 ranks ms | x its bytes at the "
             "probe's rate | step, 8 ranks ms | x its bytes | probe ms |")
    mrows = []
    for thr in thresholds:
        res, total, nb = model_rows(parse_size(args.model_values), parse_size(args.bucket_bytes),
                                    thr, args.device, paths, args.min_time, args.min_rounds)
        for name, s in res.items():
            per_byte = s["probe"] / (12.0 * total)
            x2 = s["step2"] / ((24.25 + 0.5) * total * per_byte)
            x8 = s["step8"] / ((24.25 + 2.0) * total * per_byte)
            mrows.append("| model | %s | %s | %s | %d | %.3f | %.2f | %.3f | %.2f | %.3f |" % (
                args.model_values, thr, name, nb, 1e3 * s["step2"], x2, 1e3 * s["step8"], x8,
                1e3 * s["probe"]))
            record["model"].append(dict(values=total, threshold=thr, path=name, buckets=nb, **s))
            print(mrows[-1], flush=True)
    print()
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    print("\n".join(rows))
    print()
    print(mhead)
    print("|" + "---|" * (mhead.count("|") - 1))
    print("\n".join(mrows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
