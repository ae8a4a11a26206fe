"""The plans of plans.PLANS as compositions of the pipeline's steps (the recipe plan's is
recipe.py): "full" (the real run), "online-incumbent", "lossless", the qwen plans of issue 28 and
"verify-probe". What each one measures and why: plans.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from gpunode import node_env
from gpunode.node_env import bytes_under, read_json
from gpunode.plans import LOSSLESS_GATE, PENALTY_GATE, SMALL_RUN_REASON
from gpunode.recipe import link_run
from gpunode.travel import carried, run_holds


class Plans:
    def full(self) -> None:
        """The "full" plan: generation with its reference request, extraction beside the
        agreement check, the drafts side by side (training.train), the gate with SpecForge's draft
        as a challenger."""
        self.setup()
        self.write_params()
        self.generate_once(reference=True)  # a restart skips the server's start-up (~2 min)
        if not self.done_before("extract"):
            # The agreement check (transformers' greedy decoding of 32 prompts: latency-bound,
            # a sliver of the GPU) runs beside extraction rather than before it.
            agreement = self._start_agreement()
            self.stage("extract")
            self._end_agreement(agreement)
        self.train()
        gate = list(self.emulated)
        if (node_env.NODE / "specforge/draft/config.json").is_file():  # SpecForge's draft, beside ours
            gate.append(f"gate.challengers=[{{name: specforge, path: {node_env.NODE}/specforge/draft, num_steps: 3}}]")
        self.stage("gate", *gate)

    def _start_agreement(self) -> Any:
        self.note("agreement", "running")
        return self.py(node_env.node_step("agreement"), "agreement", wait=False)

    def _end_agreement(self, agreement: Any) -> None:
        code = agreement.wait()
        self.note("agreement", "done" if code == 0 else "failed-part", f"exit {code}")

    def online_incumbent(self) -> None:
        """The "online-incumbent" plan: one generation, then the offline and the online draft one
        after the other, each alone on the GPU and timed by its run folder's stage clocks; the
        1k-sample run and its promotion by hand; the replay of both full drafts; the gate of the
        offline draft against the baseline and the 1k incumbent."""
        online, small = node_env.NODE / "run-online", node_env.NODE / "run-1k"
        self.setup()
        self.write_params()
        self.generate_once(reference=False)
        link_run(self.run_root, online, ["prompts", "generate"])
        if not self.done_before("offline"):  # extract, then train: one `eaglescale run`
            self.stage("extract,train", label="offline")
        if not self.done_before("online"):
            # A failure here costs issue 12's figure, not the gate's run: recorded, and on.
            self.optional(lambda: self.stage("train", "train.hidden_states=online", label="online", run_root=online),
                          "online")  # fmt: skip
        # What is not timed goes side by side: the 1k-sample run trains while both full
        # drafts are replayed (the replay's figures are accept lengths, not times).
        link_run(self.run_root, small, ["prompts", "generate", "extract"])
        small_train = threading.Thread(target=self.optional, args=(lambda: self.stage(
            "train", f"train.max_train_sequences={node_env.SMALL_RUN_SEQUENCES}", label="train-1k", run_root=small), "train-1k"))  # fmt: skip
        if not self.done_before("train-1k"):
            small_train.start()
        if not self.done_before("replay"):
            self.note("replay", "running")
            self.optional(lambda: self.py(node_env.node_step("replay"), "replay"), "replay", mark=True)
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
        """The "lossless" plan: the probe while the generation server is up, generation, the full
        draft trained online, the gate with the lossless rule and the measured break-even, and
        the gate again with a frequency penalty on a run root sharing the draft."""
        penalty = node_env.NODE / "run-penalty"
        self.setup()
        self.write_params()
        probe = ["-m", "gpunode.logprob_probe", "--url", f"http://127.0.0.1:{node_env.PORT}",
                 "--params", str(node_env.NODE / "params.yaml"), "--out", str(node_env.NODE / "recorded")]  # fmt: skip

        def run_probe() -> None:
            self.note("probe", "running")
            self.optional(lambda: self.py(probe, "probe"), "probe", mark=True)

        self.generate_once(reference=False, while_up=run_probe)
        if not self.done_before("train"):
            self.stage("train", "train.hidden_states=online")
        if not self.done_before("gate"):
            self.stage("gate", *LOSSLESS_GATE, *self.emulated)
        link_run(self.run_root, penalty, ["prompts", "generate", "train"])
        self.optional(lambda: self.stage("gate", *PENALTY_GATE, *self.emulated, label="gate-penalty", run_root=penalty),
                      "gate-penalty")  # fmt: skip

    def qwen_generate(self) -> None:
        """The "qwen-generate" plan: the generation and its plain batched request; then, beside the
        agreement check, the full draft trained within the session (train_in_session): packed to
        travel (`node drafts K`) when it ends in the session, else its last checkpoint that can
        still come back (`node checkpoint K`), which the next session resumes."""
        self.setup()
        self.write_params()
        self.generate_once(reference=True)
        agreement = None if self.done_before("agreement") else self._start_agreement()  # a sliver of the GPU
        self.train_in_session(self.trainer_env())
        if agreement is not None:
            self._end_agreement(agreement)
        self.pack_trained_draft()

    def qwen_forecast(self) -> None:
        """The "qwen-forecast" plan: qwen-generate's, in the pre-registered order
        (train.forecast_full_draft): the data-scaling drafts, the full draft's forecast from their
        curve, then the full draft, all within the session's device time; the draft a session
        stops (a scaling one or the full one) travels as a checkpoint with what was finished
        before it (`node checkpoint K`), and the next session resumes it. Once the full draft has
        trained, it and the scaling drafts are packed for the gate's session."""
        self.setup()
        self.write_params()
        self.generate_once(reference=True)
        self.train_in_session(self.trainer_env())
        if self.pack_trained_draft() and not self.done_before("scaling-pack"):
            self.note("scaling-pack", "running")  # timed: what the travel costs on the node
            self.optional(self.pack_scaling_drafts, "scaling-pack", mark=True)

    def qwen_gate(self) -> None:
        """The "qwen-gate" plan (and "qwen-sweep": the settings differ, plans.PLAN_SETTINGS): the
        gate that decides, on the carried draft or one trained here (draft_to_gate), as much of it
        as ends in the device time left (gate_within_budget: the kept chain stays)."""
        self.setup()
        self.write_params()
        self.generate_once(reference=False)  # only a run that came without its generation (a rehearsal's)
        if self.draft_to_gate() and not self.done_before("gate"):
            self.stage("gate", *self.emulated, *self.gate_within_budget())

    def verify_probe(self) -> None:
        """The "verify-probe" plan: the carried draft's speculative server and the logprob probe
        against it (`node verify-probe`)."""
        self.setup()
        self.require_carried_draft()
        self.write_params()
        self.note("verify-probe", "running")
        self.py(node_env.node_step("verify-probe"), "verify-probe")
        self.note("verify-probe", "done")

    def qwen_scaling(self) -> None:
        """The "qwen-scaling" plan: the data-scaling drafts trained online, then the gate of the
        full draft at num_steps 3 with every scaling draft once (the curve's points, measured and
        replayed). With a carried draft, the scaling drafts train beside each other on its
        vocabulary map; without one, the full draft trains too, the scaling drafts beside it
        (training.train), sized together; carried scaling drafts are only gated."""
        self.setup()
        self.write_params()
        self.generate_once(reference=False)
        came_with = carried()
        if came_with["scaling"]:
            self.note("train-scaling", "done", "carried: an earlier session trained them (prepare --scaling-from)")
        elif not came_with["draft"]:
            # The full draft and the scaling drafts side by side: the curve's points share one recipe.
            fractions = self.params_data()["train"].get("scaling_fractions") or []
            self.epochs_within_budget(drafts=1 + sum(fractions), scaling_drafts=len(fractions))
            if not self.done_before("train-parallel"):
                self.train()  # its trainers' environment is its own
        elif not self.done_before("train-scaling"):
            self._scaling_beside_the_carried_draft()
        if not came_with["scaling"] and not self.done_before("scaling-pack") and run_holds(self.run_root)["scaling"]:
            self.note("scaling-pack", "running")  # timed: what the travel costs on the node
            self.optional(self.pack_scaling_drafts, "scaling-pack", mark=True)
        if not self.done_before("gate") and (sets := self.scaling_gate_within_budget()) is not None:
            self.stage("gate", *self.emulated, *sets)

    def _scaling_beside_the_carried_draft(self) -> None:
        """The scaling drafts at the carried draft's epochs, then one pass over all of them that
        writes the whole index."""
        self.epochs_carried()
        env = self.trainer_env()
        self.note("train-scaling", "running")
        codes = {name: proc.wait() for name, proc in self.start_scaling(env, beside=0).items()}
        self.save_measure("train_scaling_exit", codes)
        self.py(node_env.node_step("scaling"), "train-scaling-index", env)
        self.note("train-scaling", "done" if not any(codes.values()) else "failed-part", json.dumps(codes))


def _clock(run_root: Path, stage: str) -> dict[str, Any]:
    return read_json(run_root / "stages" / f"{stage}.json") or {}


def online_offline_figures(offline: Path, online: Path, small: Path) -> dict[str, Any]:
    """The times from the last committed generation shard to a trained draft (the stage clocks:
    extract start to train end offline, train start to end online), the bytes each wrote for
    hidden states, and the drafts' training results side by side."""
    markers = sorted((offline / "generate/_SUCCESS").glob("*.json"))
    ext, tr, on = _clock(offline, "extract"), _clock(offline, "train"), _clock(online, "train")
    out: dict[str, Any] = {"last_generation_shard_at": max(m.stat().st_mtime for m in markers) if markers else None,
                           "offline_extract": ext, "offline_train": tr, "online_train": on,
                           "small_train": _clock(small, "train")}  # fmt: skip
    if ext.get("started_at") and tr.get("ended_at"):
        out.update(offline_s=tr["ended_at"] - ext["started_at"], offline_extract_s=ext["ended_at"] - ext["started_at"],
                   offline_train_s=tr["ended_at"] - tr["started_at"])  # fmt: skip
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
