#!/usr/bin/env bash
# Pack this checkout's pip NVRTC (what README's install resolves alone; CI's) for the lent GPU host,
# whose python3 has the NVRTC that torch's cu130 wheels pin (13.0 in sessions 24-26). CuPy compiles
# every kernel at run time with whatever NVRTC it loads, so without this the host measures only the
# 13.0 builds.
#
#   bash scripts/pack_nvrtc.sh            -> .nvrtc/nvrtc<MAJOR><MINOR>.tar.xz (~41 MB for 13.5)
#
# The archive (git-ignored) travels with `carry [".nvrtc", ".whl"]`. The carry holds 64 MiB in all,
# the tracked tree included (~14 MB): the archive fits beside the test wheels (hypothesis,
# pytest-xdist, execnet, attrs, sortedcontainers), not beside the Jupyter wheels or a model part.
# On the machine, scripts/nvrtc_env.sh unpacks it and exports NVRTC<ver> (e.g. NVRTC135) as the
# environment assignments that load it. scripts/gpu_run.sh then builds everything with it
# (NVRTC=host opts out); scripts/gpu_ab.sh uses it per entry, e.g. BENCH='d135||decode|$NVRTC135'.
# The bench header's `nvrtc` line says which NVRTC built the kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
lib=$("$py" -c "import nvidia, pathlib; print(next(p for p in pathlib.Path(nvidia.__path__[0]).glob('cu*/lib') if any(p.glob('libnvrtc.so*'))))")
ver=$("$py" -c "from cupy.cuda import nvrtc; print('%d%d' % nvrtc.getVersion())")
name=nvrtc$ver
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/$name"
cp "$lib"/libnvrtc.so.* "$lib"/libnvrtc-builtins.so.* "$tmp/$name/"
mkdir -p .nvrtc
tar -cJf ".nvrtc/$name.tar.xz" -C "$tmp" "$name"
echo ".nvrtc/$name.tar.xz: $(du -h ".nvrtc/$name.tar.xz" | cut -f1) ($(ls "$tmp/$name" | tr '\n' ' '))"
