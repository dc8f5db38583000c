#!/usr/bin/env bash
# One prepared GPU benchmark: `revffn check` (bf16) and `revffn bench` (full, ckpt, revffn, and revffn with
# the in-backward step + adamw8bit / adafactor, and CPU-offloaded AdamW) at the
# Qwen1.5-MoE-A2.7B geometry (config-only preset: random init, bf16), on one CUDA GPU, offline; then a
# 1-GPU torchrun smoke run (NCCL) of a tiny revffn model per strategy, ddp and fsdp; PROFILE=1 adds a step
# profile of ckpt against the buffered coupling (scripts/gpu_profile.py, 3-5 minutes: better a command of its own).
# Finishes in about 5 minutes on an H100/H200 (8 of the 24 layers; the full depth needs ~130 GiB for `full`:
# FULL_DEPTH=1 adds that run). Results (JSON, markdown, plot, log) go to $OUT if set,
# else runs/gpu_bench.
#
#   bash scripts/gpu_bench.sh
#   LAYERS=4 BATCH=4 SEQ=1024 STEPS=3 bash scripts/gpu_bench.sh
#   TINY=1 bash scripts/gpu_bench.sh      # the same commands at a tiny scale on the CPU (checks the script)
#
# Needs: python with torch (CUDA), transformers, peft, safetensors, tokenizers, pyyaml, tqdm, psutil
# (matplotlib optional: without it no .png). The repo runs from its checkout via PYTHONPATH (or is
# installed with `pip install --no-deps -e .` if that works offline); nothing is downloaded.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MODEL="${MODEL:-qwen1.5-moe-a2.7b}"
LAYERS="${LAYERS:-8}"; BATCH="${BATCH:-4}"; SEQ="${SEQ:-1024}"; STEPS="${STEPS:-3}"
DEVICE="${DEVICE:-cuda}"; CHECK_LAYERS="${CHECK_LAYERS:-2}"; HIDDEN=()
# full, ckpt, revffn, and revffn with the optimizer step in backward and low-memory optimizer states
# (issue 13): adamw8bit / adafactor, and the CPU-offloaded AdamW (CUDA only)
IB="optimizer_in_backward=true"
METHODS="${METHODS:-full,ckpt,revffn,revffn:$IB,revffn:$IB:optimizer=adamw8bit,revffn:$IB:optimizer=adafactor,revffn:optimizer_offload=cpu}"
if [ "${TINY:-0}" = 1 ]; then
  LAYERS=1; BATCH=1; SEQ=16; STEPS=1; DEVICE=cpu; CHECK_LAYERS=1; HIDDEN=(--hidden 64)
  METHODS="${METHODS//,revffn:optimizer_offload=cpu/}"  # offload is CUDA only
fi

NAME=gpu_bench
source "$ROOT/scripts/gpu_common.sh"  # DEST, LOG, PY, log(); the package importable; the packages and the GPU, or exit 2
mkdir -p "$DEST/bench"

status=0
# -- 1. consistency check, bf16, at the real width (2 layers: three model copies live at once) -------
log "revffn check --model $MODEL --layers $CHECK_LAYERS --dtype bfloat16 --device $DEVICE"
timeout 240 "$PY" -m revffn check --model "$MODEL" --layers "$CHECK_LAYERS" ${HIDDEN[@]+"${HIDDEN[@]}"} --dtype bfloat16 \
  --device "$DEVICE" --json >"$DEST/check.json" 2>>"$LOG"
rc=$?; log "check exit code $rc: $(head -c 400 "$DEST/check.json")"; [ $rc -ne 0 ] && status=1

# -- 2. bench: full vs ckpt vs revffn, fresh process each, 150 s per method at most -----------------
run_bench() {  # $1: layers, $2: output dir
  log "revffn bench --model $MODEL --layers $1 --batch $BATCH --seq $SEQ --steps $STEPS (bf16, $DEVICE)"
  "$PY" -m revffn bench --model "$MODEL" --methods "$METHODS" --layers "$1" ${HIDDEN[@]+"${HIDDEN[@]}"} \
    --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" --dtype bfloat16 --device "$DEVICE" --timeout 150 \
    --out "$2" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  log "bench exit code $rc (1: a method failed, e.g. out of memory; its row says why)"
  [ -f "$2/bench.md" ] && cat "$2/bench.md" | tee -a "$LOG" >/dev/null
  [ $rc -gt 1 ] && status=1
}
run_bench "$LAYERS" "$DEST/bench"
if [ "${FULL_DEPTH:-0}" = 1 ] && [ "${TINY:-0}" != 1 ]; then
  mkdir -p "$DEST/bench_full_depth"
  run_bench 24 "$DEST/bench_full_depth"
fi
# -- 3. torchrun smoke: one process per strategy (NCCL on CUDA, gloo with TINY=1), 4 steps of revffn on a
#       tiny model, a checkpoint at step 2 (DCP under fsdp) and final/ gathered by rank 0 -------------
for strategy in ddp fsdp; do
  log "torchrun --nproc-per-node 1 revffn train distributed=$strategy ($DEVICE)"
  rm -rf "$DEST/torchrun_$strategy"
  timeout 300 "$PY" -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 --master-port $((29500 + RANDOM % 1000)) \
    -m revffn train model=tiny-qwen2-moe data=builtin:reversal_train eval_data=builtin:reversal_val max_steps=4 \
    save_steps=2 max_seq_length=128 per_device_train_batch_size=4 device="$DEVICE" method=revffn \
    revffn.adapter_warmup_steps=2 distributed="$strategy" output_dir="$DEST/torchrun_$strategy" >>"$LOG" 2>&1
  rc=$?
  log "torchrun $strategy exit code $rc: $(tail -n 1 "$DEST/torchrun_$strategy/metrics.jsonl" 2>/dev/null | head -c 300)"
  { [ $rc -ne 0 ] || [ ! -f "$DEST/torchrun_$strategy/final/revffn.json" ]; } && status=1
done
# -- 4. where the step's time goes (scripts/gpu_profile.py): ckpt, ckpt under deterministic kernels, the buffered
#       default with and without them, chunked and not, the additive coupling; at the bench's hidden-1024 profile
#       (PROFILE=1; alone: python scripts/gpu_profile.py --out $OUT/profile) ----------------------------------
if [ "${PROFILE:-0}" = 1 ]; then
  PROFILE_ARGS=(--layers 8 --hidden 1024 --batch 4 --seq 2048)
  [ "${TINY:-0}" = 1 ] && PROFILE_ARGS=(--layers 1 --hidden 64 --batch 2 --seq 16 --dtype float32 --steps 1 --threads 1)
  log "scripts/gpu_profile.py ${PROFILE_ARGS[*]} ($DEVICE)"
  timeout 400 "$PY" scripts/gpu_profile.py --out "$DEST/profile" --device "$DEVICE" --timeout 90 "${PROFILE_ARGS[@]}" \
    >>"$LOG" 2>&1
  rc=$?; log "profile exit code $rc"; [ $rc -gt 1 ] && status=1
fi
log "done: $DEST (check.json, bench/bench.json|md|png, torchrun_ddp|fsdp/, profile/, gpu_bench.log)"
exit $status
