"""Every kernel family compiles for sm_90 and sm_80 through NVRTC, no GPU needed (SPEC 4).

Memory-bound kernels that keep a head vector in registers must not spill: a spill would
add local-memory traffic to kernels whose whole budget is the bytes they move.
"""
from __future__ import annotations

import re

import pytest

from kvlab.cuda import loader
from kvlab.reference.hadamard import VLLM_SIGNS_512

pytest.importorskip("cupy")

#: families whose every instantiation must compile without spills
NO_SPILL_FAMILIES = ("hadamard", "reshape_and_cache", "dequantize_cache", "nibble")


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("family", ["hadamard", "reshape_and_cache", "dequantize_cache"])
def test_family_compiles(family, arch):
    reports = loader.compile_family_offline(family, arch)
    specs = loader.FAMILIES[family]
    assert {r.name_expression for r in reports} == {s.name_expression() for s in specs}
    if family in NO_SPILL_FAMILIES:
        spills = [r.name_expression for r in reports if r.spill_stores or r.spill_loads]
        assert not spills, f"{family} spills on {arch}: {spills}"


@pytest.mark.parametrize("family", ["hadamard", "reshape_and_cache", "dequantize_cache"])
def test_write_path_families_are_registered(family):
    """The loader finds each write-path .cu file's family module and its instantiation list."""
    assert family in loader.all_families()
    assert loader._ensure_family(family)


def test_rht_sign_table_is_vllms():
    """The __constant__ sign bits in hadamard.cuh are exactly VLLM_SIGNS_512 (bit i = sign i is -1)."""
    text = (loader.kernels_dir() / "hadamard.cuh").read_text()
    bodies = re.findall(r"kRhtNegBits(?:Const)?\[16\]\s*=\s*\{([^}]*)\}", text)
    assert len(bodies) == 2, "both the __constant__ and the constexpr table"
    for body in bodies:
        words = [int(w.strip().rstrip("u"), 16) for w in body.split(",") if w.strip()]
        assert len(words) == 16
        signs = "".join("-" if (words[i // 32] >> (i % 32)) & 1 else "+" for i in range(512))
        assert signs == VLLM_SIGNS_512


def test_write_family_covers_every_format_and_head_size():
    from kvlab.cuda import cache

    exprs = {s.name_expression() for s in cache.WRITE_SPECS}
    for fid in cache.FORMAT_IDS.values():
        for d in cache.HEAD_SIZES:
            for ct in ("__nv_bfloat16", "__half", "float"):
                assert f"reshape_and_cache<{fid}, {d}, {ct}, false>" in exprs
