"""The spec's analytic figures, checked against independent hand calculations."""

import numpy as np
import pytest

from workloads.spec import PRESETS, ModelSpec, resolve

pytestmark = pytest.mark.unit


def hand_count(V, S, d, L, f):
    per_layer = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d)
    return V * d + S * d + L * per_layer + 2 * d


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_matches_hand_formula(name):
    s = PRESETS[name]
    assert s.n_params == hand_count(s.vocab_size, s.seq_len, s.d_model, s.n_layers, s.d_ff)


def test_preset_sizes_are_as_advertised():
    assert PRESETS["tiny"].n_params < 2_000_000
    assert 110e6 < PRESETS["small"].n_params < 140e6
    assert 300e6 < PRESETS["350m"].n_params < 400e6
    assert 1.0e9 <= PRESETS["1b"].n_params <= 1.4e9


def test_flops_per_token_follows_6n_plus_attention():
    s = ModelSpec(vocab_size=100, seq_len=10, d_model=8, n_layers=2, n_heads=2, d_ff=32)
    matmul = 2 * (8 * 24 + 8 * 8 + 8 * 32 + 32 * 8) + 100 * 8
    assert s.flops_per_token == 6 * matmul + 12 * 2 * 8 * 10


def test_model_state_bytes_by_sharding():
    s = PRESETS["tiny"]
    n = s.n_params
    assert s.model_state_bytes("fp32")["total"] == 16 * n
    assert s.model_state_bytes("fp32", sharding="optimizer", world_size=2)["total"] == 8 * n + 4 * n
    assert s.model_state_bytes("fp32", sharding="gradients", world_size=2)["total"] == 4 * n + 6 * n
    assert s.model_state_bytes("fp32", sharding="parameters", world_size=4)["total"] == 16 * n / 4
    master = s.model_state_bytes("bf16", scheme="master", sharding="optimizer", world_size=2)
    assert (master["params"], master["grads"], master["optimizer"]) == (2 * n, 2 * n, 6 * n)
    # ZeRO's optimizer keeps its fp32 copy over an fp32 module too, in fp32 as under autocast
    for precision in ("fp32", "bf16"):
        zero = s.model_state_bytes(precision, scheme="fp32-master", sharding="optimizer", world_size=2)
        assert (zero["params"], zero["grads"], zero["optimizer"]) == (4 * n, 4 * n, 6 * n)


def test_init_is_deterministic_and_order_independent():
    s = PRESETS["tiny"]
    a, b = s.init_weights(seed=1), s.init_weights(seed=1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert np.array_equal(s.init_weight("blocks.2.mlp.fc.weight", 1), a["blocks.2.mlp.fc.weight"])
    assert not np.array_equal(s.init_weights(seed=2)["tok_emb"], a["tok_emb"])
    assert set(a) == set(s.parameter_shapes()) and all(a[k].shape == s.parameter_shapes()[k] for k in a)
    assert abs(a["tok_emb"].std() - 0.02) < 1e-3
    assert a["blocks.0.attn.proj.weight"].std() < 0.02 / np.sqrt(2 * s.n_layers) * 1.05


def test_overrides_and_validation():
    s = resolve("tiny", layers=2, d_model=256)
    assert (s.n_layers, s.d_model, s.d_ff) == (2, 256, 1024)
    assert resolve("tiny", d_model=256, ffn=300).d_ff == 300
    with pytest.raises(KeyError):
        resolve("nope")
    with pytest.raises(ValueError, match="divisible"):
        resolve("tiny", heads=3)
