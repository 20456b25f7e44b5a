#!/usr/bin/env bash
# The H200 decode runs behind benchmarks/results/decode_h200_*.jsonl, in parts so each device call fits its
# 10 minutes (each part bounded, so a slow compile cannot cost the rest).
# Usage: benchmarks/run_h200.sh OUT_DIR PART...   (parts: peak lat128 lat32 lat16_64 methods32 max32 t1024
#        t1024_more methods_long max_long methods_max t1024_rest t1024_quest t1024_max cmdbuf hsa_large serve32
#        serve32max serve32max_rk serve32chunk serve32arrive prefill_flops turn2dev turn2 mesh70b kernels_s2 profile391
#        serve_load_WORKLOAD_METHOD serve_load_table: see the serve_load part; fp8_tests fp8_lat32 fp8_max32
#        fp8_lat_long fp8_serve32max fp8kt_lat32 fp8kt_max32: issue 40; longgen16 longgen32: 4k prompts, the step after 16k / 32k generated
#        tokens, with and without a decode budget: issue 61; stream32: steps_per_call 1 against 4, issue 60)
# (The sweeps that chose today's stage-2 defaults, with their exact commands, are in the READMEs of
# benchmarks/results/stage2_h200_2026-12-02*/; the options they compared and removed are gone from tune_hsa, and the
# stage2_kernels part, which timed the fused selection kernel removed on 2026-12-04, with it.)
set -u
out=${1:?out dir}; shift; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
run() { local secs=$1; shift; timeout "$secs" python3 -m benchmarks.decode --out "$out/decode.jsonl" "$@" \
          >>"$out/log.txt" 2>&1 || echo "part exited $? : $*" >>"$out/log.txt"; }
serve() { local secs=$1; shift; timeout "$secs" python3 -m benchmarks.serve --out "$out/serve.jsonl" "$@" \
          >>"$out/log.txt" 2>&1 || echo "part exited $? : serve $*" >>"$out/log.txt"; }
