"""The gate a session runs for the device time it has left (`node start --budget`): the largest of
gate_plan.gate_trims whose forecast ends in it, or, for the data-scaling gate, the whole gate or
one repetition of it or none (a gate cut short writes no curve, so the drafts travel instead).

Every estimate is the product's (gate_plan.py, a helper process: the gate's config as the stage
loads it, forecast_launches at the profile's forecast keys); a session adds GATE_FIXED_S for what
the forecast leaves out."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from gpunode import node_env
from gpunode.node_env import read_json
from gpunode.travel import SCALING_INDEX

# What the forecast does not count: the replay and preflight before the launches and the report
# after (~90 s on the Qwen profile, BENCHMARKS P19 and P28).
GATE_FIXED_S = 90.0


def gate_s(row: dict[str, Any]) -> float:
    """A gate's device time: its launches' forecast and GATE_FIXED_S."""
    return GATE_FIXED_S + row["device_s"]


class GateSession:
    def gate_plan(self, scaling_drafts: int = 0) -> dict[str, Any]:
        """gate_plan.gate_plan for the gate stage as this pipeline runs it (the profile and every
        stage's --set), from a helper process on the node's site folder."""
        cache = self.__dict__.setdefault("_gate_plans", {})
        key = (tuple(self.sets), scaling_drafts)
        if key not in cache:
            sets = [a for o in self.sets for a in ("--set", o)]
            args = [sys.executable, *node_env.node_step("gate-plan", str(self.profile)), "--scaling-drafts",
                    str(scaling_drafts), *sets]  # fmt: skip
            out = subprocess.run(args, env=self.env, cwd=node_env.REPO, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"node gate-plan exited {out.returncode}: {out.stderr[-2000:]}")
            cache[key] = json.loads(out.stdout.strip().splitlines()[-1])
        return cache[key]

    def least_gate_s(self) -> float:
        """The least gate that decides (the baseline and the kept chain): what a draft trained in
        the session leaves its time (train-fit.json's reserve_s)."""
        return gate_s(self.gate_plan()["trims"][-1])

    def gate_within_budget(self) -> list[str]:
        """The gate's --set overrides for the device time left: the largest of the trims that ends
        in it, else the least that decides; measurements.json's gate_trimmed says what was left
        out. A gate cut short decides nothing, so fewer launches are the better chance even when
        they too look long."""
        left = self.seconds_to_deadline()
        if left is None:
            return []
        trims = self.gate_plan()["trims"]
        if len(trims) == 1:
            return []
        chosen = next((t for t in trims if gate_s(t) <= left), trims[-1])
        if not chosen["sets"]:
            return []
        whole = trims[0]
        left_out: list[Any] = [{"num_steps": k} for k in whole["num_steps"] if k not in chosen["num_steps"]]
        left_out += [p for p in whole["topk_points"] if p not in chosen["topk_points"]]
        self.save_measure("gate_trimmed", {"seconds_left": left, "whole_gate_s": gate_s(whole), "gate_s": gate_s(chosen),
                                           "left_out": left_out})  # fmt: skip
        return chosen["sets"]

    def scaling_gate_within_budget(self) -> list[str] | None:
        """qwen-scaling's gate for the device time left: the whole gate (the baseline and the full
        draft `repetitions` times, each scaling draft once), else one repetition of each (the
        curve's points need one launch each; the second repetition narrows the decision's CI), as
        --set overrides; else None. A gate cut short writes no curve, so one that would not end is
        not started: status.json's gate step says so, the scaling drafts travel (`node
        scaling-drafts K`, then the next session's `prepare --scaling-from`) and that session
        gates them with nothing to train."""
        drafts = len((read_json(self.run_root / SCALING_INDEX) or {}).get("drafts", []))
        plan = self.gate_plan(scaling_drafts=drafts)
        whole, need = gate_s(plan["trims"][0]), gate_s(plan["one_repetition"])
        left = self.seconds_to_deadline()
        left = float("inf") if left is None else left
        if whole <= left:
            return []
        if need <= left:
            self.save_measure("gate_trimmed", {"seconds_left": left, "whole_gate_s": whole, "gate_s": need,
                                               "left_out": ["repetition 2"]})  # fmt: skip
            return ["gate.repetitions=1"]
        packed = self.done_before("scaling-pack")
        self.note("gate", "skipped", f"even one repetition needs ~{need:.0f} s (gate.forecast_launch_s, forecast_tok_s), "
                  f"{left:.0f} s are left: " + ("the scaling drafts travel (`node scaling-drafts K`, then `prepare "
                  "--scaling-from`) and the next session gates them" if packed else
                  "and the scaling drafts were not packed (status.json's scaling-pack)"))  # fmt: skip
        self.save_measure("gate_skipped", {"seconds_left": left, "gate_s": need})
        return None
