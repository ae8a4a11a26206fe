"""The pipeline's own state and how it runs things: status.json and measurements.json (what ran,
how far, what it measured), the plan's settings as every stage's --set and as params.yaml (what
the helper processes load), a helper process, and a stage: `eaglescale run --stages X`, the one
stage runner (the same command the operator runs; its flows call the stages' compositions).

This process runs on the node's own Python, which has no pydantic: it reads the profile with yaml
and imports nothing of tasks/ (tests/test_gpunode_plans.py reads the pipeline's modules for it);
the processes it starts get the bundle's site folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpunode import node_env
from gpunode.node_env import read_json
from gpunode.plans import PLAN_SETTINGS, RECIPE_PLANNED, SKIPPABLE
from gpunode.setup import KERNEL_CACHES
from gpunode.travel import carried, carried_start_draft, run_holds

# A stage's CLI asked to stop (SIGTERM) ends within seconds with every shard's requests so far
# journaled (flows/stopping.py; ~2 s on a 2-core box, tests/test_cli_stop.py): this bounds it.
STAGE_STOP_S = 60.0


class SessionEnds(Exception):
    """The plan stopped where the session's device time ends (`node start --budget`), having
    packed what travels to the next session."""


def end_process(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Ends a stage's CLI that is still running: SIGTERM to the CLI alone (it ends what it
    started: flows/stopping.py), then its whole session after `grace_s`. The journals are
    crash-safe: a kill loses no journaled request."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class PipelineCore:
    def __init__(self) -> None:
        self.status: dict[str, Any] = {"state": "running", "steps": {}, "started_at": time.time()}
        # A restarted pipeline (`node start` again after a failure) keeps the steps done before.
        before = (read_json(node_env.NODE / "status.json") or {}).get("steps", {})
        self.status["steps"] = {k: v for k, v in before.items() if v.get("state") == "done"}
        self.measure: dict[str, Any] = read_json(node_env.NODE / "measurements.json") or {}
        (node_env.NODE / "logs").mkdir(parents=True, exist_ok=True)
        self.site = node_env.NODE / "site"
        self.run_root = node_env.NODE / "run"
        self.env = {
            **os.environ, "PYTHONPATH": f"{self.site}:{node_env.REPO}", "EAGLESCALE_CACHE": str(node_env.NODE / "cache"),
            "PREFECT_HOME": str(node_env.NODE / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            **{var: str(node_env.NODE / name) for var, name in KERNEL_CACHES.items()},
        }  # fmt: skip
        self.server: subprocess.Popen[bytes] | None = None
        options = read_json(node_env.NODE / "options.json") or {}
        self.skip: list[str] = options.get("skip", [])
        self.plan: str = options.get("plan", "full")
        self.variants: list[str] = options.get("variants") or RECIPE_PLANNED
        self.lock = threading.RLock()  # steps run side by side note their states from their own threads
        self.profile = node_env.node_profile()
        # The plan's settings, then what --skip leaves out, then `node start --set`'s: each stage
        # gets them as --set, the helper processes in params.yaml (write_params).
        self.settings: dict[tuple[str, str], Any] = {
            **PLAN_SETTINGS.get(self.plan, {}), **{k: v for part in self.skip for k, v in SKIPPABLE[part].items()},
            **{(section, key): value for section, key, value in options.get("settings", [])},
        }  # fmt: skip
        self.sets = self._sets()
        self._start_from_carried_draft()  # a restarted pipeline's, whose setup unpacked it already

    def _sets(self) -> list[str]:
        """The settings as each stage's --set, with the node's registry (as params.yaml has it)."""
        return [*node_env.EXTRA_SETS, *(f"{'.'.join(k)}={json.dumps(v)}" for k, v in self.settings.items()),
                f"gate.registry_url={node_env.NODE / 'registry'}"]  # fmt: skip

    def _start_from_carried_draft(self) -> None:
        """`prepare --start-from`: the draft trains from the carried one (train.init_from), with no
        scaling drafts (a continued draft is no point of a from-scratch curve). Known once setup
        has unpacked the payload."""
        start = carried_start_draft()
        if start is not None and self.settings.get(("train", "init_from")) != str(start):
            self.settings.update({("train", "init_from"): str(start), ("train", "scaling_fractions"): []})
            self.sets = self._sets()

    def set_setting(self, section: str, key: str, value: Any) -> None:
        """One more setting, on every later stage's --set and params.yaml."""
        self.settings[(section, key)] = value
        self.sets = self._sets()
        self.write_params()

    # -- what ran, and what it measured

    def note(self, step: str, state: str, detail: str = "", **extra: Any) -> None:
        with self.lock:
            entry = self.status["steps"].setdefault(step, {})
            if state == "running":  # a step run again after a restart times its own pass
                entry.pop("began_at", None)
            entry.update(state=state, **extra)
            entry.setdefault("began_at", time.time())
            if state in ("done", "failed", "stopped"):
                entry["seconds"] = time.time() - entry["began_at"]
            self.status.update(step=step, state="running" if state != "failed" else "failed", detail=detail)
            self._write_status()
        print(f"== {step}: {state} {detail}", flush=True)

    def _write_status(self) -> None:
        (node_env.NODE / "status.json").write_text(json.dumps(self.status, indent=1))

    def save_measure(self, key: str, value: Any) -> None:
        # Helper processes (reference, agreement) write measurements.json too: merge, never drop theirs.
        with self.lock:
            self.measure = {**(read_json(node_env.NODE / "measurements.json") or {}), **self.measure, key: value}
            (node_env.NODE / "measurements.json").write_text(json.dumps(self.measure, indent=1, default=str))

    def done_before(self, step: str) -> bool:
        return self.status["steps"].get(step, {}).get("state") == "done"

    def optional(self, step: Callable[[], Any], label: str, mark: bool = False) -> None:
        """Run `step` (the step `label`); a failure is recorded in status.json and the plan goes
        on with what does not need it. `mark`: note the step done here (stage() notes its own)."""
        try:
            step()
            if mark:
                self.note(label, "done")
        except Exception as e:  # noqa: BLE001 - recorded, and the rest of the plan still measures
            with self.lock:
                self.status["steps"].setdefault(label, {}).update(state="failed-part", error=f"{type(e).__name__}: {e}")
                self._write_status()
            print(f"== {label}: failed-part {type(e).__name__}: {e}", flush=True)

    # -- processes

    def py(self, args: list[str], log: str, env: dict[str, str] | None = None, wait: bool = True) -> Any:
        with (node_env.NODE / "logs" / f"{log}.log").open("ab") as f:
            proc = subprocess.Popen([sys.executable, *args], cwd=node_env.REPO, env=env or self.env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        if not wait:
            return proc
        if proc.wait() != 0:
            raise RuntimeError(f"{' '.join(args[:3])} exited {proc.returncode} (logs/{log}.log)")
        return proc

    def stage(self, stage: str, *overrides: str, label: str | None = None, env: dict[str, str] | None = None,
              run_root: Path | None = None, watch: Callable[[subprocess.Popen[bytes]], None] | None = None) -> None:  # fmt: skip
        """`eaglescale run --stages STAGE` with the profile, the plan's settings and `overrides`;
        RuntimeError when it fails, naming its log. `label` names the step in status.json and its
        log (default: the stage); `env`, the process's environment (default: the pipeline's);
        `run_root`, default the run's; `watch` follows the process to its end, or stops it and
        raises SessionEnds (generation.watch_generation)."""
        label = label or stage
        sets = [a for o in (*self.sets, *overrides) for a in ("--set", o)]
        args = ["-m", "flows.cli", "run", "--params", str(self.profile), "--run-root", str(run_root or self.run_root),
                "--stages", stage, *sets]  # fmt: skip
        self.note(label, "running", "eaglescale run")
        proc = self.py(args, f"stage-{label}", env, wait=False)
        try:
            if watch is not None:
                watch(proc)
            proc.wait()
        finally:  # a watch that failed must not leave the stage running (run 21's first pass did)
            end_process(proc, STAGE_STOP_S)
        if proc.returncode != 0:
            raise RuntimeError(f"eaglescale run --stages {stage} exited {proc.returncode} (logs/stage-{label}.log)")
        self.note(label, "done", "eaglescale run")

    def trainer_env(self) -> dict[str, str]:
        return {**self.env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # trainers share the GPU

    @property
    def emulated(self) -> tuple[str, ...]:
        """The gate's override in a rehearsal: the SGLang emulator (a CPU box has no SGLang)."""
        return ("gate.engine=emulated",) if node_env.REHEARSAL else ()

    # -- what the run has, and what is left of the session

    def generated(self) -> bool:
        """The run folder came with its generation complete (`prepare --run-from`): no server, no
        regeneration; the generate stage is never run, so its fingerprint is the carried one."""
        return run_holds(self.run_root)["generation"]

    def require_carried_draft(self) -> None:
        if not carried()["draft"]:
            raise RuntimeError(f"--plan {self.plan} gates a draft an earlier session trained; this run came with none "
                               "(prepare --draft-from)")  # fmt: skip

    def seconds_to_deadline(self) -> float | None:
        """The device seconds left of the session (`node start --budget`, which `node start` again
        may move); None without a budget."""
        deadline = read_json(node_env.NODE / "deadline.json")
        return deadline["ends_at"] - time.time() if deadline else None

    # -- the settings as the helper processes read them

    def write_params(self) -> None:
        """The profile with this run root (what the helper processes load)."""
        import yaml

        (node_env.NODE / "params.yaml").write_text(yaml.safe_dump(self.params_data()))

    def params_data(self) -> dict[str, Any]:
        """params.yaml's content: the profile, the rehearsal's sizes, this run root and registry,
        and the plan's, --skip's and --set's settings."""
        import yaml

        data = yaml.safe_load(self.profile.read_text())
        if node_env.EXTRA_SETS:  # the rehearsal's sizes apply to the helper processes too
            from tasks.config import apply_overrides

            data = apply_overrides(data, node_env.EXTRA_SETS)
        data["run_root"] = str(self.run_root)
        data["gate"]["registry_url"] = str(node_env.NODE / "registry")
        # The plan's, --skip's and --set's settings (without tasks.config), after the rehearsal's
        # sizes as in self.sets.
        for (section, key), value in self.settings.items():
            data.setdefault(section, {})[key] = value
        return data
