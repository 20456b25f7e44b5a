#!/usr/bin/env bash
# The default accuracy grid on one H200, in parts that each fit one device call of at most 10 minutes.
#
# Usage: benchmarks/accuracy/run_h200.sh OUT_DIR GGUF_PATH PARTS [SECONDS]
#   PARTS: a (contexts 1k,2k,4k), b (8000), or several in order, e.g. b,a: run b, then finish what a left
#          undone; each part appends its rows to OUT_DIR/cells_<part>.jsonl as they are measured and resumes
#          from that file if it is there (copy a returned cells file back into OUT_DIR to continue it).
#   SECONDS: the time all PARTS may take together (default 540); each part gets what is left, under `timeout`.
#   METHODS (environment, optional): method specs instead of the default grid's nine, e.g. the nine plus
#          "rocketkv[hsa_recent_tokens=8]" (see runner.DEFAULT_METHODS and parse_methods).
# Writes only OUT_DIR/cells_<part>.jsonl and OUT_DIR/log_<part>.txt (the device returns at most 8 files); render
# the tables and plots afterwards, anywhere:
#   python -m benchmarks.accuracy.report OUT_DIR/cells_a.jsonl OUT_DIR/cells_b.jsonl --out benchmarks/results/accuracy_h200
set -u
out=${1:?out dir}; gguf=${2:?gguf path}; parts=${3:?parts: a, b or b,a}; budget=${4:-540}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
start=$(date +%s)
for part in ${parts//,/ }; do
  case $part in
    a) contexts=1k,2k,4k; batch=64 ;;
    b) contexts=8000; batch=32 ;;  # 32 x 8000 tokens of dense q, k, v for 30 layers: 30 GB (64: 59 GB)
    *) echo "unknown part $part (a or b)" >&2; exit 2 ;;
  esac
  left=$(( budget - ($(date +%s) - start) ))
  if (( left < 30 )); then echo "part $part: no time left" >>"$out/log_$part.txt"; continue; fi
  echo "part $part: contexts $contexts, $left s left, $(date -u +%FT%TZ)" >>"$out/log_$part.txt"
  # the default grid (runner.GRIDS["default"]): every method, t=64..512, 32 samples x 4 tasks, both modes,
  # fidelity 4 x 64 (diagnostic at t=256)
  timeout -k 10 "$left" python3 -m benchmarks.accuracy --model "$gguf" --contexts "$contexts" --batch "$batch" \
    ${METHODS:+--methods "$METHODS"} --compile-workers 16 --cells "$out/cells_$part.jsonl" --no-render --out "$out/acc_$part" \
    >>"$out/log_$part.txt" 2>&1
  echo "part $part exited $? after $(( $(date +%s) - start )) s" >>"$out/log_$part.txt"
done
grep -h -E "^part|context [0-9]+:|cells already done|Error|error" "$out"/log_*.txt | tail -20
ls -la "$out"
