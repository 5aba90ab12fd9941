#!/usr/bin/env bash
# The GPU suite in one command, on the H200 machine (run from anywhere):
#   benchmarks/gpu_suite.sh                 # gpu tests, latency and throughput (with the HF peer)
#   SUITE_STAGES="tests" benchmarks/gpu_suite.sh
# It installs the wheels brought along in .whl/ beside the image's packages (the image's torch
# stays), checks that the compiled kernel library loads, runs `pytest -m gpu`, then the
# benchmarks, which append their tables to benchmarks/RESULTS.md. Logs and a short summary go to
# $OUT (the device tool's output folder) or benchmarks/logs/.
# Knobs: BENCH_MODEL (a folder of benchmarks/configs, default llama3-8b), LATENCY_ARGS,
# THROUGHPUT_ARGS (extra flags), SUITE_STAGES (any of: tests latency throughput startup fp8
# deepseek profile sweeps fp8tests fp8decode fp8ab fp8goal modes mergeab normab bf16normab
# waveab m1ab blasab; default the first three). `sweeps` runs
# the launch sweeps of the skinny GEMM and the attention kernel: paste their tables. The FP8
# decode stages, each meant for one 10-minute device call: `fp8tests` the GPU tests of the
# FP8 decode kernels, ops and passes; `fp8decode` their sweeps at M 1 / 2 / 4 into one table
# file (GEMM_TABLES, default $LOG_DIR/fp8_decode.json); `fp8ab` FP8 batch-1 decode without and
# with that file, alternating (the decode passes are all on by default), and the per-shape FP8 GEMM
# table at M = 1 without and with it (bring the file back as GEMM_TABLES); `fp8goal` bf16 and
# FP8 batch 1 (also without fp8_dynamic_linear, and with the bf16 LM head), each in GOAL_PROCS
# processes.
# `modes` profiles batch 1 (bf16, FP8, FP8 without fp8_dynamic_linear) in GOAL_PROCS rounds, one process
# each, for the per-process slow mode: a slow process whose kernel sum stays is waiting on the
# host. `mergeab` times decode at batch 4 / 8 with long contexts with the split-KV merge in the
# attention launch and with the merge kernel (FUSED_MERGE_MAX_SPLITS patched to 0), alternating.
# `normab` runs fp8_norm_linear's GPU tests, sweeps its "norm" kinds at M = 1 and times FP8
# batch 1 without and with the pass and those entries, GOAL_PROCS rounds. `bf16normab` does the
# same for skinny_norm_linear (bf16 batch 1 and 64 x 1k, NORM_IN_M_BUCKETS patched).
# `waveab` runs the FP8 decode kernel's GPU and PTX tests, then FP8 batch 1 with its last waves'
# early release (triton_gemv_fp8_decode's EARLY_RELEASE_PER_SM, 2 by default) at 0, 1, 2 and
# 4, alternating, one process each, GOAL_PROCS rounds (default 2).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${OUT:-benchmarks/logs}
mkdir -p "$LOG_DIR"
STAGES=${SUITE_STAGES:-tests latency throughput}
MODEL=${BENCH_MODEL:-llama3-8b}
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# Tokenizer files for config-only model dirs where the default model package is not installed.
if [ -d build/gpu_assets/tokenizer ] && [ -z "${V1ENGINE_TOKENIZER_DIR:-}" ]; then
  export V1ENGINE_TOKENIZER_DIR=$PWD/build/gpu_assets/tokenizer
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "from v1_engine.kernels import _C; lib = _C.load_library(); \
assert lib is not None, f'no compiled library at {_C.library_path()}'; print('kernel library', \
_C.library_path())"
} 2>&1 | tee "$LOG_DIR/env.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "environment check failed"; exit 1; }

