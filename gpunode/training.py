"""Drafts trained side by side on the node's GPU: the run's draft through the train stage, the
data-scaling drafts beside it once its vocabulary map exists (`node scaling`, in as many
processes as the GPU holds), and SpecForge's draft on the run's extracted states
(gpunode/specforge_anchor.py), which gets at most as long again as ours took and never the time
the plan's last steps need."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

from gpunode import node_env
from gpunode.node_env import read_json
from gpunode.setup import gpu_memory_gib

# The session's device time is the run's hard limit: once eaglescale's drafts are trained,
# SpecForge's (planned for the same steps) gets at most as long again as they took, and this
# many seconds at least, then exports the step it reached (its JSON says so).
SPECFORGE_MIN_GRACE_S = 120.0
# And it never eats into what the last steps need: `node start --budget S` says how many seconds
# of device time the pipeline has; SpecForge stops this long before they are up, which leaves the
# final train stage (resume, export: ~1 min) and the gate (22 fresh launches: ~7.5 min) their time.
# A plan whose last steps are fewer reserves less: the recipe plan's are SpecForge's replay (~30 s
# with its capture), a gate of 8 launches (~27 s each, BENCHMARKS P9) and the drafts packed; 560 s
# would stop SpecForge's draft short of the steps ours trained, and that A/B is at equal steps.
LAST_STEPS_RESERVE_S = 560.0
PLAN_LAST_STEPS_RESERVE_S = {"recipe": 330.0}
# What one online trainer of Qwen2.5-Coder-1.5B holds on the GPU at 16,384 tokens a step: 31.6-31.7
# GiB allocated at its peak, 32.1-35.0 reserved (BENCHMARKS P19, P26, P27), with a margin. Three
# side by side (the full draft and two scaling processes, as SmolLM2's fitted the H200) would not
# fit an H100's 80 GiB; the scaling drafts then train in one process (scaling_groups). The GPU
# time-slices the processes (side by side they take about the sum of their times alone: P11), so
# fewer processes cost only the set-ups that no longer overlap. A plan not listed: no limit.
PLAN_TRAINER_GIB: dict[str, float] = {"qwen-scaling": 36.0}


def scaling_groups(fractions: list[float], beside: int, gpu_gib: float | None,
                   trainer_gib: float | None) -> list[list[float]]:  # fmt: skip
    """The processes the scaling drafts train in, each a list of fractions trained one after
    another: the largest alone and the others in a second (one process for all three was the long
    pole beside the full draft: BENCHMARKS P8), or all in one when the GPU's `gpu_gib` hold fewer
    than two more trainers of `trainer_gib` beside the `beside` already training. Unknown sizes:
    the two."""
    fractions = sorted(fractions)
    two = [g for g in (fractions[:-1], fractions[-1:]) if g]
    if gpu_gib is None or trainer_gib is None or len(two) < 2:
        return two
    return two if int(gpu_gib // trainer_gib) - beside >= len(two) else [fractions]


def specforge_command() -> list[str]:
    """SpecForge's draft on the run's extracted states (gpunode/specforge_anchor.py), stopped
    early through the stop file when the device time runs short."""
    return ["-m", "gpunode.specforge_anchor", "--params", str(node_env.NODE / "params.yaml"),
            "--out", str(node_env.NODE / "specforge"), "--stop-file", str(node_env.NODE / "specforge.stop")]  # fmt: skip


class ParallelTraining:
    def train(self) -> None:
        """The draft (the train stage without scaling fractions), then, once its vocabulary map
        exists, the scaling drafts and SpecForge's draft beside it on the same GPU; then the train
        stage once more to resume, export and index what they made.

        The trainers share the GPU: expandable segments keep the caching allocator from holding
        a block per batch shape (without them SpecForge died of out-of-memory beside two of ours:
        BENCHMARKS P8). Each draft's evaluations record its peak CUDA memory. A SpecForge attempt
        that fails beside ours is run once more alone, after them, if the device time (`node
        start --budget`) leaves it room."""
        self.note("train-parallel", "running")
        (node_env.NODE / "specforge.stop").unlink(missing_ok=True)  # a restarted pipeline's old one
        env = self.trainer_env()
        main = threading.Thread(target=self.stage, args=("train", "train.scaling_fractions=[]"),
                                kwargs={"label": "train-draft", "env": env}, daemon=True)  # fmt: skip
        main.start()
        self._wait_for_the_draft_s_vocabulary(main)
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

    def _wait_for_the_draft_s_vocabulary(self, main: threading.Thread) -> None:
        """The scaling drafts read both as they start: the vocabulary they draft over, and the
        training data's record (its split counts and held-out split), which the draft writes a
        few seconds after its vocabulary (its model built, its resume checked)."""
        needed = [self.run_root / "train/vocab_map.safetensors", self.run_root / "train/data.json"]
        while not all(p.exists() for p in needed) and main.is_alive():
            time.sleep(2)
        if missing := [p.name for p in needed if not p.exists()]:  # the draft's training failed
            main.join()
            raise RuntimeError(f"the draft's training wrote no {' and no '.join(missing)}: nothing to train beside it "
                               "(logs/stage-train-draft.log)")  # fmt: skip

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
            procs[f"scaling-{arg}"] = self.py(node_env.node_step("scaling", arg), f"train-scaling-{arg.replace(',', '-')}",
                                              env, wait=False)  # fmt: skip
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

    def seconds_left(self) -> float:
        """Seconds until SpecForge must have stopped (`node start --budget`; unbounded without)."""
        deadline: dict[str, Any] | None = read_json(node_env.NODE / "deadline.json")
        if not deadline:
            return float("inf")
        return deadline["ends_at"] - PLAN_LAST_STEPS_RESERVE_S.get(self.plan, LAST_STEPS_RESERVE_S) - time.time()
