#!/usr/bin/env bash
# The H200 accuracy runs behind benchmarks/results/accuracy_h200*: one process per context (each bounded by
# a timeout; a stopped one leaves <out>.partial.json), SmolLM2 from a GGUF path given as $2. Only the JSON
# results and the log are copied to OUT_DIR (`python -m benchmarks.accuracy.report` renders tables and plots).
# Usage: benchmarks/accuracy/run_h200.sh OUT_DIR GGUF_PATH [IMPL]
set -u
final=${1:?out dir}; gguf=${2:?gguf path}; impl=${3:-auto}; out=/tmp/acc; mkdir -p "$out" "$final"
export PYTHONUNBUFFERED=1
acc() { local secs=$1 ctx=$2; shift 2
  timeout "$secs" python3 -m benchmarks.accuracy --model "$gguf" --contexts "$ctx" --impl "$impl" \
    --out "$out/acc_$ctx" "$@" >>"$out/acc_log.txt" 2>&1 || echo "context $ctx exited $?" >>"$out/acc_log.txt"; }
acc 200 4k --samples 8 --batch 16 --fid-samples 2 --fid-tail 128
acc 210 8000 --samples 8 --batch 16 --fid-samples 2 --fid-tail 128
acc 90 2k --samples 8 --batch 16 --fid-samples 2 --fid-tail 128
acc 70 1k --samples 8 --batch 16 --fid-samples 2 --fid-tail 128
grep -E "exited|wrote|Error|error" "$out/acc_log.txt" | tail -20
cp "$out"/acc_*.json "$out/acc_log.txt" "$final"/; ls -la "$final"
