# Sourced by scripts/gpu_ab.sh and scripts/gpu_run.sh: write_commit_txt FILE records which code ran.
# The device machine's copy carries the working tree over the landed history, so its HEAD alone can
# name an older commit than the files that ran: the changed files are counted, and the tracked and
# untracked files under kvlab kernels_cu tests scripts are hashed (compute the same hash here at a
# commit to match a run to it).
write_commit_txt() {
  { git rev-parse --short HEAD
    echo "files changed against it: $(git status --porcelain 2>/dev/null | wc -l)"
    echo "tree: $(git ls-files -co --exclude-standard -- kvlab kernels_cu tests scripts | sort | xargs cat 2>/dev/null | sha256sum | cut -c1-16)"
  } > "$1" 2>/dev/null || true
}
