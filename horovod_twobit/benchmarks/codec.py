"""Codec throughput against the machine's own memory bandwidth.

    python -m horovod_twobit.benchmarks.codec [--sizes 1K,64K,1M,16M,64M] [--ranks 2] [--device cpu,cuda]

For each size and device it prints, in GB/s of float32 gradient (4 bytes per value):
- encode: one step of error feedback and packing (``quantize_pack`` + ``commit``: read g and r,
  write the packed words, write r),
- decode-sum: decoding and summing the payloads of ``--ranks`` ranks into one float32 output,
- probe: an in-place ``r.add_(g)`` over the same bytes (read g and r, write r), the memory
  bandwidth a fused pass can hope for,
and each codec figure as a percentage of the probe, for the compiled and the eager path.
"""

import argparse
import statistics
import time

import torch

from horovod_twobit.torch import codec, kernels


def _parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def _time_round_robin(fns, device, min_time=0.5, max_rounds=200):
    """Median seconds of each function, timed in turns (one call of each per round), so that all
    see the same load on a shared machine."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    for fn in fns:  # warm-up (and compilation)
        fn()
    sync()
    times = [[] for _ in fns]
    t_end = time.perf_counter() + min_time * len(fns)
    while len(times[0]) < 5 or (time.perf_counter() < t_end and len(times[0]) < max_rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            sync()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def measure(n, device, ranks=2, path="compiled", threshold=0.5):
    """Returns a dict of GB/s figures for one size, device and path."""
    old = kernels.COMPILE_MIN_NUMEL
    kernels.COMPILE_MIN_NUMEL = 0 if path == "compiled" else 1 << 62
    try:
        g = torch.randn(n, device=device)
        r = torch.zeros(n, device=device)
        words, _ = codec.quantize_pack(g, r, threshold)
        rows = [words.clone() for _ in range(ranks)]

        def encode():
            codec.quantize_pack(g, r, threshold)
            codec.commit(g, r, threshold)

        t_enc, t_dec, t_probe = _time_round_robin(
            [encode, lambda: kernels.decode_sum(rows, [threshold] * ranks, n, ranks),
             lambda: r.add_(g)], device)
    finally:
        kernels.COMPILE_MIN_NUMEL = old
    gb = 4 * n / 1e9
    return {"encode": gb / t_enc, "decode": gb / t_dec, "probe": gb / t_probe}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1K,64K,1M,16M,64M")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", default="cpu,cuda")
    p.add_argument("--paths", default="compiled,eager")
    p.add_argument("--markdown", help="also write the table to this file")
    args = p.parse_args(argv)
    devices = [torch.device(d) for d in args.device.split(",")
               if d != "cuda" or torch.cuda.is_available()]
    rows = []
    header = ("| device | values | path | encode GB/s | decode-sum GB/s | probe GB/s "
              "| encode / probe | decode-sum / probe |")
    print(header)
    print("|" + "---|" * 8)
    for dev in devices:
        for s in args.sizes.split(","):
            n = _parse_size(s)
            for path in args.paths.split(","):
                m = measure(n, dev, args.ranks, path)
                line = "| %s | %s | %s | %.2f | %.2f | %.2f | %.0f %% | %.0f %% |" % (
                    dev.type, s.strip(), path, m["encode"], m["decode"], m["probe"],
                    100 * m["encode"] / m["probe"], 100 * m["decode"] / m["probe"])
                print(line, flush=True)
                rows.append(line)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join([header, "|" + "---|" * 8] + rows) + "\n")


if __name__ == "__main__":
    main()
