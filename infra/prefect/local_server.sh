#!/usr/bin/env bash
# A real Prefect server on loopback for eaglescale: profile, server, work pools, a process
# worker, the deployments and the automations. `make server` / `make server-stop` call this.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${EAGLESCALE_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
PORT="${EAGLESCALE_PREFECT_PORT:-4200}"
PROFILE="${EAGLESCALE_PREFECT_PROFILE:-eaglescale-local}"
DB_URL="${EAGLESCALE_PREFECT_DB_URL:-}"
SLACK_BLOCK="${EAGLESCALE_SLACK_BLOCK:-}"
STATE="${EAGLESCALE_PREFECT_STATE:-$ROOT/.eaglescale/prefect-server}"
WORKER=1
DEPLOY=1
DRY_RUN=0

usage() {
  cat <<EOF
usage: infra/prefect/local_server.sh [start|stop|status] [options]

start (default): write the Prefect profile '$PROFILE' (PREFECT_API_URL pinned to
  http://127.0.0.1:PORT/api, analytics off, SQLite in PREFECT_HOME unless --database-url),
  start 'prefect server start' on 127.0.0.1, create the work pools eaglescale-process
  (process) and eaglescale-gpu (kubernetes, infra/k8s/gpu-base-job-template.json), start a
  process worker on eaglescale-process, deploy deployments/prefect.yaml and apply
  deployments/automations/. Logs and pid files go to $STATE.
stop: stop the worker and the server this script started (by their pid files).
status: say whether they are running.

options:
  --port N              server port (default $PORT; env EAGLESCALE_PREFECT_PORT)
  --profile NAME        Prefect profile to write (default $PROFILE; env EAGLESCALE_PREFECT_PROFILE)
  --database-url URL    PostgreSQL, e.g. postgresql+asyncpg://prefect:PW@127.0.0.1:5432/prefect
                        (env EAGLESCALE_PREFECT_DB_URL; default: SQLite)
  --slack-block T/NAME  notification block for the Slack automations, e.g.
                        slack-webhook/eaglescale-slack (env EAGLESCALE_SLACK_BLOCK). With
                        SLACK_WEBHOOK_URL in the environment, the webhook is saved as the
                        Secret block eaglescale-slack (deployment runs read it) and, without
                        --slack-block, as the notification block slack-webhook/eaglescale-slack;
                        with neither, only the zombie-run automation is applied (it says so)
  --no-worker           do not start the process worker
  --no-deploy           do not deploy or apply automations
  --dry-run             print the commands instead of running them
  -h, --help            this text
EOF
}

ACTION=start
while [ $# -gt 0 ]; do
  case "$1" in
    start|stop|status) ACTION="$1" ;;
    --port) PORT="${2:?--port needs a value}"; shift ;;
    --profile) PROFILE="${2:?--profile needs a value}"; shift ;;
    --database-url) DB_URL="${2:?--database-url needs a value}"; shift ;;
    --slack-block) SLACK_BLOCK="${2:?--slack-block needs a value}"; shift ;;
    --no-worker) WORKER=0 ;;
    --no-deploy) DEPLOY=0 ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "local_server.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$PORT" in ''|*[!0-9]*) echo "local_server.sh: --port must be a number, got '$PORT'" >&2; exit 2 ;; esac

API_URL="http://127.0.0.1:$PORT/api"