for part in "$@"; do
  echo "== $part $(date -u +%T)" >>"$out/log.txt"
  case $part in
    peak)      run 170 --contexts "" --peak rocketkv:256:128k,full:256:128k ;;
    lat128)    run 200 --contexts 128k --methods rocketkv,full --budgets 256 --batches 1,8 ;;
    lat32)     run 170 --contexts 32k --methods rocketkv,full --budgets 256 --batches 1,8 --profile /tmp/prof --profile-batches 1,8 ;;
    lat16_64)  run 220 --contexts 16k,64k --methods rocketkv,full --budgets 256 --batches 1,8 ;;
    methods32) run 200 --contexts 32k --methods snapkv,quest --budgets 256 --batches 1,8 ;;
    max32)     run 200 --contexts 32k --methods full,rocketkv --budgets 256 --batches 32,max ;;
    longgen16) run 420 --contexts 4k --output-at 16k --methods full,rocketkv --budgets 256 --decode-budgets 2048 --batches 1,max --steps 256 --chunk 16 ;;
    longgen32) run 420 --contexts 4k --output-at 32k --methods full,rocketkv --budgets 256 --decode-budgets 2048 --batches 1,max --steps 256 --chunk 16 ;;
    t1024)     run 150 --contexts 32k,128k --methods rocketkv --budgets 1024 --batches 1,8 ;;
    t1024_more) run 220 --contexts 16k,64k --methods rocketkv,snapkv,quest --budgets 1024 --batches 1,8 ;;
    methods_long) run 300 --contexts 16k,64k,128k --methods snapkv,quest --budgets 256 --batches 1,8 ;;
    max_long)  run 300 --contexts 16k,64k,128k --methods full,rocketkv --budgets 256 --batches 32,max ;;
    methods_max) run 420 --contexts 16k,32k,64k,128k --methods snapkv,quest --budgets 256 --batches 32,max ;;
    t1024_rest) run 300 --contexts 32k,128k --methods snapkv,quest --budgets 1024 --batches 1,8 ;;
    t1024_quest) run 220 --contexts 16k,64k --methods quest --budgets 1024 --batches 1,8 ;;
    hsa_large)  # the stage-2 kernels alone at RocketKV's largest batch (both scoring layouts), t=256 and 1024
      timeout 300 python3 benchmarks/kernels.py --out "$out/kernels_large.jsonl" --only sparse --batches 32,108,391 \
        --lengths 32768 --budgets 256,1024 2>&1 | grep -v "^{" >>"$out/log.txt" ;;
    t1024_max) run 420 --contexts 16k,32k,64k,128k --methods rocketkv --budgets 1024 --batches 32,max ;;
    cmdbuf)  # the batch-1 step with XLA's command buffers off, and at graph size 1, against the default flags
      for v in "default:" "off:--xla_gpu_enable_command_buffer=" "min1:--xla_gpu_graph_min_graph_size=1"; do
        name=${v%%:*}
        XLA_FLAGS="${v#*:}" timeout 150 python3 -m benchmarks.decode --out "$out/cmdbuf_$name.jsonl" --contexts 16k \
          --methods rocketkv,full --budgets 256 --batches 1 --profile "/tmp/cb_$name" >>"$out/log.txt" 2>&1
        for f in /tmp/cb_$name/*/decode_chunk.hlo.txt; do
          echo "$name $f command_buffer ops: $(grep -c 'command_buffer' "$f")" >>"$out/cmdbuf.txt"
          gzip -c "$f" > "$out/cmdbuf_${name}_$(basename "$(dirname "$f")").hlo.txt.gz"
        done
      done ;;
    serve32)  # the engine at 32k prompts, 1 and 8 slots, every request prefilled in engine.step()
      serve 400 --methods full,rocketkv --token-budget 256 --prompt 32k --slots 1,8 ;;
    fp8_tests)  # issue 40: the FP8 K/V kernels and methods compiled on the GPU against their XLA references
      timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kv_quant.py tests/core/test_kv_fp8.py \
        >>"$out/log.txt" 2>&1 || echo "part exited $? : fp8_tests" >>"$out/log.txt" ;;
    fp8_lat32)  # issue 40: lat32 with K/V in float8_e4m3fn (run beside lat32: the same file, side by side)
      run 200 --contexts 32k --methods rocketkv,full --budgets 256 --batches 1,8 --kv-cache-dtype float8_e4m3fn ;;
    fp8_max32)  # issue 40: max32 with K/V in float8_e4m3fn (the largest batch, against max32's)
      run 300 --contexts 32k --methods full,rocketkv --budgets 256 --batches 32,max --kv-cache-dtype float8_e4m3fn ;;
    fp8kt_lat32)  # issue 40: fp8_lat32 with RocketKV's KT page summaries in float8_e5m2 too (full has none)
      run 200 --contexts 32k --methods rocketkv --budgets 256 --batches 1,8 --kv-cache-dtype float8_e4m3fn \
        --kt-cache-dtype float8_e5m2 ;;
    fp8kt_max32)  # issue 40: fp8_max32 for RocketKV with its KT page summaries in float8_e5m2 too
      run 300 --contexts 32k --methods rocketkv --budgets 256 --batches 32,max --kv-cache-dtype float8_e4m3fn \
        --kt-cache-dtype float8_e5m2 ;;
    fp8_lat_long)  # issue 40: 16k / 64k / 128k at batch 1 and 8, bf16 then FP8
      run 250 --contexts 16k,64k,128k --methods rocketkv,full --budgets 256 --batches 1,8
      run 250 --contexts 16k,64k,128k --methods rocketkv,full --budgets 256 --batches 1,8 --kv-cache-dtype float8_e4m3fn ;;
    fp8_serve32max)  # issue 40: serve32max for RocketKV with FP8 K/V (the engine at the most slots)
      serve 540 --methods rocketkv --token-budget 256 --prompt 32k --slots max --kv-cache-dtype float8_e4m3fn ;;
    serve32max)  # the most slots that fit (admission auto: prefills are shared once real ones would take over
                 # 90 s, i.e. RocketKV's hundreds of slots)
      serve 540 --methods full,rocketkv --token-budget 256 --prompt 32k --slots max ;;
    mesh70b)  # issue 18, on a multi-GPU kind: the 70B shape, tensor parallel over 8 GPUs (the XLA path: the
              # kernels are not partitioned yet)
      run 580 --shape 70b --mesh 1,8 --contexts 32k --methods rocketkv,full --budgets 256 --batches 1,8 ;;
    serve32chunk)  # issue 37: 8 slots, 16 requests of 32k admitted through engine.step(): whole prefills against
                   # chunked prefill (2048 tokens per step), RocketKV; TPOT p99 / p50 is the figure
      for c in 0 2048; do
        serve 280 --methods rocketkv --token-budget 256 --prompt 32k --slots 8 --admission step --decode-reps 0 \
          --prefill-chunk-tokens $c
      done ;;
    serve32arrive)  # issue 37: 12 requests of 32k arriving every 1.5 s at 8 slots, 256 new tokens each: a new prompt's
                    # prefill while others decode; whole prefills against chunks of 1024 tokens
      for c in 0 1024; do
        serve 200 --methods rocketkv --token-budget 256 --prompt 32k --slots 8 --requests 12 --max-new-tokens 256 \
          --admission step --arrival-s 1.5 --decode-reps 0 --prefill-chunk-tokens $c
      done ;;
    stream32)  # issue 60: one token per stream chunk (steps_per_call 1, the default now) against 4 (the old default):
               # RocketKV 32k at 8 slots and the most, the engine's tokens/s
      for s in 4 1; do
        serve 230 --methods rocketkv --token-budget 256 --prompt 32k --slots 8,max --decode-reps 0 --steps-per-call $s
      done ;;
    serve32max_rk)  # serve32max for RocketKV alone (the engine's steady step against the decode benchmark)
      serve 540 --methods rocketkv --token-budget 256 --prompt 32k --slots max ;;
    prefill_flops)  # issue 37: prefill FLOP/s against the measured matmul rate, whole and in chunks of 2048, 4k-128k
      timeout 500 python3 -m benchmarks.prefill_flops --contexts 4k,8k,16k,32k,64k,128k --chunk-tokens 2048 \
        --out "$out/prefill_flops.jsonl" >>"$out/log.txt" 2>&1 || echo "part exited $? : prefill_flops" >>"$out/log.txt" ;;
    turn2dev)  # issue 37: the second turn with the history's device tier (8 GiB: the first turn's K/V stays on the GPU)
      serve 300 --methods rocketkv --token-budget 256 --prompt 32k --slots "" --turn2 512,4096 --history-device-gb 8 ;;
    turn2)  # a second turn of 512 / 4096 new tokens over a stored 32k first turn, against re-prefilling it all
      serve 300 --methods rocketkv --token-budget 256 --prompt 32k --slots "" --turn2 512,4096 ;;
    kernels_s2)  # the stage-2 kernels per layer at 32k, t=256 (the per-layer table; about 100-200 s)
      PYTHONPATH=$PWD timeout 280 python3 benchmarks/kernels.py --out "$out/kernels_s2.jsonl" --only sparse \
        --batches 8,32,108,391 --lengths 32768 --budgets 256 2>&1 | grep -v "^{" >>"$out/log.txt" ;;
    profile391)  # the 32k largest-batch step profiled, with its compiled HLO kept (names the XLA fusions)
      run 150 --contexts 32k --methods rocketkv --budgets 256 --batches 391 --profile /tmp/p391 --profile-batches 391
      for f in /tmp/p391/*/decode_chunk.hlo.txt; do gzip -c "$f" > "$out/hlo_$(basename "$(dirname "$f")").txt.gz"; done ;;
    serve_load_*)  # issue 37: the HTTP load benchmark (benchmarks/serve_load.py) against `rocketkv serve`, one
      # (workload, method) per part: serve_load_long-gen_full, serve_load_long-gen_rocketkv, serve_load_doc-qa_full,
      # ..._chat_..., ..._prefill-heavy_...; then serve_load_table (the side-by-side goodput table).
      # The model is SERVE_LOAD_MODEL, labelled in every record: by default random:llama-3.1-8b (random bf16 weights
      # of the Llama-3.1-8B shape and a byte-level tokenizer: the decode and serving benchmarks' shape; speed does
      # not depend on the values, and every answer has its full length: ignore_eos); or a real checkpoint
      # (qwen2.5-1.5b where the index is reachable, or a GGUF path that travelled in parts). A bare device lacks
      # fastapi, starlette, pydantic(-core), uvicorn, annotated-types, typing-inspection and opentelemetry-api (fastapi
      # imports it): carry their wheels in
      # .carry/wheels (`benchmarks/device_wheels.sh`), installed here into /tmp/site. Knobs: SL_RATES, SL_REQUESTS,
      # SL_SLOTS, SL_CHUNK (--prefill-chunk-tokens), SL_ARGS (more serve flags; later flags win), SL_LOAD_ARGS (more
      # serve_load flags, e.g. --scale 0.25). serve_load drives guidellm (the bench extra: it needs torch and
      # transformers on the device; --guidellm CMD in SL_LOAD_ARGS names another install); its reports: $out/guidellm.
      if [ -d .carry/wheels ] && [ ! -d /tmp/site ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl >>"$out/log.txt" 2>&1
      fi
      [ -d /tmp/site ] && export PYTHONPATH="${PYTHONPATH:-$PWD}:/tmp/site"
      if [ "$part" = serve_load_table ]; then
        python3 -m benchmarks.serve_load --table "$out/serve_load.jsonl" \
          >"$out/serve_load_table.txt" 2>>"$out/log.txt"; cat "$out/serve_load_table.txt" >>"$out/log.txt"
      else
        m=${part##*_}; wl=${part#serve_load_}; wl=${wl%_*}
        # Each method gets the slots its caches fit (--max-slots auto: the memory left beside the weights, slots
        # sized for this workload's longest prompt and answer), as a user sizing a server would. Rates (chat:
        # sessions/s) span both methods' capacity, estimated for an H200 from the measured prefill rate (about
        # 600 TFLOP/s: 0.22 s per 8k prompt, 1.3 s per 32k), turn (0.11 s for 512 new tokens over a stored 32k
        # history with its device tier) and decode steps: long-gen full ~1.2 req/s (about 70 slots of 10k tokens),
        # rocketkv ~3 (then its own prefills fill the GPU); doc-qa both ~5-8 (each question's pass over the stored
        # document, which both pay; full also holds only ~25 slots of 33k); chat ~0.4 sessions/s both (8 turns of
        # 4k new tokens over the history); prefill-heavy ~0.7 both. Estimates, not measurements: the run decides.
        # Measured on an H100 (results/serve_load_h100_2026-12-06): long-gen slots 74 vs 36, doc-qa 179 vs 9 and
        # about 0.5 s per question, a 32k prompt alone 2.8 s to its first token; the chat server's warm-up (six
        # buckets) took 170 s, so chat parts need SL_TIMEOUT of about 400. Since a38c9ac a question's admission
        # takes 0.052 s (results/serve_load_h100_2026-12-06c): doc-qa rocketkv held 10/s within the SLO, not 15/s.
        # doc-qa's 128 bucket: a question (about 40 new tokens) is prefilled over the stored document
        # at its bucket; at 1024 its attention over 33k tokens cost about 0.26 s per question on the H100. chat's
        # 40960: a random model's answers re-tokenize longer than they were sampled, and 36864 refused 6 of 80
        # turns (results/serve_load_h100_2026-12-06b).
        hd=0  # --history-device-gb: doc-qa keeps its document's K/V on the GPU (no host copy per question)
        case $wl in
          long-gen)      rates=0.5,1,2,4     n=24 mp=8192  mn=2048 buckets=8192 ;;
          doc-qa)        rates=1,2,4,8       n=32 mp=33792 mn=128  buckets=128,1024,33792 hd=8 ;;
          chat)          rates=0.1,0.2,0.4,0.8 n=8 mp=40960 mn=256 buckets=1024,4096,8192,16384,32768,40960 ;;
          *)             rates=0.25,0.5,1    n=12 mp=32768 mn=128  buckets=32768 ;;
        esac
        timeout "${SL_TIMEOUT:-580}" python3 -m benchmarks.serve_load --workload "$wl" --rates "${SL_RATES:-$rates}" \
          --requests "${SL_REQUESTS:-$n}" --slo-ttft 5 --slo-tpot 0.05 --out "$out/serve_load.jsonl" ${SL_LOAD_ARGS:-} \
          --server-log "$out/serve_load_server.log" --reports "$out/guidellm" --launch-timeout-s 400 \
          --launch "--model ${SERVE_LOAD_MODEL:-random:llama-3.1-8b} --dtype bfloat16 --method $m --token-budget 256 \
                    --max-prompt-tokens $mp --max-new-tokens $mn --max-slots ${SL_SLOTS:-auto} --slot-reserve-gb 6 \
                    --max-queue 256 --history-gb 48 --history-device-gb $hd --prefill-buckets $buckets \
                    --prefill-chunk-tokens ${SL_CHUNK:-0} \
                    --cache /tmp/rkv_cache --log-level warning ${SL_ARGS:-}" \
          >>"$out/log.txt" 2>&1 || echo "part exited $? : $part" >>"$out/log.txt"
      fi ;;
    *) echo "unknown part $part" >>"$out/log.txt" ;;
  esac
