#!/usr/bin/env bash
# The part of ik_llama.cpp's tree a CUDA build of llama-bench, llama-quantize, llama-cli and llama-sweep-bench needs,
# as a .tar.gz small enough to travel to the GPU machine (about 3 MB): scripts/bench_ik_llama.sh builds it there.
#
#   bash scripts/ik_llama_subset.sh GIT_DIR OUT.tar.gz
#
# GIT_DIR: a clone (or bare mirror) of ikawrakow/ik_llama.cpp. Left out: the server (its web assets), the media of
# examples/mtmd's tests, and ggml's backends other than the CPU's and CUDA's. The commit goes in IK_COMMIT.
set -euo pipefail
GIT_DIR=$1
OUT=$(realpath -m "$2")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
DIR=$TMP/ik_llama.cpp
mkdir -p "$DIR"
# a mirror may lack the large files left out here: they are never read
skip=(":(exclude)examples/server" ":(exclude,glob)examples/mtmd/test-*" ":(exclude)examples/mtmd/tests.sh")
for backend in vulkan sycl cann kompute metal musa; do
    skip+=(":(exclude,glob)ggml/src/ggml-$backend*")
done
git --git-dir="$GIT_DIR" archive HEAD -- \
    CMakeLists.txt CMakePresets.json LICENSE cmake common include src vendor pocs \
    scripts/build-info.sh scripts/xxd.cmake examples ggml "${skip[@]}" | tar -x -C "$DIR"
git --git-dir="$GIT_DIR" rev-parse HEAD > "$DIR/IK_COMMIT"
tar -czf "$OUT" -C "$TMP" ik_llama.cpp
echo "$OUT: $(du -h "$OUT" | cut -f1), $(find "$DIR" -type f | wc -l) files, commit $(cut -c1-9 "$DIR/IK_COMMIT")"
