"""The lab on the shipped model (CPU): loading, capture, the quantized transformers cache, KL ordering.

One model per process (``kvlab.lab.model.load_model`` caches it); sizes are small
because the CPU is shared.
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvlab.lab.hf_cache import cache_kwargs  # noqa: E402

from kvlab.lab import metrics  # noqa: E402
from kvlab.lab.recipes import INT4_SPEC, Recipe  # noqa: E402
from kvlab.lab.study import KIVI_KEYS, ordering_recipes  # noqa: E402
from tests.helpers import check_auto_cache_is_exact  # noqa: E402
from tests.helpers import model_logits as _logits  # noqa: E402


@pytest.fixture(scope="session")
def lm():
    from kvlab.lab.model import load_model

    return load_model()


@pytest.fixture(scope="session")
def windows(lm):
    from kvlab.lab.text import token_windows

    return token_windows(lm.tokenizer, 2, 160)


@pytest.fixture(scope="session")
def ref(lm, windows):
    return metrics.reference_logprobs(lm, windows, 80)


def test_model_loads_offline(lm, monkeypatch):
    from kvlab.lab.model import SHIPPED_GGUF, _offline, load_model, shipped_gguf_dir

    assert (shipped_gguf_dir() / SHIPPED_GGUF).is_file()
    assert (lm.num_layers, lm.num_q_heads, lm.num_kv_heads, lm.head_dim) == (30, 9, 3, 64)
    assert "SmolLM2" in lm.name
    assert load_model() is lm  # cached per process
    # the shipped model loads with HF_HUB_OFFLINE=1, restored afterwards
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with _offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in os.environ


def test_bad_model_name_type():
    from kvlab.lab.model import load_model

    with pytest.raises(TypeError, match="name"):
        load_model(123)


def test_text_windows_are_deterministic_and_disjoint(lm):
    from kvlab.lab.text import token_windows

    a = token_windows(lm.tokenizer, 3, 64)
    b = token_windows(lm.tokenizer, 3, 64)
    c = token_windows(lm.tokenizer, 3, 64, split="calib")
    assert a.shape == (3, 64) and a.dtype == np.int64
    np.testing.assert_array_equal(a, b)
    assert not any(np.array_equal(x, y) for x in a for y in c)
    with pytest.raises(ValueError, match="split"):
        token_windows(lm.tokenizer, 1, 8, split="test")
    with pytest.raises(ValueError, match="fit"):
        token_windows(lm.tokenizer, 10, 10 ** 6)


def test_unquantized_perplexity_finite_and_reproducible(lm, windows, ref):
    again = metrics.reference_logprobs(lm, windows, 80)
    print(f"unquantized perplexity {ref.ppl:.4f} on {ref.targets.size} tokens")
    assert np.isfinite(ref.ppl) and 1.0 < ref.ppl < 200.0
    assert again.ppl == ref.ppl
    np.testing.assert_array_equal(again.logprobs, ref.logprobs)


def test_capture_shapes_and_rope(lm, windows):
    from kvlab.lab.capture import capture_kv
    from kvlab.lab.rope import apply_rope, rope_cos_sin

    c = capture_kv(lm, windows[0][:48])
    assert c.keys.shape == c.values.shape == c.keys_pre_rope.shape == (30, 48, 3, 64)
    assert c.queries.shape == (30, 48, 9, 64) and c.keys.dtype == np.float32
    cos, sin = rope_cos_sin(lm.model, np.arange(48))
    np.testing.assert_allclose(apply_rope(c.keys_pre_rope.astype(np.float64), cos, sin), c.keys,
                               atol=1e-4 * np.abs(c.keys).max())
    with pytest.raises(ValueError, match="input_ids"):
        capture_kv(lm, np.zeros((2, 3), dtype=np.int64))


def test_auto_cache_reproduces_unquantized_logits_exactly(lm, windows):
    from kvlab.lab.hf_cache import KVLabCache

    ids = windows[:, :96]
    # one call, and prefill + continuation chunk: same as a DynamicCache fed the same chunks
    ref, _, _ = check_auto_cache_is_exact(lm, ids)
    # an int4 cache stores d/2 + 4 bytes per (token, head) and really changes the logits
    q = KVLabCache("int4_per_token_head", lm.model)
    out = _logits(lm, ids, q)
    assert not torch.equal(out, ref)
    assert q.stored_bytes() == 30 * 2 * (2 * 96 // 16) * 16 * 3 * 36


def test_pre_rope_path_without_quantization_is_transparent(lm, windows):
    from transformers import DynamicCache

    from kvlab.lab.hf_cache import KVLabCache

    ids = windows[:1, :64]
    ref = _logits(lm, ids, DynamicCache(config=lm.model.config))
    out = _logits(lm, ids, KVLabCache(Recipe("pre-rope identity", "auto", "auto", pre_rope=True), lm.model))
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)


def test_per_channel_key_groups_are_independent_of_chunking(lm, windows):
    from kvlab.lab.hf_cache import KVLabCache

    r = Recipe("kivi", KIVI_KEYS, INT4_SPEC)
    ids = windows[:1, :140]
    a = KVLabCache(r, lm.model)
    _logits(lm, ids, a)
    b = KVLabCache(r, lm.model)
    for lo, hi in ((0, 50), (50, 100), (100, 139), (139, 140)):
        _logits(lm, ids[:, lo:hi], b)
    ka, kb = a.layers[0].keys, b.layers[0].keys
    assert ka.shape == kb.shape == (1, 3, 128, 64)  # two full 64-token groups finalized
    torch.testing.assert_close(ka, kb, atol=1e-5, rtol=0)  # layer 0 sees identical inputs


def test_generate_runs_on_a_quantized_cache(lm, windows):
    from kvlab.lab.hf_cache import KVLabCache

    ids = torch.as_tensor(windows[:1, :24])
    cache = KVLabCache("int4_per_token_head", lm.model)
    out = lm.model.generate(ids, **cache_kwargs(lm.model, cache), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 28)
    assert cache.get_seq_length() == 27


def test_kl_ordering_int8_int4_2bit(lm, ref):
    rows = [(r.name, r.bits_per_element(64), metrics.evaluate_recipe(lm, r, ref)) for r in ordering_recipes()]
    for name, bits, m in rows:
        print(f"{name:22s} {bits:5.2f} bits  KL {m['kl']:.5f} ± {m['kl_sem']:.5f}  ppl {m['ppl']:.3f} "
              f"(unquantized {m['ppl_ref']:.3f})")
    kl = [m["kl"] for _, _, m in rows]
    assert 0 < kl[0] < kl[1] < kl[2]
    auto = metrics.evaluate_recipe(lm, "auto", ref)
    assert auto["kl"] == 0.0 and auto["ppl"] == ref.ppl
