"""Argument checks of the lab (issue 6): KVLabCache, study API, recipes, metrics, model loading.

Every rejected call raises TypeError/ValueError whose message names the argument; a rejected
``KVLabCache`` update leaves the cache exactly as it was (history, stored bytes, pending keys).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvlab  # noqa: E402
from kvlab.arrays import NUMPY_BF16  # noqa: E402
from kvlab.lab import metrics  # noqa: E402
from kvlab.lab.capture import KVCapture  # noqa: E402
from kvlab.lab.recipes import INT4_SPEC, QuantSpec, Recipe, calibrate, roundtrip_side  # noqa: E402
from kvlab.lab.study import (KIVI_KEYS, attention_sweep, end_to_end_sweep, outlier_profile,  # noqa: E402
                             quantize_capture, tensor_sweep)


@pytest.fixture(scope="module")
def lm():
    from kvlab.lab.model import load_model

    return load_model()


def fake_capture(rng, L=3, T=20, H=2, Hq=4, d=64):
    def a(*s):
        return rng.standard_normal(s).astype(np.float32)

    return KVCapture(keys=a(L, T, H, d), values=a(L, T, H, d), keys_pre_rope=a(L, T, H, d),
                     queries=a(L, T, Hq, d), queries_pre_rope=a(L, T, Hq, d),
                     input_ids=np.arange(T, dtype=np.int64), scaling=d ** -0.5)


# ---- recipes and knobs ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, exc, name", [
    (dict(bits=5), ValueError, "bits"),
    (dict(bits=4.0), TypeError, "bits"),
    (dict(bits=True), ValueError, "bits"),
    (dict(symmetric="yes"), TypeError, "symmetric"),
    (dict(rotation=None), TypeError, "rotation"),
    (dict(rotation="rht:x"), ValueError, "rotation"),
    (dict(scale_dtype="fp64"), ValueError, "scale_dtype"),
    (dict(group_size=64.0), TypeError, "group_size"),
    (dict(group_size=48), ValueError, "group_size"),
    (dict(token_group=True), ValueError, "token_group"),
    (dict(clipping="max"), ValueError, "clipping"),
    (dict(bits=8, scale_dtype="bf16"), ValueError, "zero_point"),
])
def test_quant_spec_rejects(kw, exc, name):
    with pytest.raises(exc, match=f"^{name}:"):
        QuantSpec(**kw)


@pytest.mark.parametrize("kw, exc, name", [
    (dict(name=3), TypeError, "name"),
    (dict(key="int5"), ValueError, "key"),
    (dict(value=4), TypeError, "value"),
    (dict(center_keys="yes"), TypeError, "center_keys"),
    (dict(pre_rope=1), TypeError, "pre_rope"),
    (dict(smooth_keys="a"), TypeError, "smooth_keys"),
    (dict(smooth_keys=2.0), ValueError, "smooth_keys"),
    (dict(smooth_keys=float("nan")), ValueError, "smooth_keys"),
    (dict(nvfp4_global_scale="auto"), ValueError, "nvfp4_global_scale"),
    (dict(value=KIVI_KEYS), ValueError, "value"),
])
def test_recipe_rejects(kw, exc, name):
    args = dict(name="r", key=INT4_SPEC, value=INT4_SPEC)
    args.update(kw)
    with pytest.raises(exc, match=f"^{name}:"):
        Recipe(**args)


def test_calibrate_and_roundtrip_side_reject(rng):
    cap = fake_capture(rng)
    with pytest.raises(ValueError, match="^captures:"):
        calibrate([])
    with pytest.raises(TypeError, match=r"^captures\[1\]:"):
        calibrate([cap, object()])
    with pytest.raises(ValueError, match=r"^captures\[1\]:"):
        calibrate([cap, fake_capture(rng, H=1, Hq=2)])
    calib = calibrate(cap)  # one capture is accepted as is
    r = Recipe("c", INT4_SPEC, INT4_SPEC, center_keys=True)
    x = cap.keys[0]
    with pytest.raises(TypeError, match="^recipe:"):
        roundtrip_side("int4_per_token_head", "k", x, 0)
    with pytest.raises(ValueError, match="^side:"):
        roundtrip_side(r, "q", x, 0, calib)
    with pytest.raises(ValueError, match="^calib:"):
        roundtrip_side(r, "k", x, 0)
    with pytest.raises(TypeError, match="^calib:"):
        roundtrip_side(r, "k", x, 0, calib={"k_mean": 0})
    with pytest.raises(ValueError, match=r"^layer:.*3 layers\), got 3"):
        roundtrip_side(r, "k", x, 3, calib)
    with pytest.raises(ValueError, match="^calib:.*another model"):
        roundtrip_side(r, "k", x[:, :1], 0, calib)  # one head, calibration of two
    with pytest.raises(ValueError, match="^x:"):
        roundtrip_side(r, "k", x[0, 0], 0, calib)
    assert roundtrip_side(r, "k", x, 2, calib).shape == x.shape


# ---- metrics ---------------------------------------------------------------------------------------
def test_tensor_metrics_refuse_to_broadcast(rng):
    x = rng.standard_normal((5, 2, 64))
    for f in (metrics.rel_mse, metrics.sqnr_db, metrics.mean_cosine, metrics.tensor_errors):
        with pytest.raises(ValueError, match=r"^xq: expected the shape of x \(5, 2, 64\), got \(2, 64\)"):
            f(x, x[0])
    assert metrics.rel_mse(x, x) == 0.0


def test_attention_errors_reject(rng):
    q = rng.standard_normal((6, 4, 32))
    k = rng.standard_normal((6, 2, 32))
    with pytest.raises(ValueError, match="^q:"):
        metrics.attention_errors(q[0], k, k, k, k, 0.1)
    with pytest.raises(ValueError, match="^kq:"):
        metrics.attention_errors(q, k, k, k[:5], k, 0.1)
    with pytest.raises(ValueError, match="^vq:"):
        metrics.attention_errors(q, k, k, k, k[:, :1], 0.1)
    with pytest.raises(ValueError, match="^scaling:"):
        metrics.attention_errors(q, k, k, k, k, -1.0)
    with pytest.raises(ValueError, match="^q:.*multiple"):
        metrics.attention_errors(q[:, :3], k, k, k, k, 0.1)
    assert metrics.attention_errors(q, k, k, k, k, 0.1) == {"score_rel_err": 0.0, "out_rel_err": 0.0}


def test_paired_ratio_rejects():
    with pytest.raises(ValueError, match="^kl_a, kl_b:"):
        metrics.paired_ratio([1.0, 2.0], [1.0])


# ---- study API -------------------------------------------------------------------------------------
def test_study_entry_points_reject(rng):
    cap = fake_capture(rng)
    with pytest.raises(TypeError, match="^capture:"):
        quantize_capture({"keys": 1}, "int8_per_token_head", 0)
    with pytest.raises(ValueError, match="^recipe:"):
        quantize_capture(cap, "int5", 0)
    with pytest.raises(TypeError, match="^recipe:"):
        quantize_capture(cap, 4, 0)
    with pytest.raises(ValueError, match="^layer: expected <= 2, got 3"):
        quantize_capture(cap, "int8_per_token_head", 3)
    with pytest.raises(TypeError, match="^layer:"):
        quantize_capture(cap, "int8_per_token_head", "0")
    with pytest.raises(ValueError, match="^model:"):
        quantize_capture(cap, Recipe("p", INT4_SPEC, INT4_SPEC, pre_rope=True), 0)
    for sweep in (tensor_sweep, attention_sweep):
        with pytest.raises(TypeError, match="^recipes:.*single"):
            sweep(cap, Recipe("r", INT4_SPEC, INT4_SPEC), progress=False)
        with pytest.raises(TypeError, match="^recipes:"):
            sweep(cap, 3, progress=False)
        with pytest.raises(ValueError, match="^recipes:"):
            sweep(cap, [], progress=False)
        with pytest.raises(ValueError, match=r"^recipes\[1\]:"):
            sweep(cap, ["int8_per_token_head", "int5"], progress=False)
        with pytest.raises(ValueError, match=r"^layers\[1\]: expected <= 2"):
            sweep(cap, ["int8_per_token_head"], layers=[0, 7], progress=False)
        with pytest.raises(ValueError, match="^layers:"):
            sweep(cap, ["int8_per_token_head"], layers=[], progress=False)
        with pytest.raises(TypeError, match="^capture:"):
            sweep(None, ["int8_per_token_head"], progress=False)
    # format names are accepted where recipes are (valid input: rows come back)
    rows = tensor_sweep(cap, ["int8_per_token_head"], layers=[1], progress=False)
    assert [r["side"] for r in rows] == ["k", "v"] and rows[0]["recipe"] == "int8_per_token_head"
    with pytest.raises(ValueError, match="^keys:"):
        outlier_profile(cap.keys[0, 0])


def test_model_level_entry_points_reject(lm):
    from kvlab.lab.capture import capture_kv
    from kvlab.lab.text import token_windows

    vocab = lm.model.get_input_embeddings().num_embeddings
    w = token_windows(lm.tokenizer, 1, 12)
    with pytest.raises(TypeError, match="^lm:"):
        metrics.reference_logprobs(lm.model, w, 6)
    with pytest.raises(TypeError, match="^windows: expected integer"):
        metrics.reference_logprobs(lm, w.astype(np.float32), 6)
    with pytest.raises(ValueError, match=rf"^windows: token ids must be in \[0, {vocab}\), got {vocab}"):
        metrics.reference_logprobs(lm, np.full((1, 12), vocab), 6)
    with pytest.raises(ValueError, match="^windows: token ids must be in .*got -1"):
        metrics.reference_logprobs(lm, np.full((1, 12), -1), 6)
    with pytest.raises(ValueError, match="^windows:"):
        metrics.reference_logprobs(lm, w[0], 6)
    with pytest.raises(ValueError, match="^context_len:"):
        metrics.reference_logprobs(lm, w, 12)
    with pytest.raises(TypeError, match="^context_len:"):
        metrics.reference_logprobs(lm, w, 6.0)
    with pytest.raises(ValueError, match="^batch_size:"):
        metrics.reference_logprobs(lm, w, 6, batch_size=0)
    ref = metrics.reference_logprobs(lm, w, 6)
    with pytest.raises(TypeError, match="^ref:"):
        metrics.evaluate_recipe(lm, "int8_per_token_head", ref.logprobs)
    with pytest.raises(ValueError, match="^recipe:"):
        metrics.evaluate_recipe(lm, "int5", ref)
    with pytest.raises(ValueError, match="^calib:"):
        metrics.evaluate_recipe(lm, Recipe("c", INT4_SPEC, INT4_SPEC, center_keys=True), ref)
    with pytest.raises(ValueError, match="^batch_size:"):
        metrics.evaluate_recipe(lm, "int8_per_token_head", ref, batch_size=0)
    with pytest.raises(TypeError, match="^lm:"):
        end_to_end_sweep(lm.model, ref, ["int8_per_token_head"], progress=False)
    with pytest.raises(TypeError, match="^ref:"):
        end_to_end_sweep(lm, None, ["int8_per_token_head"], progress=False)
    with pytest.raises(ValueError, match=r"^recipes\[0\]:"):
        end_to_end_sweep(lm, ref, ["int5"], progress=False)
    with pytest.raises(ValueError, match="^batch_size:"):
        end_to_end_sweep(lm, ref, ["int8_per_token_head"], progress=False, batch_size=0)
    with pytest.raises(ValueError, match="^input_ids: token ids must be in"):
        capture_kv(lm, np.array([1, 2, vocab + 5]))
    with pytest.raises(TypeError, match="^input_ids:"):
        capture_kv(lm, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="^input_ids:"):
        capture_kv(lm, np.array([], dtype=np.int64))


def test_load_model_rejects_bad_device_and_dtype():
    from kvlab.lab.model import load_model

    with pytest.raises(ValueError, match="^device:"):
        load_model(device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^device: 'cuda' asked for, but torch sees no CUDA device"):
            load_model(device="cuda")
    with pytest.raises(TypeError, match="^dtype:"):
        load_model(dtype="float16")
    with pytest.raises(ValueError, match="^dtype:"):
        load_model(dtype=torch.int8)


# ---- KVLabCache ------------------------------------------------------------------------------------
def test_cache_constructor_rejects(lm, rng):
    from kvlab.lab.hf_cache import KVLabCache

    cap = fake_capture(rng)
    with pytest.raises(ValueError, match="^recipe:"):
        KVLabCache("int5", lm.model)
    with pytest.raises(TypeError, match="^recipe:"):
        KVLabCache(4, lm.model)
    centered = Recipe("c", INT4_SPEC, INT4_SPEC, center_keys=True)
    with pytest.raises(ValueError, match="^calib:.*needs a Calibration"):
        KVLabCache(centered, lm.model)
    with pytest.raises(TypeError, match="^calib:"):
        KVLabCache(centered, lm.model, calib="calib")
    with pytest.raises(ValueError, match="^calib: expected statistics of the model's 30 layers, got 3"):
        KVLabCache(centered, lm.model, calib=calibrate([cap]))
    with pytest.raises(ValueError, match="^backend:"):
        KVLabCache("int8_per_token_head", lm.model, backend="cuda")
    with pytest.raises(TypeError, match="^model:.*LoadedModel"):
        KVLabCache("int8_per_token_head", lm)
    with pytest.raises(TypeError, match="^model:"):
        KVLabCache("int8_per_token_head", object())


def _snapshot(cache):
    """Everything a layer holds, as host copies (stored caches as bytes)."""
    out = []
    for layer in cache.layers:
        def t(x):
            return None if x is None else (tuple(x.shape), x.dtype, x.detach().cpu().clone())
        out.append(dict(
            n=layer.cumulative_length, init=layer.is_initialized,
            keys=t(layer.keys) if layer.is_initialized else None,
            values=t(layer.values) if layer.is_initialized else None,
            stored=[c.tobytes() if isinstance(c, np.ndarray) else c.cpu().numpy().tobytes() for c in layer.stored],
            pending=None if layer._pending_k is None else layer._pending_k.copy(), tail=t(layer._k_tail),
            geometry=layer._geometry,
        ))
    return out


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            u, v = x[k], y[k]
            if isinstance(u, tuple) and len(u) == 3 and isinstance(u[2], torch.Tensor):
                assert u[:2] == v[:2] and torch.equal(u[2], v[2]), k
            elif isinstance(u, np.ndarray):
                assert np.array_equal(u, v), k
            else:
                assert u == v, k


def _states(rng, b=1, h=3, t=5, d=64, dtype=torch.float32):
    k = torch.from_numpy(rng.standard_normal((b, h, t, d)).astype(np.float32)).to(dtype)
    v = torch.from_numpy(rng.standard_normal((b, h, t, d)).astype(np.float32)).to(dtype)
    return k, v


BAD_UPDATES = [  # (description, make(k, v) -> (key_states, value_states), exception, message start)
    ("key as NumPy", lambda k, v: (k.numpy(), v), TypeError, "key_states: expected a torch.Tensor"),
    ("int value", lambda k, v: (k, v.to(torch.int32)), TypeError, "value_states: expected dtype"),
    ("3-D key", lambda k, v: (k[0], v[0]), ValueError, "key_states: expected 4 dimensions"),
    ("token mismatch", lambda k, v: (k, v[:, :, :2]), ValueError, r"value_states: expected \(batch, kv_heads, tokens\)"),
    ("dtype mismatch", lambda k, v: (k, v.double().float().half()), TypeError, "value_states: expected torch.float32"),
    ("head count change", lambda k, v: (k[:, :2], v[:, :2]), ValueError, "key_states, value_states: expected"),
    ("batch change", lambda k, v: (k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)), ValueError,
     "key_states, value_states: expected"),
    ("dtype change", lambda k, v: (k.half(), v.half()), TypeError, "key_states: expected torch.float32"),
]


@pytest.mark.parametrize("recipe", ["int4_per_token_head", "kivi", "centered"])
@pytest.mark.parametrize("case", range(len(BAD_UPDATES)), ids=[c[0] for c in BAD_UPDATES])
def test_rejected_update_leaves_the_cache_unchanged(lm, rng, recipe, case):
    from kvlab.lab.hf_cache import KVLabCache

    calib = None
    if recipe == "kivi":
        recipe = Recipe("kivi", KIVI_KEYS, INT4_SPEC)     # keeps raw pending keys between updates
    elif recipe == "centered":
        calib = calibrate([fake_capture(rng, L=30, H=3, Hq=9)])
        recipe = Recipe("c", INT4_SPEC, INT4_SPEC, center_keys=True, center_values=True)
    cache = KVLabCache(recipe, lm.model, calib=calib)
    k, v = _states(rng)
    cache.layers[0].update(k, v)
    cache.layers[1].update(k, v)
    before = _snapshot(cache)
    _, make, exc, msg = BAD_UPDATES[case]
    bk, bv = make(*_states(rng))
    with pytest.raises(exc, match=f"^{msg}"):
        cache.layers[0].update(bk, bv)
    _same(before, _snapshot(cache))
    assert cache.get_seq_length() == 5


def test_unsupported_head_size_is_rejected_before_anything_is_stored(lm, rng):
    from kvlab.lab.hf_cache import KVLabCache

    cache = KVLabCache("int4_per_token_head", lm.model)
    before = _snapshot(cache)
    k, v = _states(rng, d=100)
    with pytest.raises(ValueError, match="head_size.*100"):
        cache.layers[0].update(k, v)
    _same(before, _snapshot(cache))
    assert not cache.layers[0].is_initialized
    with pytest.raises(ValueError, match="^value_states: kvlab formats store K and V of one head size"):
        cache.layers[0].update(*_states(rng)[:1], _states(rng, d=128)[1])


def test_zero_token_update_stores_nothing(lm, rng):
    from kvlab.lab.hf_cache import KVLabCache

    for recipe in ("int8_per_token_head", Recipe("kivi", KIVI_KEYS, INT4_SPEC)):
        cache = KVLabCache(recipe, lm.model)
        k, v = _states(rng)
        k0, v0 = cache.layers[0].update(k, v)
        before = _snapshot(cache)
        k1, v1 = cache.layers[0].update(k[:, :, :0], v[:, :, :0])
        assert torch.equal(k1, k0) and torch.equal(v1, v0)
        _same(before, _snapshot(cache))
        empty = KVLabCache(recipe, lm.model)
        ke, ve = empty.layers[0].update(k[:, :, :0], v[:, :, :0])
        assert ke.numel() == 0 and ve.numel() == 0 and empty.get_seq_length() == 0


@pytest.mark.parametrize("fmt", ["int4_per_token_head", "nvfp4", "auto"])
def test_bf16_states_on_the_host_path(lm, rng, fmt):
    """bf16 activations (NumPy has no bf16) go through the reference as ml_dtypes bf16, as the API's own."""
    from kvlab.lab.hf_cache import KVLabCache

    k, v = _states(rng, b=2, t=7, dtype=torch.bfloat16)
    cache = KVLabCache(fmt, lm.model)
    kq, vq = cache.layers[0].update(k, v)
    assert kq.dtype == torch.bfloat16 and kq.shape == k.shape and cache.paths_used == {"reference": 1}

    def host(x):  # (b, h, t, d) bf16 torch -> (b·t, h, d) ml_dtypes bf16
        return x.transpose(1, 2).reshape(14, 3, 64).view(torch.int16).numpy().view(NUMPY_BF16)

    c = kvlab.allocate_cache(fmt, 1, 16, 3, 64, like=host(k))
    kvlab.reshape_and_cache(host(k), host(v), c, np.arange(14, dtype=np.int64), kv_cache_dtype=fmt)
    kd, vd = kvlab.dequantize_cache(c, kv_cache_dtype=fmt)
    want_k = torch.from_numpy(np.ascontiguousarray(kd.reshape(16, 3, 64)[:14])).reshape(2, 7, 3, 64).transpose(1, 2)
    assert torch.equal(kq, want_k.to(torch.bfloat16))
    if fmt == "auto":
        assert torch.equal(kq, k) and torch.equal(vq, v)


# ---- CLI helper ------------------------------------------------------------------------------------
def test_check_output_dir(tmp_path):
    from kvlab.__main__ import check_output_dir

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="^--out: expected a folder, got the existing file"):
        check_output_dir(f)
    with pytest.raises(ValueError, match="^--out: cannot create .*is a file"):
        check_output_dir(f / "sub" / "dir")
    with pytest.raises(ValueError, match="^--out: expected a folder, got an empty path"):
        check_output_dir("")
    assert check_output_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # checked, not created
