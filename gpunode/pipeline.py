"""The pipeline on the node (`node pipeline`, the daemon `node start` launches): one plan of
plans.PLANS composed from its steps, each module a job: core (state, settings, a stage through
`eaglescale run`), setup, generation, training (drafts side by side) and session_train (a draft
within the session's device time), gate_session (the gate that fits), packing (what travels),
plan_runs and recipe (the plans). status.json and measurements.json say how far it got and what
it measured."""

from __future__ import annotations

from gpunode import node_env
from gpunode.core import PipelineCore, SessionEnds
from gpunode.gate_session import GateSession
from gpunode.generation import GenerationSteps
from gpunode.packing import Packing
from gpunode.plan_runs import Plans
from gpunode.recipe import RecipePlan
from gpunode.session_train import TrainingSession
from gpunode.setup import SetupSteps, kernel_cache_sizes
from gpunode.training import ParallelTraining


class Pipeline(Plans, RecipePlan, TrainingSession, ParallelTraining, GateSession, Packing, GenerationSteps, SetupSteps,
               PipelineCore):  # fmt: skip
    def run(self) -> None:
        """The plan options.json names (`node start --plan`), to its end; status.json says how
        far it got, and a failure there names the step."""
        plans = {"full": self.full, "online-incumbent": self.online_incumbent, "lossless": self.lossless,
                 "recipe": self.recipe, "qwen-generate": self.qwen_generate,
                 "qwen-forecast": self.qwen_forecast, "qwen-gate": self.qwen_gate,
                 "qwen-sweep": self.qwen_gate, "qwen-scaling": self.qwen_scaling, "verify-probe": self.verify_probe}  # fmt: skip
        try:
            try:
                plans[self.plan]()
                self.note("finished", "done")
            except SessionEnds as e:
                self.note("finished", "done", f"stopped for the session's end: {e}")
            self.save_measure("kernel_caches", kernel_cache_sizes(node_env.NODE))
            self.status["state"] = "done"
            self._write_status()
        except Exception as e:
            self.note(self.status.get("step", "?"), "failed", f"{type(e).__name__}: {e}")
            raise
        finally:
            self.stop_server()
