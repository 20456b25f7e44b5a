#!/usr/bin/env bash
# The H200 decode grid behind benchmarks/results/decode_h200_*.jsonl, in priority order (each part bounded,
# so a slow compile cannot cost the rest). Usage: benchmarks/run_h200.sh OUT_DIR
set -u
out=${1:?out dir}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
run() { local secs=$1; shift; timeout "$secs" python3 -m benchmarks.decode --out "$out/decode.jsonl" "$@" \
          >>"$out/log.txt" 2>&1 || echo "part exited $? : $*" >>"$out/log.txt"; }
run 150 --contexts 32k --methods full,rocketkv --budgets 256 --batches 1,8,max --profile /tmp/prof
run 130 --contexts 128k --methods rocketkv,full --budgets 256 --batches 1
run 140 --contexts "" --peak rocketkv:256:128k,full:256:128k
