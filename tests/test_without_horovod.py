"""The PyTorch codec and state import and work where Horovod cannot be imported (a DDP user's
environment); the Horovod names then say what is missing."""

import subprocess
import sys

CODE = r"""
import sys
sys.modules["horovod"] = None  # import horovod fails, as where it is not installed
import numpy as np
import torch
from horovod_twobit import reference as ref
from horovod_twobit.torch import codec, encode, decode
from horovod_twobit.torch.state import TwoBitState

g = np.linspace(-1, 1, 37).astype(np.float32)
r = torch.zeros(37)
words = encode(torch.from_numpy(g), r, 0.5)
r_ref = np.zeros(37, np.float32)
assert (words.numpy() == ref.encode(g, r_ref, 0.5)).all() and (r.numpy() == r_ref).all()
s = TwoBitState("auto", rank_size=lambda: (0, 1))
s.residuals.get("w", torch.zeros(5)).add_(1.0)
saved = s.state_dict()
assert saved["rank"] == 0 and saved["size"] == 1 and saved["residuals"]["w"].tolist() == [1.0] * 5
import horovod_twobit.torch as b
try:
    b.TwoBitCompressor
except ImportError as e:
    assert "needs Horovod" in str(e), e
    print("OK", "horovod" in sys.modules and sys.modules["horovod"] is None)
else:
    raise AssertionError("TwoBitCompressor without Horovod")
"""


def test_codec_and_state_without_horovod():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["OK", "True"]
