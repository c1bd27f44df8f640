"""fallback="auto" on one rank (a job started without horovodrun, or -np 1): every bucket goes
plain without measuring a link (there is none), and the results are the gradients themselves.
Prints one JSON line per framework."""

import json
import sys

import numpy as np


def torch_case():
    import torch
    import horovod.torch as hvd
    from horovod_twobit.torch import TwoBitCompressor
    hvd.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    comp = TwoBitCompressor(0.05, fallback="auto")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0),
                                   named_parameters=net.named_parameters(), compression=comp)
    x = torch.randn(5, 8)
    same = []
    for _ in range(4):
        opt.zero_grad()
        net(x).square().sum().backward()
        local = [p.grad.clone() for p in net.parameters()]
        opt.synchronize()
        same.append(all(torch.equal(a, p.grad) for a, p in zip(local, net.parameters())))
        with opt.skip_synchronize():
            opt.step()
    # Horovod's optimizer does not reduce on one rank; a direct allreduce does
    direct = TwoBitCompressor(0.05, fallback="auto")
    t = torch.randn(1000)
    for _ in range(3):
        same.append(torch.equal(hvd.allreduce(t, compression=direct, name="t", op=hvd.Sum), t))
    return {"size": hvd.size(), "same": same, "decisions": sorted(set(direct.decisions.values())),
            "links": len(comp.state._links) + len(direct.state._links)}


def tf_case():
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from horovod_twobit.tensorflow import TwoBitCompressor
    hvd.init()
    tf.random.set_seed(0)
    net = tf.keras.Sequential([tf.keras.layers.Dense(16), tf.keras.layers.Dense(4)])
    net.build((None, 8))
    comp = TwoBitCompressor(0.05, fallback="auto")
    x = tf.random.normal((5, 8))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(net(x)))
        local = tape.gradient(loss, net.trainable_variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(net(x)))
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        return local, tape.gradient(loss, net.trainable_variables)

    same = []
    for _ in range(4):
        local, reduced = step()
        same.append(all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(local, reduced)))
    return {"size": hvd.size(), "same": same, "decisions": sorted(set(comp.decisions.values())),
            "links": len(comp.state.links)}


if __name__ == "__main__":
    case = {"torch": torch_case, "tf": tf_case}[sys.argv[1]]
    print("RESULT " + json.dumps(case()))