status=0
# One latency.py process: a "### LABEL" header, then its output, both appended to LOG; ARGS and
# VARIANT are flag strings (eval'd, so quoted empty values such as --prefill-lens '' survive).
latency_run() {  # LOG LABEL ARGS VARIANT
  echo "### $2" | tee -a "$1"
  eval python3 benchmarks/latency.py --model "$MODEL" "$3" "$4" 2>&1 | tee -a "$1"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
summary="$LOG_DIR/summary.md"
echo "# GPU suite ($MODEL)" > "$summary"
if [[ " $STAGES " == *" tests "* ]]; then
  # TEST_PART splits the GPU tests into two device calls of under 10 minutes each: "kernels"
  # (tests/kernels and tests/attention: compile-bound, in TEST_WORKERS processes sharing the GPU
  # when pytest-xdist is installed: `../shared/tools/device-wheels pytest-xdist execnet`) and
  # "rest" (the engine, model and server tests, one at a time: some measure GPU memory), which
  # outgrew one call's time after the kernels (2026-12-07): "models" (tests/models, 31 tests)
  # and "engine" (the other 25: compile, engine, worker, spec decode, structured outputs, ...)
  # split it in two.
  # Unset: everything, one at a time.
  case "${TEST_PART:-all}" in
    kernels) test_paths=(tests/kernels tests/attention)
             python3 -c "import xdist" 2>/dev/null && test_paths+=(-n "${TEST_WORKERS:-8}") ;;
    rest) test_paths=(tests --ignore=tests/kernels --ignore=tests/attention) ;;
    models) test_paths=(tests/models) ;;
    engine) test_paths=(tests --ignore=tests/kernels --ignore=tests/attention --ignore=tests/models) ;;
    *) test_paths=(tests/) ;;
  esac
  python3 -m pytest -m gpu -q -s -rfE --durations=12 -p no:cacheprovider "${test_paths[@]}" 2>&1 \
    | tee "$LOG_DIR/gpu_tests.log"
  test_rc=${PIPESTATUS[0]}
  [ "$test_rc" -eq 0 ] || status=1
  { echo; echo "## gpu tests (rc $test_rc)"; tail -n 1 "$LOG_DIR/gpu_tests.log"
    grep -E "max \|logit diff\||relative logit error|memory profile" "$LOG_DIR/gpu_tests.log"
  } >> "$summary"
fi
if [[ " $STAGES " == *" latency "* ]]; then
  # shellcheck disable=SC2086
  python3 benchmarks/latency.py --model "$MODEL" --append ${LATENCY_ARGS:-} 2>&1 \
    | tee "$LOG_DIR/latency.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  { echo; echo "## latency"; grep -E "^\|" "$LOG_DIR/latency.log" | tail -n 20; } >> "$summary"
fi
if [[ " $STAGES " == *" throughput "* ]]; then
  # shellcheck disable=SC2086
  python3 benchmarks/throughput.py --model "$MODEL" --peer --append ${THROUGHPUT_ARGS:-} 2>&1 \
    | tee "$LOG_DIR/throughput.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  { echo; echo "## throughput"; grep -E "^\||lower bound|speed-up" "$LOG_DIR/throughput.log"; } \
    >> "$summary"
