# shellcheck shell=bash disable=SC2034  # NCCL_USAGE and NCCL_SHIFT are read by the sourcing script
# NCCL options shared by the launch scripts (sourced, not run). The seed run's TP8 nodes needed
# the IB/P2P switches, and NCCL_PROTO=LL NCCL_ALGO=Ring NCCL_P2P_LEVEL=SYS cut the speculative
# verify step by ~27% there; the gate treats them as a sweep dimension, so a baseline and the
# speculative server it is compared with must be launched with the same ones.

NCCL_USAGE='  --nccl-ib-disable     export NCCL_IB_DISABLE=1
  --nccl-p2p-disable    export NCCL_P2P_DISABLE=1
  --nccl-proto P        export NCCL_PROTO=P (e.g. LL, LL128, Simple)
  --nccl-algo A         export NCCL_ALGO=A (e.g. Ring, Tree)
  --nccl-p2p-level L    export NCCL_P2P_LEVEL=L (e.g. NVL, SYS)
  --nccl-seed-tuning    the seed run'"'"'s tuning: NCCL_PROTO=LL NCCL_ALGO=Ring NCCL_P2P_LEVEL=SYS'

# nccl_option SCRIPT ARGS...: if ARGS starts with an NCCL option, export its variable and set
# NCCL_SHIFT to the number of words it used; return 1 when it is not an NCCL option.
nccl_option() {
  local script="$1"; shift
  case "$1" in
    --nccl-proto|--nccl-algo|--nccl-p2p-level)
      # A missing value must not swallow the next option (a swallowed --dry-run would launch).
      if [ $# -lt 2 ] || [[ "$2" == -* ]]; then
        echo "$script: $1 needs a value (see --help)" >&2; exit 2
      fi ;;
  esac
  case "$1" in
    --nccl-ib-disable) export NCCL_IB_DISABLE=1; NCCL_SHIFT=1 ;;
    --nccl-p2p-disable) export NCCL_P2P_DISABLE=1; NCCL_SHIFT=1 ;;
    --nccl-proto) export NCCL_PROTO="$2"; NCCL_SHIFT=2 ;;
    --nccl-algo) export NCCL_ALGO="$2"; NCCL_SHIFT=2 ;;
    --nccl-p2p-level) export NCCL_P2P_LEVEL="$2"; NCCL_SHIFT=2 ;;
    --nccl-seed-tuning) export NCCL_PROTO=LL NCCL_ALGO=Ring NCCL_P2P_LEVEL=SYS; NCCL_SHIFT=1 ;;
    *) return 1 ;;
  esac
}

# The NCCL variables in effect, for --dry-run (sorted, so the output is stable).
print_nccl_env() {
  env | grep -E '^NCCL_' | sort || true
}
