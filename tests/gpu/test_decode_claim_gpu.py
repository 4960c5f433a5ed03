"""The paged decode's claimed stages (``-DKVLAB_DECODE_CLAIM``, a measurement build: the parts of a
split share their stages through claim words, kernels_cu/paged_attention.cu; docs/perf-notes.md
"Session 27"). Run with ``KVLAB_NVRTC_OPTIONS=-DKVLAB_DECODE_CLAIM``; skipped in other builds.

What the build adds beyond the paged decode tests (which run on it unchanged,
tests/gpu/test_paged_attention_gpu.py): a plan run again and again must give the float64
reference every time, so the merge must leave every claim word zero after each launch (a word left
over would make the next launch skip or repeat stages: a wrong output, or a hang), and a CUDA
graph replay must too. Tolerances are those of test_paged_attention_gpu.py (``check_close``)."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from kvlab.cuda.attention import claim_build, plan_paged_attention  # noqa: E402

from tests.gpu.test_paged_attention_gpu import build_case, check_close, run_ref, to_device, to_host  # noqa: E402

if not claim_build():
    pytest.skip("not the -DKVLAB_DECODE_CLAIM build", allow_module_level=True)


def _args(case):
    dev = {k: to_device(case[k], "torch") for k in ("q", "kv_cache", "block_table", "seq_lens", "query_start_loc")}
    return (dev["q"], dev["kv_cache"], dev["block_table"], dev["seq_lens"], dev["query_start_loc"])


@pytest.mark.parametrize("dual", ["0", "1"], ids=["two-per-sm", "dual"])
@pytest.mark.parametrize("fmt", ["int4_per_token_head", "nvfp4", "int8_per_token_head", "fp8_per_token_head", "auto"])
def test_claimed_stages_again_and_again(rng, fmt, dual, monkeypatch):
    """Ragged lengths (parts of unequal length: the short ones steal), forced splits and the plan's
    own, five runs each: every output matches float64 and every claim word is zero after each."""
    monkeypatch.setenv("KVLAB_DECODE_PAGED_DUAL", dual)
    kv_lens = [int(rng.integers(3000, 9000)), 37, int(rng.integers(600, 2000)), 1, int(rng.integers(2000, 5000))]
    case = build_case(rng, fmt, 2, 4, 128, 16, [1] * len(kv_lens), kv_lens)
    args = _args(case)
    ref = run_ref(case)
    for num_splits in (7, None):
        plan = plan_paged_attention(*args, case["kv_cache_dtype"], None, case["k_scale"], case["v_scale"], None,
                                    num_splits=num_splits, decode_variant="paged")
        assert plan.claim and plan.decode_variant == "paged" and plan.n_red > 0
        for rep in range(5):
            out = args[0].clone()
            out[...] = float("nan")
            plan.run(*args, out=out)
            cupy.cuda.runtime.deviceSynchronize()
            check_close(to_host(out).astype(np.float64), ref, "bfloat16",
                        f"{fmt} dual={dual} splits={num_splits} run {rep}")
            left = cupy.asnumpy(plan.claims)
            assert not left.any(), f"claim words left after run {rep}: {np.nonzero(left)[0][:8]}"


def test_claimed_stages_in_a_cuda_graph(rng):
    """Replays of a captured decode step: the merge's zeroing of the claim words is part of the graph."""
    import torch

    case = build_case(rng, "int4_per_token_head", 2, 4, 128, 16, [1, 1, 1], [6000, 700, 2500])
    args = _args(case)
    plan = plan_paged_attention(*args, case["kv_cache_dtype"], None, case["k_scale"], case["v_scale"], None,
                                num_splits=9, decode_variant="paged")
    out = torch.full_like(args[0], float("nan"))
    plan.run(*args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(*args, out=out)
    for rep in range(3):
        q_new = (rng.standard_normal(case["q"].shape) * 1.5).astype(case["q"].dtype)
        case = dict(case, q=q_new)
        args[0].copy_(to_device(q_new, "torch"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_close(to_host(out).astype(np.float64), run_ref(case), "bfloat16", f"graph replay {rep}")
        assert not cupy.asnumpy(plan.claims).any()