fi
if [[ " $STAGES " == *" startup "* ]]; then
  python3 benchmarks/startup.py --model "$MODEL" --append 2>&1 | tee "$LOG_DIR/startup.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  { echo; echo "## startup"; grep -E "^\|" "$LOG_DIR/startup.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" fp8 "* ]]; then
  # End to end: the same model with online FP8 weights (compare with the bf16 latency table).
  python3 benchmarks/latency.py --model "$MODEL" --quantization fp8 --batch-sizes 1,64 \
    --prefill-lens 4096 --append 2>&1 | tee "$LOG_DIR/latency_fp8.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  python3 benchmarks/benchmark_fp8_gemm.py --markdown 2>&1 | tee "$LOG_DIR/fp8_gemm.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  { echo; echo "## fp8"; grep -E "^\| [0-9]" "$LOG_DIR/latency_fp8.log"
    grep -E "^- " "$LOG_DIR/fp8_gemm.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" deepseek "* ]]; then
  python3 benchmarks/benchmark_deepseek.py --markdown --append 2>&1 | tee "$LOG_DIR/deepseek.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  { echo; echo "## deepseek"; grep -E "^\|" "$LOG_DIR/deepseek.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" profile "* ]]; then
  python3 benchmarks/profile_decode.py --model "$MODEL" --out-dir "$LOG_DIR/profile" 2>&1 \
    | tee "$LOG_DIR/profile.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  { echo; echo "## decode profile"; grep -E "^batch" "$LOG_DIR/profile.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" sweeps "* ]]; then
  python3 benchmarks/sweep_skinny_gemm.py --seconds 16 2>&1 | tee -a "$LOG_DIR/sweeps.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  python3 benchmarks/sweep_attention.py --cases 64x1024,1x1024 --prefill 4096 --seconds 30 2>&1 \
    | tee -a "$LOG_DIR/sweeps.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  { echo; echo "## sweeps (tables to paste: see sweeps.log)"; grep -E "TUNED_LAUNCH|^prefill|^batch" \
    "$LOG_DIR/sweeps.log"; } >> "$summary"
fi
TABLES=${GEMM_TABLES:-$LOG_DIR/fp8_decode.json}
if [[ " $STAGES " == *" fp8tests "* ]]; then
  # The new bodies' kernel tests (not the whole of test_triton_gemv_fp8.py: its hundreds of
  # launches outlast one call), the decode ops and passes, and the fused MLP's decode launches.
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fp8_decode_gemm.py \
    tests/kernels/test_triton_gemv_fp8.py tests/models/test_fp8_linear.py \
    tests/models/test_fp8_engine_gpu.py \
    tests/compile/test_fp8_fusion.py tests/kernels/test_triton_mlp.py \
    -k "fma or wgmma or decode or weight_only or gated or dispatch or graph" 2>&1 \
    | tee "$LOG_DIR/fp8tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # The fused MLP's engine test: on a failure its message says a near-tie or a wrong result.
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/compile/test_mlp_fusion.py \
    -k engine 2>&1 | tee "$LOG_DIR/fp8tests_mlp_engine.log"
  { echo; echo "## fp8 decode GPU tests"; tail -n 1 "$LOG_DIR/fp8tests.log"
    grep -E "^E .*step|passed|failed" "$LOG_DIR/fp8tests_mlp_engine.log" | tail -n 3; } >> "$summary"
fi
if [[ " $STAGES " == *" fp8decode "* ]]; then
  # Most wanted first (the call may end before the last): each sweep writes its entries.
  for sweep in "channel --modes fma,wgmma --split-k 2,4 --shapes qkv,o_proj,gate_up,down" \
               "gated --shapes gate_up" "weight_only --shapes o_proj,down" \
               "block --split-k 2,4,8 --shapes qkv,o_proj,gate_up,down"; do
    # shellcheck disable=SC2086
    python3 benchmarks/sweep_skinny_gemm.py --fp8 $sweep --m 1,2,4 --seconds 10 \
      --json "$TABLES" 2>&1 | tee -a "$LOG_DIR/fp8decode_sweeps.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  { echo; echo "## fp8 decode kernels"
    grep -E "TUNED_LAUNCH|^\| |compile failed|wrote" "$LOG_DIR/fp8decode_sweeps.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" fp8ab "* ]]; then
  [ -f "$TABLES" ] || { echo "fp8ab: no table file $TABLES (run the fp8decode stage)"; exit 1; }
  ab="--quantization fp8 --batch-sizes 1 --prefill-lens '' --decode-steps 64 --repeats 2"
  for variant in "" "--gemm-tables $TABLES" "" "--gemm-tables $TABLES"; do
    latency_run "$LOG_DIR/fp8ab.log" "variant: ${variant:-base}" "$ab" "$variant"
  done
  # The per-shape table at M = 1 (per-channel vs cuBLASLt, block / per-channel) without and
  # with the swept entries: faster per-channel rows lower the block ratio (goal >= 0.8).
  for tables in "" "--gemm-tables $TABLES"; do
    # shellcheck disable=SC2086
    python3 benchmarks/benchmark_fp8_gemm.py --m 1 $tables 2>&1 | tee -a "$LOG_DIR/fp8ab_gemm.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  { echo; echo "## fp8 batch-1 A/B (base, tables, base, tables)"
    grep -E "^### variant|^\| 1 " "$LOG_DIR/fp8ab.log"
    grep -E "^- |GEMM tables from" "$LOG_DIR/fp8ab_gemm.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" fp8goal "* ]]; then
  # Issue 7's batch-1 goal (FP8 >= 1.7x bf16 on the H200): each variant in GOAL_PROCS separate
  # processes (default 2), rounds interleaved. One process's repeats agree, but on the H100
  # processes of one variant landed 0.35-0.55 ms apart (RESULTS.md, "per-process bimodal step
  # times"): compare the rounds, not single runs.
  one="--batch-sizes 1 --prefill-lens '' --decode-steps 64 --repeats 2"
  for round in $(seq "${GOAL_PROCS:-2}"); do
    for variant in "" "--quantization fp8" "--quantization fp8 --drop-fusion-passes fp8_dynamic_linear" \
                   "--quantization fp8 --lm-head-quantization none"; do
      latency_run "$LOG_DIR/fp8goal.log" "round $round: ${variant:-bf16}" "$one" "$variant"
    done
  done
  { echo; echo "## fp8 batch-1 goal (bf16, FP8, without fp8_dynamic_linear, with the bf16 head; by round)"
    grep -E "^### round|^\| 1 " "$LOG_DIR/fp8goal.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" modes "* ]]; then
  for round in $(seq "${GOAL_PROCS:-2}"); do
    for variant in "" "--quantization fp8" \
                   "--quantization fp8 --drop-fusion-passes fp8_dynamic_linear"; do
      echo "### round $round: ${variant:-bf16}" | tee -a "$LOG_DIR/modes.log"
      # SM clock and power sampled every 200 ms while the process runs: a slow process at
      # full clocks is not throttled.
      clocks="$LOG_DIR/modes_clocks_${round}_${variant//[^a-z0-9]/_}.csv"
      nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 200 \
        > "$clocks" 2>/dev/null &
      sampler=$!
      # shellcheck disable=SC2086
      python3 benchmarks/profile_decode.py --model "$MODEL" $variant --batch-sizes 1 --steps 16 \
        --out-dir "$LOG_DIR/modes_${round}_${variant//[^a-z0-9]/_}" 2>&1 | tee -a "$LOG_DIR/modes.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      kill "$sampler" 2>/dev/null
      wait "$sampler" 2>/dev/null
      awk -F', *' '$1 > 0 { n++; s += $1; if (!min || $1 < min) min = $1; if ($1 > max) max = $1;
        if ($2 > p) p = $2 } END { printf "clocks during the run: SM %d-%d MHz (mean %d), '\
'peak %d W, %d samples\n", min, max, n ? s / n : 0, p, n }' "$clocks" | tee -a "$LOG_DIR/modes.log"
      echo "host loadavg: $(cat /proc/loadavg)" | tee -a "$LOG_DIR/modes.log"
    done
  done
  { echo; echo "## batch-1 wall vs kernel time per process (modes)"
    grep -E "^### round|^batch 1:|^decode step|^clocks during|^host" "$LOG_DIR/modes.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" mergeab "* ]]; then
  variants="$LOG_DIR/mergeab.json"
  python3 - "$variants" <<'PY'
import json, sys
off = [["v1_engine/kernels/attention_launch.py", "FUSED_MERGE_MAX_SPLITS = 8",
        "FUSED_MERGE_MAX_SPLITS = 0"]]
json.dump([["merge in the launch", []], ["merge kernel", off]] * 2, open(sys.argv[1], "w"))
PY
  for shape in "--batch-sizes 8 --input-len 4096" "--batch-sizes 4 --input-len 2048"; do
    python3 benchmarks/ab_variants.py "$variants" "python3 benchmarks/latency.py --model $MODEL \
      $shape --prefill-lens '' --decode-steps 32 --repeats 2" 2>&1 | tee -a "$LOG_DIR/mergeab.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  { echo; echo "## split-KV merge in the launch vs the merge kernel (mergeab)"
    grep -E "^== |^ *\| [0-9]" "$LOG_DIR/mergeab.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" normab "* ]]; then
  # fp8_norm_linear (the add + RMSNorm folded into the FP8 GEMM after it, a default pass): its
  # GPU tests, the M = 1 sweeps of the "norm" kinds (both bodies, fma and wgmma: each body's
  # fastest launch is printed) into $NORM_TABLES, then FP8 batch 1 without
  # the pass and with it (and the swept entries), one process each, alternating, GOAL_PROCS
  # rounds.
  # NORMAB_STEPS picks the parts (default all three; a call that cannot fit them all runs
  # "tests sweeps", then "ab" with NORM_TABLES brought back).
  norm_tables=${NORM_TABLES:-$LOG_DIR/fp8_norm.json}
  steps=" ${NORMAB_STEPS:-tests sweeps ab} "
  touch "$LOG_DIR/normab_tests.log" "$LOG_DIR/normab_sweeps.log" "$LOG_DIR/normab.log"
  if [[ "$steps" == *" tests "* ]]; then
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fp8_norm_gemm.py \
      tests/models/test_fp8_engine_gpu.py -k "norm or decode_ops" 2>&1 | tee "$LOG_DIR/normab_tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
  for sweep in "norm --shapes qkv" "norm_gated --shapes gate_up"; do
    [[ "$steps" == *" sweeps "* ]] || break
    # shellcheck disable=SC2086
    python3 benchmarks/sweep_skinny_gemm.py --fp8 $sweep --m 1 --seconds 20 \
      --json "$norm_tables" 2>&1 | tee -a "$LOG_DIR/normab_sweeps.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  one="--quantization fp8 --batch-sizes 1 --prefill-lens '' --decode-steps 64 --repeats 2"
  [[ "$steps" == *" ab "* ]] || GOAL_PROCS=0
  tables=""
  [ -f "$norm_tables" ] && tables="--gemm-tables $norm_tables"
  for round in $(seq "${GOAL_PROCS:-2}"); do
    for variant in "--drop-fusion-passes fp8_norm_linear" "$tables"; do
      latency_run "$LOG_DIR/normab.log" "round $round: ${variant:-FP8 (default passes)}" "$one" \
        "$variant"
    done
  done
  { echo; echo "## fp8_norm_linear (tests, sweeps, FP8 batch 1 by round)"
    tail -n 1 "$LOG_DIR/normab_tests.log"
    grep -E "^\| |M= 1|fastest|wrote" "$LOG_DIR/normab_sweeps.log"
    grep -E "^### round|^\| 1 " "$LOG_DIR/normab.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" bf16normab "* ]]; then
  # skinny_norm_linear (the add + RMSNorm folded into the bf16 skinny GEMM after it): its GPU
  # tests, then bf16 decode with the pass on, NORM_IN_M_BUCKETS empty (the op runs the norm
  # kernel and the GEMM: the base) against the fold at the shape's M bucket, alternating in one
  # process each, GOAL_PROCS rounds (default 2). BF16NORM_SHAPES picks "b1" (batch 1, the fold
  # at M = 1) and "b64" (64 x 1k, the fold at M = 64); default both.
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_skinny_epilogues.py \
    tests/compile/test_skinny_fusion.py -k "fold or norm_linear" 2>&1 \
    | tee "$LOG_DIR/bf16normab_tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  for shape in ${BF16NORM_SHAPES:-b1 b64}; do
    case $shape in
      b1) bucket=1; args="--batch-sizes 1 --decode-steps 64" ;;
      b64) bucket=64; args="--batch-sizes 64 --input-len 1024" ;;
      *) echo "BF16NORM_SHAPES: unknown shape $shape (b1, b64)"; status=1; continue ;;
    esac
    variants="$LOG_DIR/bf16normab_$shape.json"
    python3 - "$variants" "$bucket" "${GOAL_PROCS:-2}" <<'PY'
