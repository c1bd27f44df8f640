"""Codec cost per step for a model's tensors, bucketed and alone: encode + finish of every tensor
of a ResNet-style CNN (53 tensors) or a transformer encoder (101), N ranks simulated in one process
(no communication), on the CPU or a GPU.

    python -m horovod_twobit.benchmarks.buckets --device cuda --model cnn,transformer

Prints, per model and threshold, the median time of one step's codec work with every tensor alone
and in one bucket.
"""

import argparse
import statistics
import time

import torch

from horovod_twobit.wire.layout import Layout
from horovod_twobit.torch import codec

# parameter sizes of examples/bench_buckets.py's PyTorch models
MODELS = {
    "cnn": [864, 32, 32] + [9216, 32, 32, 9216, 32, 32] * 8 + [320, 10],
    "transformer": [6400] + [12288, 192, 4096, 64, 8192, 128, 8192, 64, 64, 64, 64, 64] * 8
                   + [640, 10],
}


def step_time(sizes, threshold, device, nranks, repeat, bucketed):
    groups = [sizes] if bucketed else [[n] for n in sizes]
    auto = threshold == "auto"
    lays = [Layout(g, auto, 64 if auto else None, 64 if auto else None) for g in groups]
    rs = [[torch.zeros(lay.values, device=device) for _ in range(nranks)] for lay in lays]
    gs = [torch.randn(lay.values, device=device) * 0.01 for lay in lays]
    payloads = [torch.empty(lay.payload_words, dtype=torch.int32, device=device) for lay in lays]

    def one():
        for lay, r, g, p in zip(lays, rs, gs, payloads):
            t, v = codec.encode_payload(lay, r[0], g, threshold, "lsq", p)
            gathered = p.repeat(nranks)
            codec.finish_payload(lay, gathered, nranks, ["t"] * lay.members, r[0], g.clone(), t, v,
                                 nranks, 1.0)

    times = []
    for i in range(repeat + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        one()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="cnn,transformer")
    ap.add_argument("--thresholds", default="0.01,auto")
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print("| model | tensors | threshold | alone (ms) | bucketed (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for model in args.model.split(","):
        sizes = MODELS[model]
        for th in args.thresholds.split(","):
            th = th if th == "auto" else float(th)
            a = step_time(sizes, th, args.device, args.nranks, args.repeat, False)
            b = step_time(sizes, th, args.device, args.nranks, args.repeat, True)
            print("| %s | %d | %s | %.2f | %.2f | %.1fx |" % (model, len(sizes), th, 1e3 * a,
                                                            1e3 * b, a / b), flush=True)


if __name__ == "__main__":
    main()
