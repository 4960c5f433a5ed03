"""Lab recipes, metrics and tables without the model (fast)."""
from dataclasses import replace

import numpy as np
import pytest

import kvlab
from kvlab.lab import metrics
from kvlab.lab.recipes import (INT4_SPEC, QuantSpec, Recipe, format_recipe, hide_zero_point, lloyd_max_levels,
                               roundtrip_side, store_scale)
from kvlab.lab.rope import apply_rope, undo_rope
from kvlab.lab.study import markdown_table, group_mean, outlier_profile


def _heavy(rng, shape):
    """Head vectors with a few outlier channels and varying norms, float32."""
    x = rng.standard_normal(shape) * rng.uniform(0.2, 3.0, shape[:-1] + (1,))
    x[..., :3] *= 8.0
    return x.astype(np.float32)


def test_int4_spec_reproduces_int4_per_token_head(rng):
    x = _heavy(rng, (300, 3, 64))
    fmt = kvlab.get_format("int4_per_token_head")
    ref = fmt.dequantize_rows(fmt.quantize_rows(x), 64)
    mine = INT4_SPEC.roundtrip(x)
    assert mine.dtype == np.float32 and mine.shape == x.shape
    # same codes: differences are float32 rounding of the arithmetic only
    np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-5 * np.abs(x).max())
    assert INT4_SPEC.bits_per_element(64) == fmt.bits_per_element(64) == 4.5


@pytest.mark.parametrize("spec, bits", [
    (QuantSpec(bits=4), 4.5),
    (QuantSpec(bits=4, zero_point="int8", scale_dtype="fp16"), 4 + 24 / 64),
    (QuantSpec(bits=4, zero_point="float", scale_dtype="bf16", group_size=32), 4 + 32 / 32),
    (QuantSpec(bits=4, symmetric=True, scale_dtype="e4m3", group_size=16), 4.5),
    (QuantSpec(bits=2, codebook="lloyd_max"), 2.5),
    (QuantSpec(bits=8, zero_point="int8", scale_dtype="e8m0"), 8 + 16 / 64),
    (QuantSpec(bits=4, axis="channel", token_group=64, scale_dtype="fp16", zero_point="float"), 4.5),
])
def test_bits_count_scales_and_zero_points(spec, bits):
    assert spec.bits_per_element(64) == pytest.approx(bits)


def test_recipe_bits_average_sides():
    r = Recipe("mixed", QuantSpec(bits=8, symmetric=True), QuantSpec(bits=2))
    assert r.bits_per_element(64) == pytest.approx(((8 + 0.5) + (2 + 0.5)) / 2)
    assert r.bytes_per_token_head(64) == pytest.approx(r.bits_per_element(64) * 8)
    assert format_recipe("auto").bits_per_element(64) == 16
    assert format_recipe("nvfp4").bytes_per_token_head(64) == 36


@pytest.mark.parametrize("kw, msg", [
    (dict(bits=5), "bits"),
    (dict(scale_dtype="fp64"), "scale_dtype"),
    (dict(zero_point="scale_word", scale_dtype="e4m3"), "zero_point"),
    (dict(zero_point="scale_word", scale_dtype="bf16", bits=8), "zero_point"),
    (dict(group_size=48), "group_size"),
    (dict(rotation="hadamard"), "rotation"),
    (dict(clipping="percentile"), "clipping"),
    (dict(axis="channel", group_size=32), "group_size"),
])
def test_quant_spec_rejects_impossible_knobs(kw, msg):
    with pytest.raises(ValueError, match=msg):
        QuantSpec(**kw)


def test_recipe_validation():
    with pytest.raises(ValueError, match="key"):
        Recipe("x", key="int5")
    with pytest.raises(TypeError, match="value"):
        Recipe("x", value=3)
    with pytest.raises(ValueError, match="per-channel"):
        Recipe("x", value=QuantSpec(axis="channel"))
    with pytest.raises(ValueError, match="calib"):
        roundtrip_side(Recipe("c", INT4_SPEC, INT4_SPEC, center_keys=True), "k", np.zeros((4, 1, 64)), 0)