import json, sys
path = "v1_engine/kernels/skinny_epilogues.py"
old = "NORM_IN_M_BUCKETS: tuple[int, ...] = ()"
fold = [[path, old, f"NORM_IN_M_BUCKETS: tuple[int, ...] = ({sys.argv[2]},)"]]
rounds = int(sys.argv[3])
json.dump([["base", []], [f"fold M={sys.argv[2]}", fold]] * rounds, open(sys.argv[1], "w"))
PY
    python3 benchmarks/ab_variants.py "$variants" "python3 benchmarks/latency.py --model $MODEL \
      $args --prefill-lens '' --repeats 2 --add-fusion-passes skinny_norm_linear" 2>&1 \
      | tee -a "$LOG_DIR/bf16normab.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  { echo; echo "## skinny_norm_linear (tests; bf16 batch 1 and 64 x 1k by variant)"
    tail -n 1 "$LOG_DIR/bf16normab_tests.log"
    grep -E "^== |^ *\| [0-9]" "$LOG_DIR/bf16normab.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" waveab "* ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fp8_decode_gemm.py \
    tests/kernels/test_pdl.py 2>&1 | tee "$LOG_DIR/waveab_tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  python3 - "$LOG_DIR/waveab.json" "${GOAL_PROCS:-2}" <<'PY'
