# Sourced by scripts/gpu_ab.sh and scripts/gpu_run.sh on the lent GPU machine: unpack every
# .nvrtc/NAME.tar.xz (scripts/pack_nvrtc.sh: the pip NVRTC of the checkout that packed it) to
# /tmp/NAME and export NAME in upper case (e.g. NVRTC135) as the environment assignments that load
# it: LD_PRELOAD of its libnvrtc.so.13 (CuPy's loader takes an NVRTC that is already in the
# process, so it wins over the host's own) and LD_LIBRARY_PATH for its libnvrtc-builtins.
# NVRTC_ENVS lists the names exported, newest version last.
NVRTC_ENVS=""
for _a in $(ls .nvrtc/*.tar.xz 2>/dev/null | sort -V); do
  _n=$(basename "$_a" .tar.xz)
  if tar -xJf "$_a" -C /tmp 2>/dev/null && [ -f "/tmp/$_n/libnvrtc.so.13" ]; then
    export "${_n^^}=LD_PRELOAD=/tmp/$_n/libnvrtc.so.13 LD_LIBRARY_PATH=/tmp/$_n"
    NVRTC_ENVS="$NVRTC_ENVS ${_n^^}"
    _v() { env "$@" python3 -c "from cupy.cuda import nvrtc; print('%d.%d' % nvrtc.getVersion())" 2>&1 | tail -1; }
    echo "\$${_n^^}: NVRTC $(_v LD_PRELOAD=/tmp/$_n/libnvrtc.so.13 LD_LIBRARY_PATH=/tmp/$_n) (the host's own: $(_v))"
  else
    echo "$_a: not an NVRTC archive (scripts/pack_nvrtc.sh)"
  fi
done
unset _a _n
