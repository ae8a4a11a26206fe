#!/usr/bin/env bash
# Launch one SGLang server for the generation stage (the target, no speculation) on a GPU node.
# The generate stage reaches it through engine.endpoints (or an sglang-router URL in front of several).
# The command comes from `python -m tasks.sglang.command --baseline`, the builder the gate's launches come from, so the
# server settings (attention backend, ...) and the version's flag checks are the gate's.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=nccl.sh
. "$here/nccl.sh"
py="${EAGLESCALE_PYTHON:-python}"

usage() {
  cat <<TXT
usage: launch_target.sh --model PATH [--tp N] [--port PORT] [--host HOST] [--context-length N]
                        [--mem-fraction F] [--sglang-version V] [server settings] [NCCL options]
                        [--python PY] [--dry-run] [-- EXTRA_SGLANG_ARGS...]

Starts \`python -m sglang.launch_server\` for the target model with tensor parallelism (default 8)
and --trust-remote-code. Flags are built per pinned SGLang version by tasks/sglang/command.py, which
refuses flags the version does not have (for 0.5.14: any flag not in its recorded --help).
  --model PATH          HF model folder of the target (required)
  --tp N                tensor-parallel size (default 8)
  --port PORT           HTTP port (default 30000); --host HOST (default 0.0.0.0)
  --context-length N    override the model's context length
  --mem-fraction F      --mem-fraction-static for SGLang (default 0.88)
  --sglang-version V    the installed SGLang (0.5.4, 0.5.14 or 0.5.23; default 0.5.23)
  --cuda-graph-max-bs N decode CUDA-graph batch sizes up to N (default: SGLang's own)
  --python PY           interpreter with sglang and eaglescale (default \$EAGLESCALE_PYTHON or python)
  --dry-run             print the command and environment instead of running it
Server settings (each emitted only when given; gate.server in the params):
  --attention-backend B --sampling-backend B --grammar-backend B --dtype D --skip-tokenizer-init
  --disable-prefill-cuda-graph --sleep-on-idle --disable-radix-cache --max-total-tokens N
  --max-running-requests N --random-seed N
  --disable-radix-cache suits a long regeneration: its prompts share little, and once finished
  requests fill the KV pool the prefix cache makes every admission evict (BENCHMARKS.md P16).
  With --skip-tokenizer-init answers carry no text: generated rows keep output_ids only.
  The H200 node's SGLang 0.5.14: --attention-backend triton --sampling-backend pytorch
  --grammar-backend none --dtype bfloat16
$NCCL_USAGE
Anything after \`--\` is passed to sglang.launch_server unchanged.
Health: curl http://HOST:PORT/health_generate ; info: curl http://HOST:PORT/server_info
TXT
}

dry=0 ctx="" args=() extra=()
while [ $# -gt 0 ]; do
  if nccl_option launch_target.sh "$@"; then shift "$NCCL_SHIFT"; continue; fi
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --python|--context-length)
      if [ $# -lt 2 ] || [[ "$2" == -* ]]; then
        echo "launch_target.sh: $1 needs a value (see --help)" >&2; exit 2
      fi
      if [ "$1" = --python ]; then py="$2"; else ctx="$2"; fi
      shift 2 ;;
    --dry-run) dry=1; shift ;;
    --draft|--baseline|--num-steps|--topk|--num-draft-tokens|--correct-draft-tokens|--lines)
      echo "launch_target.sh: $1 is not an option of the generation server (see launch_speculative.sh)" >&2
      exit 2 ;;
    --) shift; extra=("$@"); break ;;
    *) args+=("$1"); shift ;;
  esac
done

if [ -f "$repo/tasks/sglang/command.py" ]; then
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
sglang_extra=(--trust-remote-code)
[ -n "$ctx" ] && sglang_extra+=(--context-length "$ctx")
sglang_extra+=("${extra[@]}")
# A generation server batches widely: SGLang's own CUDA-graph sizes unless --cuda-graph-max-bs
# (given later on the builder's command line, it wins). The builder's errors (exit 2) name the flag.
built="$("$py" -m tasks.sglang.command --baseline --cuda-graph-max-bs default --python "$py" --lines \
         "${args[@]}" -- "${sglang_extra[@]}")"
mapfile -t cmd <<<"$built"

if [ "$dry" = 1 ]; then
  print_nccl_env
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
