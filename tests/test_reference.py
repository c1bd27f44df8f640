"""The NumPy reference against the wire format's definition (MXNet's documented layout)."""

import numpy as np
import pytest

from horovod_twobit import reference as ref
from horovod_twobit.wire import checks as wire_checks
from horovod_twobit import wire
from horovod_twobit.wire.layout import Layout


def test_layout_example_first_byte():
    # +t, -t, 0, +t -> 11 10 00 11 = 0xE3
    r = np.zeros(4, np.float32)
    words = ref.encode(np.array([0.5, -0.5, 0.0, 0.7], np.float32), r, 0.5)
    assert words.dtype == np.int32 and words.size == 1
    assert words.view(np.uint8)[0] == 0xE3
    assert list(words.view(np.uint8)[1:]) == [0, 0, 0]


@pytest.mark.parametrize("k,pos,neg", [(0, 0xC0, 0x80), (1, 0x30, 0x20), (2, 0x0C, 0x08), (3, 0x03, 0x02)])
def test_masks_per_position(k, pos, neg):
    for v, mask in ((1.0, pos), (-1.0, neg)):
        g = np.zeros(16, np.float32)
        g[4 + k] = v  # second byte of the word
        w = ref.encode(g, np.zeros(16, np.float32), 0.5).view(np.uint8)
        assert w[1] == mask and w[0] == w[2] == w[3] == 0


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33])
def test_word_count_and_zero_padding(n):
    words = ref.encode(np.full(n, 9.0, np.float32), np.zeros(n, np.float32), 0.5)
    assert words.size == wire.num_words(n) == -(-n // 16)
    codes = ref.unpack(words, words.size * 16)
    assert (codes[:n] == 3).all() and (codes[n:] == 0).all()


def test_error_feedback_delays_but_keeps():
    r = np.zeros(3, np.float32)
    g = np.array([0.2, -0.3, 0.6], np.float32)
    sent = np.zeros(3, np.float32)
    for _ in range(10):
        sent += ref.decode(ref.encode(g, r, 0.5), 3, 0.5)
    np.testing.assert_allclose(sent + r, 10 * g, rtol=1e-6)


def test_decode_treats_code_01_as_zero():
    w = np.array([0x40 | 0xC0 << 8], np.uint32).astype(np.int32)  # byte0=01..., byte1=11...
    out = ref.decode(w, 16, 0.5)
    assert out[0] == 0 and out[4] == 0.5


def test_header_roundtrip():
    words = wire.make_header(2 ** 33 + 5, 0.1, wire.FLAG_NONFINITE)
    h = wire.Header(np.array(words, np.int32))
    assert h.numel == 2 ** 33 + 5 and h.nonfinite and not h.auto
    assert h.threshold == np.float32(0.1)


def test_split_gathered_reports_size_mismatch():
    a = wire.make_header(16, 0.5) + [0]
    b = wire.make_header(17, 0.5) + [0, 0]
    with pytest.raises(wire.PayloadMismatchError, match=r"different sizes \[16, 17\]"):
        wire_checks.split_gathered(a + b, 2, "w")


def test_split_gathered_reports_threshold_mismatch():
    a = wire.make_header(16, 0.5) + [0]
    b = wire.make_header(16, 0.25) + [0]
    with pytest.raises(wire.PayloadMismatchError, match="different thresholds"):
        wire_checks.split_gathered(a + b, 2, "w")


def test_ranks_of_another_format_version_are_refused():
    """A single tensor's payloads and a bucket's: a rank whose header carries another format
    version is refused with the versions by rank and the fix, whichever rank it is."""
    def other(h):  # the same header, format version 2
        return [(wire.MAGIC << 16) | 2] + h[1:]
    a = wire.make_header(16, 0.5) + [0]
    for flat in (a + other(a[:5]) + [0], other(a[:5]) + [0] + a):
        with pytest.raises(wire.PayloadMismatchError, match=r"format versions \[.*2.*\].*install"):
            wire_checks.split_gathered(flat, 2, "w")
    lay = Layout([16, 16])
    head = lay.header(0.5)
    body = [0] * (lay.payload_words - len(head))
    with pytest.raises(wire.PayloadMismatchError,
                       match=r"format versions \[1, 2\].*install.*travels in one bucket"):
        wire_checks.split_bucket(lambda i, j: (head + body + other(head) + body)[i:j],
                                 2 * lay.payload_words, 2, ["w", "b"])


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "Auto", "", None, True, 1e-50])
def test_bad_thresholds(bad):
    with pytest.raises(ValueError):
        wire.validate_threshold(bad)