run() {
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

quiet() {  # run, keeping only errors on the terminal (a dry run still prints the command)
  if [ "$DRY_RUN" = 1 ]; then run "$@"; else "$@" >/dev/null; fi
}

prefect() {
  quiet "$PYTHON" -m prefect --profile "$PROFILE" "$@"
}

background() {  # name, command...: start detached, remember the pid
  local name="$1"; shift
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; echo "&  # -> $STATE/$name.pid"; return; fi
  setsid "$@" >"$STATE/$name.log" 2>&1 < /dev/null &
  echo $! >"$STATE/$name.pid"
}

alive() { [ -f "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }

stop_one() {
  local name="$1"
  if alive "$name"; then
    local pid; pid="$(cat "$STATE/$name.pid")"
    run kill -TERM -- "-$pid"  # its process group: the worker's flow-run children too
    [ "$DRY_RUN" = 1 ] || for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    echo "stopped $name (pid $pid)"
  else
    echo "$name: not running"
  fi
  [ "$DRY_RUN" = 1 ] || rm -f "$STATE/$name.pid"
}

if [ "$ACTION" = stop ]; then
  stop_one worker
  stop_one server
  exit 0
fi
if [ "$ACTION" = status ]; then
  for name in server worker; do
    if alive "$name"; then echo "$name: running (pid $(cat "$STATE/$name.pid"))"; else echo "$name: not running"; fi
  done
  exit 0
fi

[ "$DRY_RUN" = 1 ] || mkdir -p "$STATE"
if alive server; then
  echo "local_server.sh: a server started here is already running (pid $(cat "$STATE/server.pid")); 'stop' first" >&2
  exit 1
fi

# The profile pins the API URL: with it unset, `prefect deployment run` would talk to a fresh
# ephemeral server and report the deployment "not found".
quiet "$PYTHON" -m prefect --no-prompt profile create "$PROFILE" 2>/dev/null || true
settings=("PREFECT_API_URL=$API_URL" "PREFECT_SERVER_ANALYTICS_ENABLED=false")
[ -n "$DB_URL" ] && settings+=("PREFECT_SERVER_DATABASE_CONNECTION_URL=$DB_URL")
prefect config set "${settings[@]}"
if [ -z "$DB_URL" ]; then prefect config unset PREFECT_SERVER_DATABASE_CONNECTION_URL 2>/dev/null || true; fi

background server "$PYTHON" -m prefect --profile "$PROFILE" server start --host 127.0.0.1 --port "$PORT"
if [ "$DRY_RUN" = 0 ]; then
  for _ in $(seq 1 240); do
    "$PYTHON" -c "import httpx,sys; sys.exit(httpx.get('$API_URL/health', timeout=2).status_code != 200)" \
      2>/dev/null && break
    alive server || { echo "prefect server exited; see $STATE/server.log" >&2; exit 1; }
    sleep 0.5
  done
  "$PYTHON" -c "import httpx; httpx.get('$API_URL/health', timeout=2).raise_for_status()" \
    || { echo "prefect server not healthy after 120 s; see $STATE/server.log" >&2; exit 1; }
fi

prefect work-pool create eaglescale-process --type process --overwrite
prefect work-pool create eaglescale-gpu --type kubernetes --overwrite \
  --base-job-template "$ROOT/infra/k8s/gpu-base-job-template.json"

if [ "$WORKER" = 1 ]; then
  # EAGLESCALE_ROOT is where the deployments' pull step finds this checkout.
  background worker env EAGLESCALE_ROOT="$ROOT" \
    "$PYTHON" -m prefect --profile "$PROFILE" worker start --pool eaglescale-process --type process
fi

if [ "$DEPLOY" = 1 ]; then
  # Deployed without EAGLESCALE_ROOT, so each worker resolves its own checkout at run time.
  deploy=(env -u EAGLESCALE_ROOT "$PYTHON" -m prefect --profile "$PROFILE" --no-prompt
    deploy --prefect-file deployments/prefect.yaml --all)
  if [ "$DRY_RUN" = 1 ]; then
    echo "cd $ROOT && $(printf '%q ' "${deploy[@]}")"
  else
    (cd "$ROOT" && "${deploy[@]}" >"$STATE/deploy.log" 2>&1) \
      || { echo "prefect deploy failed; see $STATE/deploy.log" >&2; exit 1; }
  fi
  # Slack: a webhook in this environment is saved as blocks on the server (the flows of
  # deployment runs read it there; the automations post through it); without one, the Slack
  # automations are skipped and automations.py says which, and the command that turns them on.
  slack_args=()
  if [ -n "${SLACK_WEBHOOK_URL:-}" ]; then slack_args+=(--slack-webhook-from-env); fi
  if [ -n "$SLACK_BLOCK" ]; then slack_args+=(--slack-block "$SLACK_BLOCK"); fi
  if [ "${#slack_args[@]}" = 0 ]; then slack_args=(--skip-notifications); fi
  run env PREFECT_PROFILE="$PROFILE" "$PYTHON" "$ROOT/infra/prefect/automations.py" "${slack_args[@]}"
fi

cat <<EOF

Prefect server: $API_URL (UI: http://127.0.0.1:$PORT), profile '$PROFILE'; logs in $STATE.
In your shell:   export PREFECT_PROFILE=$PROFILE      (or: prefect profile use $PROFILE)
Run the smoke DAG (its own run folder, .eaglescale/runs/local-smoke) and watch it:
  prefect deployment run 'data-scaling/local-smoke' --watch        # the run's state; exits 1 on failure
  .venv/bin/eaglescale status .eaglescale/runs/local-smoke --follow  # in another terminal: stage by stage
  UI: http://127.0.0.1:$PORT  (the run's first page: its summary artifact, the stage graph)
A fresh run: add --param run_root=.eaglescale/runs/local-smoke-2 (an existing run folder resumes).
Stop everything: make server-stop   (or: infra/prefect/local_server.sh stop)
EOF
