"""What `node start --plan NAME` runs and with which settings: the plans (PLANS) and what each
leaves out, what `--skip` and `--set` change, the recipe A/B's variants and gate, and the
options.json the pipeline reads them from. The compositions themselves are plan_runs.py's and recipe.py's.

Standard library (and yaml) only: the pipeline process reads these on the node's own Python."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpunode import node_env

# What `node start --skip PART` can leave out of a run, and the profile settings that does it
# (each stage gets them as --set, the helper processes in params.yaml). A run that repeats an
# earlier one for the measurements it lacked (the fifth: the gate's decision) leaves out what
# that one measured, so the rest fits the session's device time.
SKIPPABLE: dict[str, dict[tuple[str, str], Any]] = {
    "scaling": {("train", "scaling_fractions"): []},  # the data-scaling drafts (their training, their gate launches)
    "anchor": {},  # SpecForge's draft (its training beside ours, its gate launches)
    # The num_steps sweep and the topk point: the gate decides on num_steps 3 alone, the scaling
    # curve's config (seven launches instead of seventeen: run 6's gate ran out at the twelfth).
    "sweep": {("gate", "num_steps"): [3], ("gate", "topk_points"): []},
}


# What `node start --plan NAME` runs. "full": the real run (gpunode/README.md).
# "online-incumbent": what issues 12 and 14 measure on the real parts, on one generation: the
# offline draft (extract, then train) and the online one (a run root sharing the generation by hard
# links, train.hidden_states online), each timed from the last committed generation shard; a
# 1k-sample run (the first 1,004 training sequences, the size of runs 4-7's smallest scaling draft)
# promoted by hand (`eaglescale promote`: at 135M no draft beats the baseline, runs 4-7, so no gate
# would promote it); both full drafts replayed over the same held-out sequences; then the gate of
# the offline draft with that 1k draft as the incumbent. It leaves out what the full plan measured
# (the scaling drafts, SpecForge's, the sweep, the reference request and the agreement check).
# "lossless": what issue 26 measures on the real parts, on one generation: the logprob probe on the
# generation server (gpunode/logprob_probe.py: the recorded answers the parsers' tests
# read, and how far decode and prefill logprobs are apart), the full draft trained online, the
# gate with the lossless rule over num_steps 1, 3 and 5 with the server's break-even measured at
# each (SGLANG_SIMULATE_ACC_LEN), then the same gate with a frequency penalty in its requests on a
# run root sharing the draft (num_steps 3): the penalty SGLang applies relaxed under speculation
# must be refused as not lossless.
# "recipe": issue 27's A/B of the training recipe on the real parts, on the regenerated shards of
# an earlier run (`prepare --run-from .../run-9/generation.tar`: no server, no generation; without
# them it generates first). Each variant of RECIPE_VARIANTS (node start --variant; RECIPE_PLANNED
# by default) trains online in its own run root sharing prompts/ and generate/ by hard links, all
# side by side on the GPU, on the same sequences, batches, steps and seed; meanwhile the run's own
# root is extracted (one part per shard: RECIPE_EXTRACT) and SpecForge's draft trains on it, on the
# same batches with the default variant's vocabulary map. Every draft is replayed over the same
# held-out sequences (`node recipe-replay`); one gate on real SGLang measures the default variant
# as the candidate and every other draft as a challenger at num_steps 3 (no sweep, no break-even,
# no incumbent); the best of ours and SpecForge's come back in parts (`node drafts K`).
# "qwen-generate", "qwen-gate", "qwen-sweep", "qwen-scaling": issue 28's run on Qwen2.5-Coder-1.5B
# (`prepare --profile deployments/params/qwen25-coder.yaml`), which no one session holds: each plan
# is one session's share (gpunode/README.md, "Issue 28"), the next starting from
# what the last brought back (`prepare --run-from` the generation; `--draft-from` the draft, when
# the workspace still holds it: a plan that came without one trains it first, ~450 s in run 15, or
# resumes it from `--checkpoint-from`).
# "qwen-generate": the generation and the plain batched request, then the full draft online within
# the session's device time (train.time_budget_s, session_train.py): packed to travel when it ends
# in the session, else its last checkpoint that can still come back (`node checkpoint K`; the next
# session resumes it).
# "qwen-forecast": issue 50's training, which spans sessions: qwen-generate's with the scaling
# drafts first and the full draft's accept length forecast from their curve before its first step
# (train.forecast_full_draft); a stopped scaling draft travels as a checkpoint too, beside those
# finished before it.
# "qwen-gate": the decision, at num_steps 1, 2 and 3 (topk 1) and the topk point (3 steps, topk
# 4): the configs a draft near 1.8 tokens per verify at 3 steps (run 15's, in training's
# evaluation) can win at, the short chains and the tree (run 17: num_steps 1 at 0.77x, so a
# session short of time leaves it out first, gate_plan.gate_trims). "qwen-sweep": num_steps
# 4 and 5 beside 3 again (run 17 measured 3 at 1.04x, run 18 at 0.80x with a draft as good: the
# same session's 3 is what 4 and 5 compare with), and the break-even at num_steps 3.
# "qwen-scaling": the data-scaling drafts trained and gated beside the full draft at num_steps 3
# (a scaling draft is gated where it was trained).
# "verify-probe": the lossless threshold's evidence on the real parts, for a carried draft (`prepare
# --run-from ... --draft-from ...`): one speculative server launched as the gate launches num_steps 3,
# and the logprob probe against it on the gate's prompts (`node verify-probe`): the logprobs its
# verify forward computed beside its own prefill's, at every position.
PLANS = {"full": [], "online-incumbent": ["scaling", "anchor", "sweep"], "lossless": ["scaling", "anchor"],
         "recipe": ["scaling", "sweep"], "qwen-generate": ["scaling", "anchor"], "qwen-forecast": ["anchor"], "qwen-gate": ["scaling", "anchor"],
         "qwen-sweep": ["scaling", "anchor"], "qwen-scaling": ["anchor"], "verify-probe": ["scaling", "anchor", "sweep"]}  # fmt: skip
NEEDS_DRAFT = {"verify-probe"}  # plans that use a carried draft and train none of their own
# Each plan's own settings (section, key) -> value, under --skip's and `node start --set`'s.
PLAN_SETTINGS: dict[str, dict[tuple[str, str], Any]] = {
    # The recipe A/B's token budget: SpecForge's draft and every variant but epochs4 train 3 epochs,
    # the budget runs 4-11 compared at, whatever the profile's (4 since run 11).
    "recipe": {("train", "epochs"): 3},
    "qwen-forecast": {("train", "forecast_full_draft"): True},
    "qwen-gate": {("gate", "num_steps"): [1, 2, 3]},
    "qwen-sweep": {("gate", "num_steps"): [3, 4, 5], ("gate", "topk_points"): [],
                   ("gate", "breakeven_accept_lengths"): [1.5, 2.0, 2.5], ("gate", "breakeven_num_steps"): [3]},
    "qwen-scaling": {("gate", "num_steps"): [3], ("gate", "topk_points"): []},
}
LOSSLESS_GATE = ("gate.num_steps=[1, 3, 5]", "gate.topk_points=[]", "gate.breakeven_accept_lengths=[1.5, 2.5, 3.5]",
                 "gate.breakeven_prompts=8")  # fmt: skip
PENALTY_GATE = ("gate.num_steps=[3]", "gate.topk_points=[]", "gate.breakeven_accept_lengths=[]",
                "gate.frequency_penalty=1.0")  # fmt: skip
# The recipe variants (issue 27), each the --set overrides of its train stage on top of the
# profile's recipe at the plan's 3 epochs (PLAN_SETTINGS; 16,384 tokens a step, lr 1e-3, seed 0:
# the same for all of them but epochs4). Run 10 measured the first five on the held-out replay
# (BENCHMARKS P11), against the default of then, betas (0.9, 0.95): SpecForge's betas (0.9,
# 0.999) +1.1% (paired CI +0.3%..+1.8%: the default since), its per-token loss normalisation
# +0.0%, the lm_head and final norm started from the target's (init, as vLLM's speculators does)
# -1.9%, the three together -1.8%. betas95 is the recipe of before run 10; freeze keeps the
# initialised head fixed as speculators does; noise is speculators' AddGaussianNoise default
# (0.05, absolute, on the aux states); epochs4 is the equal-wall-clock comparison with
# SpecForge's 3 epochs (ours takes 1/1.36 of its time a step, P4: 3 x 1.36 ~ 4 epochs in its
# time). Run 11 (P12) measured the plan below: the default level with SpecForge's draft at 3
# epochs (replay 1.006x, SGLang 1.036x, both CIs across 1), epochs4 above both (replay +6.3%
# over the default; SGLang 1.097x SpecForge's, the difference's CI above zero): the profile's
# epochs since.
# What is planned is what fits a session. Run 10 trained five online drafts side by side in
# 1,424 s, about the sum of their times alone (the GPU time-slices processes), with the
# extraction beside them at 451 s (~100 s alone) and SpecForge's 705 s; the gate never ran. So
# the plan is the default and epochs4 beside SpecForge's draft, and the gate measures all three
# on real SGLang (RECIPE_PLANNED's estimate: BENCHMARKS P12; run 11 took
# 1,188 s from setup to the packed drafts).
_INIT = ("train.init_lm_head_from_target=true", "train.init_norm_from_target=true")
RECIPE_VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "betas95": ("train.adam_betas=[0.9, 0.95]",),
    "token": ("train.loss_normalization=token",),
    "init": _INIT,
    "freeze": (*_INIT, "train.freeze_lm_head=true"),
    "noise": ("train.aux_state_noise=0.05",),
    "epochs4": ("train.epochs=4",),
    # Twice the profile's peak lr, same steps: run 11's drafts were still rising as the lr reached
    # zero, so at SpecForge's token budget a faster start might have been what 3 epochs lack. Run 14
    # (P15): -1.3% by replay, level with SpecForge's on SGLang; noise, trained after it, -0.8%.
    "lr2x": ("train.learning_rate=0.002",),
}
RECIPE_PLANNED = ["default", "epochs4"]
# One extract part per generation shard (2,000 sequences, ~2.6 GB of states): offline epoch plans
# then draw the same batches as online ones (tasks/draft/online.py), so SpecForge's draft sees
# exactly the batches ours do (run 8, with two parts a shard: 678 steps offline, 657 online).
RECIPE_EXTRACT = "extract.part_bytes=8589934592"
RECIPE_GATE = ("gate.breakeven_accept_lengths=[]", 'gate.incumbent="off"')  # quoted: YAML reads off as false
RECIPE_ROOT = "recipe-"  # NODE/recipe-<variant>
# The recipe gate's contender names (tasks.gate.plan.NEW_DRAFT, tasks.gate.contenders.CHALLENGER_PREFIX:
# spelled out, the pipeline process imports nothing of tasks/).
RECIPE_CANDIDATE, RECIPE_CHALLENGER = "new draft", "challenger-"


def contender_name(gate_name: str) -> str:
    """The recipe variant (or "specforge") a recipe gate contender is: the candidate is the default."""
    return "default" if gate_name == RECIPE_CANDIDATE else gate_name.removeprefix(RECIPE_CHALLENGER)


def recipe_gate_sets(challengers: dict[str, Path]) -> list[str]:
    """The recipe gate's --set overrides: `challengers` (name -> exported draft folder) measured
    beside the candidate at num_steps 3, never promoted."""
    entries = ", ".join(f"{{name: {name}, path: {path}, num_steps: 3}}" for name, path in challengers.items())
    return [*RECIPE_GATE, f"gate.challengers=[{entries}]"]


SMALL_RUN_REASON = (f"the {node_env.SMALL_RUN_SEQUENCES}-sample draft, promoted by hand as the incumbent to beat: "
                    "on SmolLM2-135M no draft beats the baseline (real runs 4-7), so no gate promotes one")  # fmt: skip


def parse_settings(texts: list[str]) -> list[list[Any]]:
    """`node start --set SECTION.KEY=VALUE` as [section, key, value] (the value read as YAML, as
    `eaglescale run --set` reads it): the pipeline process applies them without tasks.config."""
    import yaml

    out = []
    for text in texts:
        key, sep, value = text.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ValueError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. train.epochs=2")
        out.append([parts[0], parts[1], yaml.safe_load(value)])
    return out


def plan_options(skip: list[str], plan: str, variants: list[str] | None, settings: list[list[Any]] | None = None) -> dict[str, Any]:
    """options.json: what the pipeline leaves out (--skip and the plan's own), the plan, the
    recipe plan's variants (the default first: it is the gate's candidate, always trained) and
    the settings of `node start --set` (over the plan's and --skip's)."""
    options: dict[str, Any] = {"skip": sorted({*skip, *PLANS[plan]}), "plan": plan}
    if variants:
        options["variants"] = list(dict.fromkeys(["default", *variants]))
    if settings:
        options["settings"] = settings
    return options