import json, sys
path = "v1_engine/kernels/triton_gemv_fp8_decode.py"
rounds = [[f"early release {n}", [[path, "EARLY_RELEASE_PER_SM = 2", f"EARLY_RELEASE_PER_SM = {n}"]]]
          for n in (0, 1, 2, 4)]
json.dump(rounds * int(sys.argv[2]), open(sys.argv[1], "w"))
PY
  python3 benchmarks/ab_variants.py "$LOG_DIR/waveab.json" "python3 benchmarks/latency.py \
    --model $MODEL --quantization fp8 --batch-sizes 1 --prefill-lens '' --decode-steps 64 \
    --repeats 2" 2>&1 | tee "$LOG_DIR/waveab.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  { echo; echo "## FP8 decode kernel: the last waves' early release (tests; FP8 batch 1)"
    tail -n 1 "$LOG_DIR/waveab_tests.log"
    grep -E "^== |^ *\| 1 " "$LOG_DIR/waveab.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" m1ab "* ]]; then
  # The launches FP8 batch 1 runs by default, re-swept on this card at M = 1 (the norm fold's
  # qkv and gate_up, the weight-only o_proj, down and LM head) into $M1_TABLES, then FP8 batch 1
  # without and with them, one process each, alternating, GOAL_PROCS rounds, and bf16 batch 1
  # once (the goal's denominator). A call of about 7 minutes on an H200.
  m1_tables=${M1_TABLES:-$LOG_DIR/fp8_m1.json}
  for sweep in "norm --shapes qkv" "norm_gated --shapes gate_up" \
               "weight_only --shapes o_proj,down,lm_head"; do
    # shellcheck disable=SC2086
    python3 benchmarks/sweep_skinny_gemm.py --fp8 $sweep --m 1 --seconds "${M1AB_SECONDS:-3}" \
      --json "$m1_tables" 2>&1 | tee -a "$LOG_DIR/m1ab_sweeps.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  one="--batch-sizes 1 --prefill-lens '' --decode-steps 64 --repeats 2"
  variants=("--quantization fp8" "--quantization fp8 --gemm-tables $m1_tables")
  for round in $(seq "${GOAL_PROCS:-2}"); do
    [ "$round" -eq 1 ] && run=("" "${variants[@]}") || run=("${variants[@]}")
    for variant in "${run[@]}"; do
      latency_run "$LOG_DIR/m1ab.log" "round $round: ${variant:-bf16}" "$one" "$variant"
    done
  done
  { echo; echo "## FP8 batch 1 with this card's M = 1 launches (sweeps; bf16, FP8 base / tables by round)"
    grep -E "M= 1|fastest|wrote" "$LOG_DIR/m1ab_sweeps.log"
    grep -E "^### round|^\| 1 " "$LOG_DIR/m1ab.log"; } >> "$summary"
