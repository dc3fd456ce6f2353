#!/usr/bin/env bash
# GPU check of the execution engine (issue 11), in under 8 minutes, with no download (random-init weights of
# real shapes: timing depends on shapes, not on weights).
#
#   bash eval/gpu_check.sh                # on a CUDA machine; results in outputs/gpu_check/ (OUT_DIR=...)
#   GPU_CHECK_DRY=1 bash eval/gpu_check.sh   # the same steps on the CPU with a tiny model (a syntax check)
#
# Measures, per model shape (SmolLM2-135M, then Llama-2-7B), bf16, batch 1, a 300-token prompt:
#   - forward cost vs T new tokens (full model and LM head): HF modules vs lean layers vs + static cache;
#   - autoregressive decoding: our decoder on the HF modules (eager), on the lean layers, on the static cache,
#     compiled (torch.compile mode="reduce-overhead": CUDA graphs over the static cache), against HF
#     `generate`, with the first compiled call (compile time) reported apart, and the streaming roofline.
# Then, on the large shape, the proposers (issue 19): the cost model measured on the GPU (speed.json meta.costs:
# verification cost per number of new tokens, the number every drafting choice reads) and prompt lookup,
# lookahead and `auto` against autoregressive decoding and HF generate, on prompts written here (random weights:
# acceptance means nothing, the cost of verifying T tokens and the loop's overhead do). Last, EAGLE-3 (issue 26):
# one training step of a head on the large shape (eval/eagle3_check.py: the target's feature pass, the
# training-time-test unroll, backward and AdamW; peak memory), then decoding with that random head.
# Each model runs in its own process under a time limit, so one slow compile cannot eat the other's budget.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-outputs/gpu_check}
mkdir -p "$OUT_DIR"

if [[ "${GPU_CHECK_DRY:-0}" == "1" ]]; then
  DEVICE=cpu; DTYPE=float32; SMALL=tiny-llama; LARGE=tiny-llama; EXIT=2; CONTEXT=40; NEW=8; LIMIT_S=600; LIMIT_L=600
  LIMIT_P=600; LIMIT_E=600
else
  DEVICE=cuda; DTYPE=bfloat16; SMALL=random-smollm2-135m; LARGE=random-llama2-7b; EXIT=8; CONTEXT=300; NEW=64
  LIMIT_S=170; LIMIT_L=200; LIMIT_P=120; LIMIT_E=150
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'" || exit 1
fi

common=(
  "model.device=$DEVICE" "model.dtype=$DTYPE" "exit_layer=$EXIT" "context=$CONTEXT"
  "threads=[4]" "repeats=5" "calls=5" "steps=[1,2,3,5,9,17]" "components=[model,layers_hi,head]"
  "paths=[hf,engine,static]" "ar_paths=[hf,engine,static,compile]" "ar_new_tokens=$NEW" "ar_repeats=3"
  "overhead=false" "bf16=false" "bandwidth_mb=2048"
)

status=0
for spec in "$SMALL:$LIMIT_S" "$LARGE:$LIMIT_L"; do
  model=${spec%%:*}; limit=${spec##*:}
  echo "== $model (limit ${limit}s)"
  start=$(date +%s)
  timeout "$limit" python eval/engine.py "model=$model" "${common[@]}" "output_dir=$OUT_DIR/$model" \
    > "$OUT_DIR/$model.log" 2>&1
  rc=$?
  echo "   exit $rc after $(( $(date +%s) - start ))s; log $OUT_DIR/$model.log"
  [[ $rc -eq 0 ]] && cat "$OUT_DIR/$model/engine.md" || { tail -20 "$OUT_DIR/$model.log"; status=1; }
done
echo "== proposers on $LARGE (limit ${LIMIT_P}s)"
prompts="$OUT_DIR/prompts.jsonl"
for i in 1 2 3 4; do
  echo "{\"prompt\": \"Rewrite this paragraph in plain words: the quick brown fox $i jumps over the lazy dog while the farmer watches from the porch and the cat sleeps in the warm sun.\", \"response\": \"ok\"}"
done > "$prompts"
start=$(date +%s)
timeout "$LIMIT_P" python eval/speed.py "model=$LARGE" "model.device=$DEVICE" "model.dtype=$DTYPE" data=jsonl \
  "data.path=$prompts" data.held_out=0 prompt_split=all n_prompts=4 "max_new_tokens=$NEW" repeats=1 \
  'decoder=[autoregressive,auto,prompt_lookup,lookahead,hf_generate]' "output_dir=$OUT_DIR/proposers-$LARGE" \
  > "$OUT_DIR/proposers-$LARGE.log" 2>&1
rc=$?
echo "   exit $rc after $(( $(date +%s) - start ))s; log $OUT_DIR/proposers-$LARGE.log"
[[ $rc -eq 0 ]] && cat "$OUT_DIR/proposers-$LARGE/speed.md" || { tail -20 "$OUT_DIR/proposers-$LARGE.log"; status=1; }
echo "== EAGLE-3 on $LARGE (limit ${LIMIT_E}s): a training step, then decoding with a random-init head"
start=$(date +%s)
eagle="$OUT_DIR/eagle3-$LARGE"
timeout "$LIMIT_E" bash -c "python eval/eagle3_check.py model=$LARGE model.device=$DEVICE model.dtype=$DTYPE \
  out=$eagle && python eval/speed.py model=$LARGE model.device=$DEVICE model.dtype=$DTYPE data=jsonl \
  data.path=$prompts data.held_out=0 prompt_split=all n_prompts=4 max_new_tokens=$NEW repeats=1 \
  drafter=$eagle/head 'decoder=[autoregressive,eagle3]' hf_baseline=null output_dir=$eagle/speed" \
  > "$eagle.log" 2>&1
rc=$?
echo "   exit $rc after $(( $(date +%s) - start ))s; log $eagle.log"
[[ $rc -eq 0 ]] && { cat "$eagle/eagle3_check.json"; cat "$eagle/speed/speed.md"; } || { tail -20 "$eagle.log"; status=1; }
exit $status
