#!/usr/bin/env bash
# Launch one SGLang server for the generation stage (the target, no speculation) on a GPU node.
# The generate stage reaches it through engine.endpoints (or an sglang-router URL in front of several).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=nccl.sh
. "$here/nccl.sh"

usage() {
  cat <<TXT
usage: launch_target.sh --model PATH [--tp N] [--port PORT] [--host HOST] [--context-length N]
                        [--mem-fraction F] [NCCL options] [--dry-run] [-- EXTRA_SGLANG_ARGS...]

Starts \`python -m sglang.launch_server\` for the target model with tensor parallelism (default 8).
  --model PATH          HF model folder of the target (required)
  --tp N                tensor-parallel size (default 8)
  --port PORT           HTTP port (default 30000); --host HOST (default 0.0.0.0)
  --context-length N    override the model's context length
  --mem-fraction F      --mem-fraction-static for SGLang (default 0.88)
  --dry-run             print the command and environment instead of running it
$NCCL_USAGE
Anything after \`--\` is passed to sglang.launch_server unchanged.
Health: curl http://HOST:PORT/health_generate ; info: curl http://HOST:PORT/server_info
TXT
}

model="" tp=8 port=30000 host=0.0.0.0 ctx="" mem=0.88 dry=0 extra=()
while [ $# -gt 0 ]; do
  if nccl_option launch_target.sh "$@"; then shift "$NCCL_SHIFT"; continue; fi
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --model) model="$2"; shift 2 ;;
    --tp) tp="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --context-length) ctx="$2"; shift 2 ;;
    --mem-fraction) mem="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "launch_target.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "launch_target.sh: --model is required (see --help)" >&2; exit 2; }

cmd=(python -m sglang.launch_server --model-path "$model" --tp "$tp" --host "$host" --port "$port"
     --mem-fraction-static "$mem" --trust-remote-code)
[ -n "$ctx" ] && cmd+=(--context-length "$ctx")
cmd+=("${extra[@]}")

if [ "$dry" = 1 ]; then
  print_nccl_env
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
