#!/usr/bin/env bash
# One device call: GPU kernel tests, then the kernel benchmark; logs and JSON lines go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 \
   || ! python3 -c "import rocketkv_jax.kernels.dense_decode" 2>/dev/null; then
  echo "editable install failed; using a path shim" | tee -a "$OUT/pip.log"
  mkdir -p /tmp/shim && cp -r rocketkv_jax /tmp/shim/ && ln -sfn "$PWD/kernels" /tmp/shim/rocketkv_jax/kernels
  export PYTHONPATH=/tmp/shim
fi
D=$(date -u +%Y-%m-%d)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/kernels.py --out "$OUT/kernels_$D.jsonl" $BENCH_ARGS 2>&1 \
  | grep -v "^{" | tee "$OUT/kernels_bench_$D.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "command: timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu ${TEST_SELECT:-tests/kernels} -q -rfE" > "$OUT/kernels_gpu_tests_$D.txt"
  cat "$OUT/gpu.txt" >> "$OUT/kernels_gpu_tests_$D.txt"
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu ${TEST_SELECT:-tests/kernels} -q -rfE -p no:cacheprovider 2>&1 \
    | tee -a "$OUT/kernels_gpu_tests_$D.txt" | tail -25
fi
