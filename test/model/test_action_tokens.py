"""Action tokens: the DCT against its formula, bins and FAST round trips, the id
placement, invalid sequences -> zeros (counted), a FAST folder saved and loaded."""

import json
import math

import numpy as np
import pytest

from embodied_kv.model.action_tokens import (
    BINS,
    ActionTokenConfig,
    BinTokenizer,
    action_model_config,
    make_action_tokenizer,
    smooth_chunks,
)
from embodied_kv.model.config import get_preset
from embodied_kv.model.fast_tokenizer import SCALE, FastTokenizer, dct, idct
from embodied_kv.model.prompt import ByteTokenizer

H, A = 10, 8  # tiny: action_horizon x action_dim
# FAST quantisation: each DCT coefficient is off by at most 0.5 / scale; the orthonormal
# inverse keeps the L2 norm, so per dimension |error_t| <= ||error||_2 <= sqrt(H) * 0.5/scale
FAST_MAX_ERROR = math.sqrt(H) * 0.5 / SCALE
BIN_MAX_ERROR = 2.0 / (BINS - 1)  # one bin width (centres of 255 bins over [-1, 1])


@pytest.fixture(scope="module")
def fast():
    cfg = action_model_config(get_preset("tiny"), 1024)
    return FastTokenizer.train(smooth_chunks(1000, H, A, seed=0), cfg.vocab_size, ByteTokenizer())


def test_dct_matches_the_formula_and_inverts():
    x = np.random.default_rng(0).normal(size=(7, 3))
    n = x.shape[0]
    ref = np.zeros_like(x)
    for k in range(n):  # scipy.fft.dct(type=2, norm="ortho") written out
        s = sum(x[t] * math.cos(math.pi * k * (2 * t + 1) / (2 * n)) for t in range(n))
        ref[k] = s * math.sqrt((1 if k == 0 else 2) / n)
    assert np.allclose(dct(x), ref, atol=1e-12)
    assert np.allclose(idct(dct(x)), x, atol=1e-12)


def test_bins_round_trip_and_sit_at_the_top_of_the_vocabulary():
    tok = BinTokenizer(vocab_size=1000, horizon=2, dims=3, tail=128)
    chunk = np.array([[-1.0, 0.0, 1.0], [0.3, -0.7, 5.0]])  # 5.0 clips to 1.0
    ids = tok.encode(chunk)
    assert len(ids) == 6 and all(1000 - 128 - BINS <= i < 1000 - 128 for i in ids)
    assert ids[0] == 1000 - 128 - 1 and ids[2] == 1000 - 128 - BINS  # OpenVLA: V - bin
    back, valid = tok.decode(ids)
    assert valid and np.abs(back - np.clip(chunk, -1, 1)).max() <= BIN_MAX_ERROR


def test_bins_invalid_sequences_decode_to_zeros_and_are_counted():
    tok = BinTokenizer(vocab_size=1000, horizon=1, dims=3)
    for bad in ([1000 - 1, 1000 - 2], [5, 1000 - 1, 1000 - 1], [1000 - 1] * 4):
        chunk, valid = tok.decode(bad)
        assert not valid and not chunk.any() and chunk.shape == (1, 3)
    assert tok.counters.invalid == 3


def test_fast_round_trip_within_the_quantisation_error(fast):
    v = fast.vocab_size
    lengths = []
    for chunk in smooth_chunks(40, H, A, seed=1):
        ids = fast.encode(chunk)
        assert ids[-2:] == [ord("|"), ByteTokenizer.eos_id]  # openpi: `|` then EOS
        body = ids[:-2]
        assert all(v - fast.fast_vocab <= i <= v - 1 for i in body)  # V - 1 - fast_id
        back, valid = fast.decode(ids)
        assert valid
        assert np.abs(back - chunk).max() <= FAST_MAX_ERROR
        lengths.append(len(body))
    assert np.mean(lengths) < H * A / 2  # BPE compresses the DCT symbols
    assert fast.counters.invalid == 0


def test_fast_invalid_sequences_decode_to_zeros_and_are_counted(fast):
    good = fast.encode(smooth_chunks(1, H, A, seed=3)[0])
    cases = [
        [],  # nothing
        [ByteTokenizer.eos_id],  # ends at once
        [65] + good,  # a text id
        good[:2] + [good[-2]],  # too few symbols
        good[:-2] + good[:-2],  # too many
    ]
    for ids in cases:
        chunk, valid = fast.decode(ids)
        assert not valid and chunk.shape == (H, A) and not chunk.any()
    assert fast.counters.invalid == len(cases)


def test_a_fast_folder_saves_and_loads_to_the_same_ids(fast, tmp_path):
    fast.save(tmp_path / "fast")
    loaded = FastTokenizer.load(tmp_path / "fast", fast.vocab_size, ByteTokenizer())
    for chunk in smooth_chunks(10, H, A, seed=4):
        assert loaded.encode(chunk) == fast.encode(chunk)
    # the HF processor folder keeps no shape: the engine's config gives it
    cfg_path = tmp_path / "fast" / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(time_horizon=None, action_dim=None)
    del cfg["alphabet"]
    cfg_path.write_text(json.dumps(cfg))
    user = make_action_tokenizer(
        ActionTokenConfig("fast", horizon=H, fast_dir=str(tmp_path / "fast")),
        action_model_config(get_preset("tiny"), 1024),
        ByteTokenizer(),
    )
    chunk = smooth_chunks(1, H, A, seed=5)[0]
    assert user.encode(chunk) == fast.encode(chunk)
    with pytest.raises(ValueError, match="has no"):
        FastTokenizer.load(tmp_path, fast.vocab_size, ByteTokenizer())


def test_vocabulary_grows_for_tiny_only():
    tiny, pi05 = get_preset("tiny"), get_preset("pi05")
    assert action_model_config(pi05, 1024) is pi05
    grown = action_model_config(tiny, 1024)
    assert grown.vocab_size >= ByteTokenizer.vocab_size + 1024
    assert get_preset("tiny").vocab_size == 264  # the flow-mode preset is untouched
    with pytest.raises(ValueError, match="bins"):
        BinTokenizer(vocab_size=tiny.vocab_size, horizon=1, dims=8)


def test_pi05_ids_sit_below_paligemmas_128_special_ids():
    pi05 = get_preset("pi05")
    v = pi05.vocab_size  # 257,152
    bins = make_action_tokenizer(ActionTokenConfig("bins"), pi05, ByteTokenizer())
    ids = bins.action_ids()
    assert (int(ids.min()), int(ids.max())) == (v - 128 - BINS, v - 128 - 1)
    fast = make_action_tokenizer(
        ActionTokenConfig("fast", horizon=H, fast_train_chunks=200), pi05, ByteTokenizer()
    )
    body = fast.encode(smooth_chunks(1, H, pi05.action_dim, seed=6)[0])[:-2]
    # openpi: pg_id = vocab - 1 - 128 - fast_id
    assert all(v - 128 - fast.fast_vocab <= i <= v - 1 - 128 for i in body)
    assert fast.swap(body) == [v - 1 - 128 - i for i in body]
