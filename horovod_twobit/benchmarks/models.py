"""The models of ``examples/bench_buckets.py`` (its docstring describes them; ``bench_cluster.py``
and ``bench_levels.py`` run them too), in PyTorch and Keras: many small parameter tensors each."""

MLP_LAYERS, MLP_WIDTH = 25, 128  # hidden layers of the "mlp" model, and their width


def torch_model(name):
    import torch
    nn = torch.nn
    torch.manual_seed(0)
    if name == "cnn":
        class Block(nn.Module):
            def __init__(self, c):
                super().__init__()
                self.a, self.b = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
                self.c, self.d = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

            def forward(self, x):
                return torch.relu(x + self.d(self.c(torch.relu(self.b(self.a(x))))))
        net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                            nn.ReLU(), *[Block(32) for _ in range(8)], nn.AdaptiveAvgPool2d(1),
                            nn.Flatten(), nn.Linear(32, 10))
        return net, lambda b: torch.randn(b, 3, 16, 16), 10
    if name == "mlp":
        layers = []
        for _ in range(MLP_LAYERS):
            layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
        net = nn.Sequential(*layers, nn.Linear(MLP_WIDTH, 10))
        return net, lambda b: torch.randn(b, MLP_WIDTH), 10
    if name != "transformer":
        raise ValueError("unknown model %r" % name)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 64)
            self.layers = nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            return self.head(self.layers(self.embed(x)).mean(1))
    return Encoder(), lambda b: torch.randint(0, 100, (b, 32)), 10


def tf_model(name):
    import tensorflow as tf
    L = tf.keras.layers
    tf.keras.utils.set_random_seed(0)
    if name == "cnn":
        inp = tf.keras.Input((16, 16, 3))
        h = L.ReLU()(L.BatchNormalization()(L.Conv2D(32, 3, padding="same", use_bias=False)(inp)))
        for _ in range(8):
            a = L.ReLU()(L.BatchNormalization()(L.Conv2D(32, 3, padding="same", use_bias=False)(h)))
            a = L.BatchNormalization()(L.Conv2D(32, 3, padding="same", use_bias=False)(a))
            h = L.ReLU()(h + a)
        out = L.Dense(10)(L.GlobalAveragePooling2D()(h))
        return tf.keras.Model(inp, out), lambda b: tf.random.normal((b, 16, 16, 3))
    if name == "mlp":
        inp = tf.keras.Input((MLP_WIDTH,))
        h = inp
        for _ in range(MLP_LAYERS):
            h = L.Dense(MLP_WIDTH, activation="relu")(h)
        return tf.keras.Model(inp, L.Dense(10)(h)), lambda b: tf.random.normal((b, MLP_WIDTH))
    if name != "transformer":
        raise ValueError("unknown model %r" % name)
    inp = tf.keras.Input((32,), dtype="int32")
    h = L.Embedding(100, 64)(inp)
    for _ in range(7):
        a = L.MultiHeadAttention(4, 16)(h, h)
        h = L.LayerNormalization()(h + a)
        f = L.Dense(64)(L.Dense(128, activation="relu")(h))
        h = L.LayerNormalization()(h + f)
    out = L.Dense(10)(L.GlobalAveragePooling1D()(h))
    return tf.keras.Model(inp, out), lambda b: tf.random.uniform((b, 32), 0, 100, tf.int32)