def test_lloyd_max_levels_are_the_known_gaussian_quantizers():
    np.testing.assert_allclose(lloyd_max_levels(1), [-0.7979, 0.7979], atol=1e-4)  # ±sqrt(2/pi)
    np.testing.assert_allclose(lloyd_max_levels(2), [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)
    assert lloyd_max_levels(4)[-1] == pytest.approx(2.7326, abs=1e-3)


def test_scale_dtypes_and_hidden_zero_point():
    s = np.array([0.0123, 1.7, 300.0], dtype=np.float32)
    assert np.all(store_scale(s, "e8m0") >= s)  # rounded up: nothing clips
    assert np.all(np.log2(store_scale(s, "e8m0")) % 1 == 0)
    np.testing.assert_allclose(store_scale(s, "e4m3"), [6 * 2.0 ** -9, 1.75, 288.0])  # 0.0123 is subnormal in E4M3
    zp = np.array([0, 7, 15], dtype=np.uint32)
    word = hide_zero_point(s, zp, "fp32", 4)
    assert np.all(word.view(np.uint32) & 0xF == zp)
    assert np.all(np.abs(word - s) / s < 2.0 ** -18)


def test_errors_rank_as_expected(rng):
    x = _heavy(rng, (400, 2, 64))

    def err(spec):
        return metrics.rel_mse(x, spec.roundtrip(x))

    e = {b: err(replace(INT4_SPEC, bits=b)) for b in (2, 3, 4, 8)}
    assert e[8] < e[4] < e[3] < e[2]
    assert err(INT4_SPEC) < err(replace(INT4_SPEC, rotation="none"))  # RHT tames outlier channels
    assert err(replace(INT4_SPEC, clipping="mse")) <= err(INT4_SPEC) * 1.0001
    assert err(replace(INT4_SPEC, group_size=16, zero_point="int8", scale_dtype="fp16")) < err(INT4_SPEC)


def test_degenerate_vectors_do_not_make_nan():
    x = np.zeros((3, 2, 64), dtype=np.float32)
    x[1] = 5.0
    for spec in (INT4_SPEC, QuantSpec(bits=2, symmetric=True, scale_dtype="e4m3"),
                 QuantSpec(codebook="lloyd_max", rotation="rht"), QuantSpec(zero_point="float", scale_dtype="e8m0")):
        y = spec.roundtrip(x)
        assert np.all(np.isfinite(y)), spec.label()
        np.testing.assert_allclose(y[0], 0.0, atol=1e-5)


def test_stochastic_rounding_is_seeded(rng):
    x = _heavy(rng, (50, 64))
    s = replace(INT4_SPEC, rounding="stochastic")
    np.testing.assert_array_equal(s.roundtrip(x), s.roundtrip(x))


def test_per_channel_groups_tokens(rng):
    x = _heavy(rng, (3, 150, 64))  # (heads, tokens, d)
    spec = QuantSpec(bits=4, axis="channel", token_group=64, scale_dtype="fp32", zero_point="float")
    y = spec.roundtrip(x)
    # the first 64-token group does not depend on later tokens
    np.testing.assert_array_equal(spec.roundtrip(x[:, :64])[:, :64], y[:, :64])
    np.testing.assert_array_equal(spec.roundtrip(x[:, :128])[:, 64:128], y[:, 64:128])
    assert metrics.rel_mse(x, y) < 0.05


def test_centering_is_undone(rng):
    from kvlab.lab.recipes import Calibration

    L, H, d = 2, 3, 64
    mu = rng.standard_normal((L, H, d)) * 4
    z = np.zeros((L, H, d))
    cal = Calibration(k_mean=mu, k_pre_mean=mu, v_mean=mu, k_absmax=z + 1, k_pre_absmax=z + 1, q_absmax=z + 1,
                      q_pre_absmax=z + 1, k_amax=np.ones(L), v_amax=np.ones(L))
    x = (rng.standard_normal((40, H, d)) + mu[1]).astype(np.float32)
    plain = Recipe("p", INT4_SPEC, INT4_SPEC)
    cent = Recipe("c", INT4_SPEC, INT4_SPEC, center_keys=True, center_values=True)
    e_plain = metrics.rel_mse(x, roundtrip_side(plain, "k", x, 1, cal))
    e_cent = metrics.rel_mse(x, roundtrip_side(cent, "k", x, 1, cal))
    assert e_cent < 0.5 * e_plain
    # an "auto" side with centering is the identity
    ident = Recipe("i", "auto", "auto", center_keys=True)
    np.testing.assert_allclose(roundtrip_side(ident, "k", x, 1, cal), x, atol=1e-5)


def test_rope_inverse(rng):
    T, d = 10, 64
    ang = rng.uniform(0, 6.3, (T, d // 2))
    cos = np.cos(np.concatenate([ang, ang], -1))
    sin = np.sin(np.concatenate([ang, ang], -1))
    x = rng.standard_normal((T, 3, d))
    y = apply_rope(x, cos, sin)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1))
    np.testing.assert_allclose(undo_rope(y, cos, sin), x, atol=1e-12)


def test_metrics_and_attention_errors(rng):
    x = rng.standard_normal((20, 64))
    assert metrics.rel_mse(x, x) == 0 and metrics.sqnr_db(x, x) == float("inf")
    assert metrics.sqnr_db(x, 1.1 * x) == pytest.approx(20.0)
    assert metrics.mean_cosine(x, 3 * x) == pytest.approx(1.0)
    q = rng.standard_normal((16, 4, 64))
    k = rng.standard_normal((16, 2, 64))
    v = rng.standard_normal((16, 2, 64))
    zero = metrics.attention_errors(q, k, v, k, v, 0.125)
    assert zero == {"score_rel_err": 0.0, "out_rel_err": 0.0}
    some = metrics.attention_errors(q, k, v, k + 0.1, v, 0.125)
    assert some["score_rel_err"] > 0 and some["out_rel_err"] > 0
    with pytest.raises(ValueError, match="multiple"):
        metrics.attention_errors(rng.standard_normal((16, 3, 64)), k, v, k, v, 0.125)


def test_paired_ratio():
    r = metrics.paired_ratio([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert r["ratio"] == pytest.approx(0.5) and r["lo"] == pytest.approx(0.5) and r["hi"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="kl_a"):
        metrics.paired_ratio([1.0], [1.0, 2.0])


def test_tables(rng):
    rows = [{"recipe": "a|b", "side": s, "v": float(i), "ok": True} for i, s in enumerate("kvkv")]
    md = markdown_table(rows, ["recipe", "v", "ok"])
    assert md.count("\n") == 6 and "a\\|b" in md and "yes" in md
    g = group_mean(rows, ["side"], ["v"])
    assert g == [{"side": "k", "v": 1.0}, {"side": "v", "v": 2.0}]
    p = outlier_profile(_heavy(rng, (100, 2, 64)))
    assert p["absmax_before"].shape == (2, 64)
    assert p["kurtosis_after"] < p["kurtosis_before"]


def test_cache_and_side_argument_errors():
    from kvlab.lab.hf_cache import KVLabCache

    with pytest.raises(TypeError, match="recipe"):
        KVLabCache(42, model=None)
    with pytest.raises(ValueError, match="recipe"):
        KVLabCache("int3_per_token_head", model=None)
    with pytest.raises(ValueError, match="calib"):
        KVLabCache(Recipe("c", INT4_SPEC, INT4_SPEC, center_values=True), model=None)
    with pytest.raises(ValueError, match="backend"):
        KVLabCache("int4_per_token_head", model=None, backend="triton")
    with pytest.raises(ValueError, match="side"):
        roundtrip_side(format_recipe("auto"), "q", np.zeros((2, 1, 64)), 0)