fi
if [[ " $STAGES " == *" blasab "* ]]; then
  # torch's cuBLASLt back-end against its default cuBLAS for the F.linear calls the engine
  # makes (qkv / o_proj at batch 64, every bf16 prefill GEMM): the per-shape table, then bf16
  # batch 64 x 1k and a 4k prefill with and without TORCH_BLAS_PREFER_CUBLASLT=1 (inherited by
  # the engine's core process), alternating, one process each, GOAL_PROCS rounds.
  python3 benchmarks/benchmark_blas_library.py 2>&1 | tee "$LOG_DIR/blasab_gemm.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  shape="--batch-sizes 64 --input-len 1024 --decode-steps 32 --prefill-lens 4096 --repeats 2"
  for round in $(seq "${GOAL_PROCS:-2}"); do
    for lt in "" 1; do
      label="cuBLAS (torch's default)"
      unset TORCH_BLAS_PREFER_CUBLASLT
      [ -n "$lt" ] && export TORCH_BLAS_PREFER_CUBLASLT=1 && label="TORCH_BLAS_PREFER_CUBLASLT=1"
      latency_run "$LOG_DIR/blasab.log" "round $round: $label" "$shape" ""
    done
  done
  unset TORCH_BLAS_PREFER_CUBLASLT
  { echo; echo "## cuBLASLt vs cuBLAS (per shape; bf16 64 x 1k and prefill 4k by round)"
    grep -E "^\| |^- " "$LOG_DIR/blasab_gemm.log"
    grep -E "^### round|^\| (64|4096) " "$LOG_DIR/blasab.log"; } >> "$summary"
fi
cp benchmarks/RESULTS.md "$LOG_DIR/RESULTS.md" 2>/dev/null
cat "$summary"
exit $status
