"""The wgmma prefill kernel's compile switches (kernels_cu/paged_prefill_wgmma.cu:
``-DKVLAB_WGMMA_WS_STAGES=2`` and ``-DKVLAB_WGMMA_WS_NO_PINGPONG``, which change the ring's
barrier phases and drop the consumers' named-barrier handshake; ``-DKVLAB_WGMMA_NO_PRODUCER_AHEAD``,
the one-tile producer that was the default until session 9, kept for A/B) against the float64
reference, in a child process. The default build (4 stages, ping-pong, producer two tiles ahead)
runs in the main suite.

The switches are compile options (``KVLAB_NVRTC_OPTIONS``) and a process compiles each kernel
family once, so the wgmma prefill GPU tests run again in a fresh ``python -m pytest`` with the
options set: ``tests/gpu/test_prefill_gpu.py`` (its wgmma cases and the mma/wgmma agreement at the
benchmark shape) and ``tests/gpu/test_degenerate_gpu.py`` (whose prefill runs on the default
variant, wgmma on sm_90). The child first checks that the launch geometry has the ring the build
has. A hang (a barrier or parity bug) shows up as the child's timeout.

``KVLAB_WS_TEST_OPTIONS`` (``;``-separated option strings) replaces the build list (each build
compiles the family again: ~50-100 s on the H200 machine).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.gpu.isolated import CHILD_ENV, ROOT, TAIL_CHARS

pytestmark = pytest.mark.gpu

DEFAULT_OPTIONS = "-DKVLAB_WGMMA_WS_STAGES=2 -DKVLAB_WGMMA_WS_NO_PINGPONG;-DKVLAB_WGMMA_NO_PRODUCER_AHEAD"
OPTIONS = [o.strip() for o in os.environ.get("KVLAB_WS_TEST_OPTIONS", DEFAULT_OPTIONS).split(";") if o.strip()]
RUNS = [("tests/gpu/test_prefill_gpu.py", "wgmma or variants_agree"),
        ("tests/gpu/test_degenerate_gpu.py", None)]
CHILD_TIMEOUT_S = int(os.environ.get("KVLAB_WS_TEST_TIMEOUT", "560"))


def _child(options: str, module: str, select: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{CHILD_ENV: "1", "KVLAB_NVRTC_OPTIONS": options})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("KVLAB_PREFILL_VARIANT", None)
    m = re.search(r"KVLAB_WGMMA_WS_STAGES=(\d)", options)
    stages = int(m.group(1)) if m else 4
    check = ("from kvlab.cuda.attention import prefill_geometry as g; "
             f"import sys; sys.exit(0 if g('wgmma').stages == {stages} else 3)")
    pre = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True)
    assert pre.returncode == 0, f"{options!r}: the child does not see the build's ring of {stages}\n{pre.stderr}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", module]
    if select:
        cmd += ["-k", select]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


@pytest.mark.parametrize("module,select", RUNS, ids=lambda x: (x or "all").rsplit("/", 1)[-1].replace(".py", ""))
@pytest.mark.parametrize("options", OPTIONS)
def test_wgmma_switch_build_passes_the_prefill_tests(options, module, select):
    from tests.gpu.test_paged_attention_gpu import skip_unless_prefill_variant_runs

    skip_unless_prefill_variant_runs("wgmma")
    r = _child(options, module, select)
    tail = (r.stdout + "\n" + r.stderr)[-TAIL_CHARS:]
    print(tail[-2000:])
    assert r.returncode == 0, f"{options!r} {module}: exit code {r.returncode}\n{tail}"
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert re.search(r"\d+ passed", summary), tail
