# Sourced by the GPU scripts (scripts/gpu_bench.sh, scripts/gpu_real.sh) after they set ROOT (and cd there), NAME
# and DEVICE: sets DEST ($OUT, else runs/$NAME, created), LOG ($DEST/$NAME.log), PY ($PYTHON, else python3) and the
# offline environment; defines log(); makes the package importable from the checkout (else an offline editable
# install); exits 2 when a needed package or, with DEVICE=cuda, the GPU is missing; records nvidia-smi and the
# versions. Nothing is downloaded.

DEST="${OUT:-runs/$NAME}"
mkdir -p "$DEST"
LOG="$DEST/$NAME.log"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# cuBLAS reads it at its first matmul: set before any process starts (the buffered coupling's bitwise recompute)
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
PY="${PYTHON:-python3}"

log() { echo "[$NAME $(date +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }

# -- the package: importable from the checkout, else an offline editable install --------------------
if ! "$PY" -c "import revffn" 2>/dev/null; then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  if ! "$PY" -c "import revffn" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || true
  fi
fi
missing=$("$PY" - <<'EOF'
import importlib.util as u
names = ["torch", "transformers", "peft", "safetensors", "tokenizers", "yaml", "tqdm", "psutil"]
print(" ".join(n for n in names if u.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
  log "missing Python packages: $missing (install them from local wheels; this script never downloads)"
  exit 2
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "no CUDA device visible to torch; run with TINY=1 for the CPU smoke version"
  exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi >"$DEST/nvidia-smi.txt" 2>&1
log "python $("$PY" -c 'import sys, torch, transformers, peft; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)')"
