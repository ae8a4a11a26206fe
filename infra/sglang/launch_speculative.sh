#!/usr/bin/env bash
# Launch the speculative SGLang server: the target plus an exported EAGLE3 draft, with exactly
# the flags the gate benchmarked (the command comes from `python -m tasks.sglang.command`, the
# builder the gate's launches come from, so this script and the gate cannot drift apart).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=nccl.sh
. "$here/nccl.sh"
py="${EAGLESCALE_PYTHON:-python}"

usage() {
  cat <<TXT
usage: launch_speculative.sh --model PATH (--draft PATH --num-steps N | --baseline) [builder options]
                             [NCCL options] [--python PY] [--dry-run] [-- EXTRA_SGLANG_ARGS...]

Starts \`python -m sglang.launch_server\` for the target with the EAGLE3 draft (or, with
--baseline, the same launch without speculation: the gate's comparison point). The flags are
built per pinned SGLang version (--sglang-version 0.5.4, 0.5.14 or 0.5.23; CUDA-graph flags
differ between them) by tasks/sglang/command.py, which refuses EAGLE instead of EAGLE3, topk=1 with
draft tokens != steps + 1, and extra args that the builder owns or the version does not have
(for 0.5.14: anything not in its recorded --help, and its deprecated aliases).
Use the numbers and the server settings of the promoted config (promoted.json / gate/report.md).

Script options:
  --python PY           interpreter with sglang and eaglescale (default \$EAGLESCALE_PYTHON or python)
  --dry-run             print the NCCL environment and the command instead of running it
$NCCL_USAGE
Builder options (python -m tasks.sglang.command; defaults: --tp 8, --port 30000, --host 0.0.0.0,
--mem-fraction 0.88, --cuda-graph-max-bs 8, --topk 1, --sglang-version 0.5.23):
  --model PATH --draft PATH --baseline --sglang-version V --num-steps N --topk K
  --num-draft-tokens N --correct-draft-tokens --tp N --host H --port P --mem-fraction F
  --cuda-graph-max-bs N|default --disable-cuda-graph
Server settings (the gate's gate.server; each emitted only when given):
  --attention-backend B --sampling-backend B --grammar-backend B --dtype D --skip-tokenizer-init
  --disable-prefill-cuda-graph --sleep-on-idle --disable-radix-cache --max-total-tokens N
  --max-running-requests N --random-seed N
Anything after \`--\` is passed to sglang.launch_server unchanged.
Health: curl http://HOST:PORT/health_generate ; info (echoes the speculative settings):
curl http://HOST:PORT/server_info
TXT
}

dry=0 args=()
while [ $# -gt 0 ]; do
  if nccl_option launch_speculative.sh "$@"; then shift "$NCCL_SHIFT"; continue; fi
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --python)
      if [ $# -lt 2 ] || [[ "$2" == -* ]]; then
        echo "launch_speculative.sh: --python needs a value (see --help)" >&2; exit 2
      fi
      py="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --lines) echo "launch_speculative.sh: --lines is the builder's internal format" >&2; exit 2 ;;
    --) args+=("$@"); break ;;
    *) args+=("$1"); shift ;;
  esac
done

# The builder runs from this checkout when there is one (an installed eaglescale otherwise).
if [ -f "$repo/tasks/sglang/command.py" ]; then
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
# The builder's own errors (exit 2) name the bad flag; set -e passes its status on.
built="$("$py" -m tasks.sglang.command --python "$py" --lines "${args[@]}")"
mapfile -t cmd <<<"$built"

if [ "$dry" = 1 ]; then
  print_nccl_env
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