done
python3 - "$out/decode.jsonl" <<'PY' 2>/dev/null
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  if r["kind"] == "point":
    print(r["method"], r.get("token_budget"), r["context"], r["batch"], r.get("status"), r.get("ms_per_step"),
          r.get("ratio_to_floor"), r.get("tokens_per_s"))
  elif r["kind"] == "peak":
    print("peak", r["method"], r["context"], round((r.get("peak_bytes") or 0) / 1e9, 2), "GB")
PY
python3 - "$out/serve.jsonl" <<'PY' 2>/dev/null
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  print("serve", r["method"], r.get("token_budget"), r["prompt"], r.get("slots"), r.get("admission"), r.get("status"),
        "tok/s", r.get("tokens_per_s"), r.get("steady_tokens_per_s"), "tpot", r.get("tpot_ms_p50"),
        r.get("tpot_ms_p99"), "ttft", r.get("ttft_ms_p50"), r.get("ttft_ms_p99"), "step", r.get("engine_step_ms"),
        r.get("decode_step_ms"), r.get("engine_vs_decode"))
PY
for d in /tmp/prof/rocketkv_*_1 /tmp/prof/full_*_1; do
  [ -f "$d/decode_chunk.hlo.txt" ] && gzip -c "$d/decode_chunk.hlo.txt" > "$out/hlo_$(basename "$d").txt.gz"
done
[ -n "${NO_BUNDLE:-}" ] || bash benchmarks/bundle_out.sh "$out"
true
