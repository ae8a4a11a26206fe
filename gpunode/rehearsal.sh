#!/usr/bin/env bash
# The gate at load, rehearsed on a GPU node (benchmarks/load_rehearsal.py, BENCHMARKS P32/P34):
# the SGLang 0.5.14 bundle in parts small enough to travel beside the working tree, the rehearsal
# as a daemon that outlives the call, and its results in $OUT after every call. gpunode/README.md,
# "The gate at load, rehearsed", says how a session runs it.
#
#   bash gpunode/rehearsal.sh part FILE                  # one carried part into /tmp/parts
#   bash gpunode/rehearsal.sh start SHA256 SECONDS ARGS  # the parts joined, checked, unpacked; the
#                                                        # rehearsal started with ARGS, followed
#   bash gpunode/rehearsal.sh wait SECONDS               # followed again (a later call)
set -u
ROOT=${REHEARSAL_ROOT:-/tmp}  # the node's scratch folder (a test points it elsewhere)
PARTS=$ROOT/parts SITE=$ROOT/site WORK=$ROOT/es RESULTS=$ROOT/reh LOG=$ROOT/reh.log PID=$ROOT/reh.pid

follow() {  # until the rehearsal ends or $1 seconds pass; its results so far into $OUT
  local t0; t0=$(date +%s)
  while kill -0 "$(cat "$PID")" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$1" ]; do sleep 10; done
  if kill -0 "$(cat "$PID")" 2>/dev/null; then echo "RUNNING at $(date +%T)"; else echo "DONE at $(date +%T)"; fi
  tail -c 6000 "$LOG"
  # The random-weight models it wrote stay behind: hundreds of MB, and rebuilt from their shape.
  tar -C "$ROOT" -czf "$OUT/reh.tar.gz" --exclude=reh/models reh reh.log 2>/dev/null
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
}

case "${1:-}" in
  part)
    mkdir -p "$PARTS" && cp "$2" "$PARTS/" && ls "$PARTS" ;;
  start)
    sha=$2 seconds=$3; shift 3
    # The daemon runs from a copy of the code in $WORK: a file named relative to the working tree
    # (--reply-tokens benchmarks/results/...) is given to it by its absolute path.
    args=(); for a in "$@"; do if [ -e "$a" ]; then args+=("$(realpath "$a")"); else args+=("$a"); fi; done
    [ -n "$(ls "$PARTS" 2>/dev/null)" ] || { echo "no parts in $PARTS: this machine started bare"; exit 3; }
    got=$(cat "$PARTS"/* | sha256sum | cut -c1-64)
    [ "$got" = "$sha" ] || { echo "the parts in $PARTS ($(ls "$PARTS" | tr '\n' ' ')) add up to $got, not $sha"; exit 4; }
    rm -rf "$SITE" "$WORK" "$RESULTS" && mkdir -p "$SITE" "$WORK/benchmarks"
    cat "$PARTS"/* | tar -xJ -C "$SITE" || exit 5
    # A copy of the code, so that the next call's fresh working tree does not move under the daemon.
    cp -r tasks flows deployments "$WORK/" && cp benchmarks/load_rehearsal.py "$WORK/benchmarks/"
    (cd "$WORK" && PYTHONPATH="$SITE:$WORK" setsid nohup python3 benchmarks/load_rehearsal.py "$RESULTS" \
        --engine sglang "${args[@]}" > "$LOG" 2>&1 < /dev/null & echo $! > "$PID")
    echo "started at $(date +%T): load_rehearsal.py ${args[*]}"
    follow "$seconds" ;;
  wait)
    [ -f "$PID" ] || { echo "no rehearsal on this machine: it started bare"; exit 3; }
    follow "$2" ;;
  *)
    echo "usage: rehearsal.sh part FILE | start SHA256 SECONDS ARGS... | wait SECONDS"; exit 2 ;;
esac
