"""Decode-suite floors (kvlab/bench/floors.py): the probe launch reads the bytes it is asked
for to within half a chunk per CTA, the paged floor's configurations read whole blocks and fit
an SM as named, the equal-bytes context matches the format's bytes, and the
suite groups formats by row size (so int8 and fp8 share one floor row). The GPU side — the
probe reading exactly those bytes — is tests/gpu/test_ring_probe_gpu.py and
tests/gpu/test_bench_floors_gpu.py."""
import pytest

from kvlab.bench import floors, suite_decode
from kvlab.cuda.ring_probe import RingConfig


@pytest.mark.parametrize("cfg", floors.READ_FLOOR_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("nbytes", [1_000_000, 8_912_896, 285_212_672, 553_648_128, 8_589_934_592])
def test_probe_shape_reads_about_the_asked_bytes(cfg, nbytes):
    cfg.check()
    n_sm = 132
    grid, per_cta, nread = floors.probe_shape(nbytes, cfg, n_sm)
    assert nread == grid * per_cta * cfg.chunk
    assert grid <= cfg.ctas_per_sm * n_sm and per_cta >= 1
    # rounding: at most half a chunk per CTA (one CTA per chunk: half a chunk in all)
    assert abs(nread - nbytes) <= max(grid * cfg.chunk / 2, cfg.chunk / 2)
    if nbytes >= 100e6:
        assert abs(nread - nbytes) / nbytes < 0.01


def test_probe_shape_small_cache_one_cta_per_chunk():
    cfg = RingConfig("x", chunk=32768, per_stage=2, nbuf=3, ctas_per_sm=1, layout="contig")
    assert floors.probe_shape(5 * 32768 + 100, cfg, 132) == (5, 1, 5 * 32768)
    assert floors.probe_shape(10, cfg, 132) == (1, 1, 32768)


@pytest.mark.parametrize("bad", [(0, 132), (-5, 132), (1000, 0)])
def test_probe_shape_refuses_non_positive(bad):
    with pytest.raises(ValueError, match="positive"):
        floors.probe_shape(bad[0], RingConfig("x", layout="contig"), bad[1])


def test_equal_bytes_context_hand_cases():
    # int4 at d = 128: 68 B rows vs 256 B bf16 rows -> 8192 · 68 / 256 = 2176 exactly
    assert floors.equal_bytes_context(8192, 68, 128) == 2176
    # int8 / fp8 (132 B), nvfp4 (72 B) at d = 128
    assert floors.equal_bytes_context(8192, 132, 128) == 4224
    assert floors.equal_bytes_context(8192, 72, 128) == 2304
    # rounding to the nearest, never below 1
    assert floors.equal_bytes_context(3, 36, 64) == 1
    assert floors.equal_bytes_context(1, 1, 256) == 1
    with pytest.raises(ValueError, match="positive"):
        floors.equal_bytes_context(0, 68, 128)


def test_distinct_sizes_group_formats_by_row_bytes():
    s128 = suite_decode._distinct_sizes(128)
    assert s128 == {256: ["auto"], 132: ["int8_per_token_head", "fp8_per_token_head"],
                    68: ["int4_per_token_head"], 72: ["nvfp4"]}
    # at d = 64 int4 (32 + 4) and nvfp4 (32 + 4) rows have the same bytes: one floor row
    s64 = suite_decode._distinct_sizes(64)
    assert s64 == {128: ["auto"], 68: ["int8_per_token_head", "fp8_per_token_head"],
                   36: ["int4_per_token_head", "nvfp4"]}
    assert sorted(n for names in s128.values() for n in names) == sorted(suite_decode.FORMATS)


def test_floor_rows_assembly(monkeypatch):
    """``suite_decode._floor_rows`` on CPU tensors with the timers stubbed: the read-floor row
    carries the floor's bytes and configuration, the SDPA row times a bf16 cache of the equal-bytes
    context (its bytes are the format's), ratios are against the case's baseline, and ``auto``
    gets no SDPA row (its cache is bf16 already)."""
    torch = pytest.importorskip("torch")
    calls = {}

    def fake_floor(nbytes, repeats):
        calls["floor"] = nbytes
        return dict(median_ms=0.5, bytes=nbytes + 1024, config="cfg A", per_config={"cfg A": 0.5, "cfg B": 0.7})

    def fake_paged_floor(nbytes, block, repeats):
        calls["paged"] = (nbytes, block)
        return dict(median_ms=0.6, bytes=nbytes - 16, config="cfg P", per_config={"cfg P": 0.6, "cfg Q": "Err"})

    def fake_bench(fn, repeats):
        out = fn()   # runs the SDPA on the sliced CPU cache
        calls["sdpa_shape"] = tuple(out.shape)
        return dict(median_ms=0.8)

    monkeypatch.setattr(floors, "read_floor", fake_floor)
    monkeypatch.setattr(floors, "paged_read_floor", fake_paged_floor)
    monkeypatch.setattr(suite_decode, "bench_ms", fake_bench)
    monkeypatch.setattr(suite_decode, "copy_bandwidth_gbps", lambda nbytes, repeats: 1000.0)
    B, ctx, Hq, Hkv, d = 2, 256, 4, 2, 64
    k = torch.randn(B, Hkv, ctx, d, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, ctx, d, dtype=torch.bfloat16)
    q = torch.randn(B, Hq, 1, d, dtype=torch.bfloat16)
    ms, rows = suite_decode._floor_rows(torch, "case", B, ctx, Hkv, d, ["int4_per_token_head", "nvfp4"], 36,
                                       k, v, q, d ** -0.5, 2.0, 3)
    assert ms == (0.5, 0.6) and calls["floor"] == 2 * B * ctx * Hkv * 36
    # the paged floor reads the same bytes as blocks of 16 tokens, K and V, of every KV head
    assert calls["paged"] == (calls["floor"], 2 * 16 * Hkv * 36)
    floor, paged, sdpa = rows
    assert floor["impl"] == "read floor [int4/nvfp4 bytes]" and floor["bytes"] == calls["floor"] + 1024
    assert floor["ratio_vs_baseline"] == 0.25 and "cfg A" in floor["notes"] and "cfg B: 0.7000 ms" in floor["notes"]
    assert paged["impl"] == "paged read floor [int4/nvfp4 bytes]" and paged["bytes"] == calls["floor"] - 16
    assert paged["ratio_vs_baseline"] == 0.3 and "cfg P" in paged["notes"] and "cfg Q: Err" in paged["notes"]
    assert "shuffled" in paged["notes"] and "contiguous" in floor["notes"]
    ctx_eq = floors.equal_bytes_context(ctx, 36, d)   # 72
    assert sdpa["impl"] == f"torch SDPA bf16 at int4/nvfp4 bytes (L={ctx_eq})"
    assert sdpa["bytes"] == 2 * B * ctx_eq * Hkv * 2 * d == calls["floor"]
    assert sdpa["ratio_vs_baseline"] == 0.4 and calls["sdpa_shape"] == (B, Hq, 1, d)
    _, rows_auto = suite_decode._floor_rows(torch, "case", B, ctx, Hkv, d, ["auto"], 2 * d, k, v, q, d ** -0.5,
                                            2.0, 3)
    assert [r["impl"] for r in rows_auto] == ["read floor [auto bytes]", "paged read floor [auto bytes]"]


@pytest.mark.parametrize("block", [17408, 18432, 33792, 65536, 3456, 9216])
def test_paged_floor_configs_fit_and_read_whole_blocks(block):
    cfgs = floors.paged_floor_configs(block)
    names = [c.name for c in cfgs]
    assert len(set(names)) == len(names) and any(c.mode == "loads" for c in cfgs)
    assert sum(c.mode != "loads" for c in cfgs) >= 1
    for c in cfgs:
        c.check()
        assert c.chunk == block and c.layout == "blocks"
        if c.mode != "loads":
            # resident as named: the CTAs of an SM fit its shared memory
            assert c.smem_bytes() <= floors.SMEM_PER_CTA_MAX
            assert c.ctas_per_sm * (c.smem_bytes() + 1024) <= floors.SMEM_PER_SM
            assert c.smem_bytes() == c.nbuf * c.per_stage * block


def test_paged_floor_configs_hand_cases():
    # int4 at d = 128, 8 KV heads: 2·16·8·68 = 17,408 B blocks, every form fits
    f = {(c.per_stage, c.nbuf, c.ctas_per_sm) for c in floors.paged_floor_configs(17408) if c.mode != "loads"}
    assert f == {(4, 2, 1), (2, 3, 1), (2, 2, 2), (1, 3, 2)}
    # bf16 at d = 128: 64 KB blocks, two CTAs of two 64 KB stages do not fit an SM
    f = {(c.per_stage, c.nbuf, c.ctas_per_sm) for c in floors.paged_floor_configs(65536) if c.mode != "loads"}
    assert f == {(1, 2, 1), (1, 3, 1)}
    with pytest.raises(ValueError, match="multiple of 16"):
        floors.paged_floor_configs(1000)
