#!/usr/bin/env bash
# One device call (issue 4): the GPU-marked tests (compiled Triton kernels; 4 pytest processes in parallel
# to overlap compiles), then the kernel benchmark, then optionally parts of run_h200.sh. Outputs to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || echo "pip -e failed"
D=$(date -u +%Y-%m-%d)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"; } | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  T="$OUT/kernels_gpu_tests_$D.txt"
  { echo "date: $(date -u -Iseconds)"; cat "$OUT/gpu.txt"
    echo "command: XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -m gpu <group> -q -rfE, 4 groups in parallel"; } > "$T"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  i=0
  for g in "tests/kernels/test_dense_decode.py tests/kernels/test_rms_norm.py tests/kernels/test_qkv_rope.py" \
           "tests/kernels/test_sparse_decode.py" \
           "tests/kernels/test_hsa_scores.py tests/kernels/test_cache_append.py" \
           "tests/kernels/test_page_topk.py tests/core/test_methods.py tests/models/test_loop.py"; do
    ( timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu $g -q -rfE -p no:cacheprovider > "$OUT/t$i.log" 2>&1;
      echo "exit $? : $g" >> "$OUT/t$i.log" ) &
    i=$((i + 1))
  done
  wait
  for j in 0 1 2 3; do echo "== group $j"; cat "$OUT/t$j.log"; done >> "$T"
  rm -f "$OUT"/t?.log
  grep -E "passed|failed|error|exit" "$T"
  unset XLA_PYTHON_CLIENT_PREALLOCATE
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/kernels.py --out "$OUT/kernels_$D.jsonl" $BENCH_ARGS 2>&1 \
    | grep -v "^{" | tee "$OUT/kernels_bench_$D.txt" | tail -45
fi
if [ -n "${DECODE_PARTS:-}" ]; then  # whole-model decode points too, e.g. DECODE_PARTS=lat32 (run_h200.sh)
  NO_BUNDLE=1 bash benchmarks/run_h200.sh "$OUT" $DECODE_PARTS
fi
bash benchmarks/bundle_out.sh "$OUT"
