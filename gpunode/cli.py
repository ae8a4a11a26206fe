"""`python3 -m gpunode`: `prepare` here, `node ...` on the GPU node (gpunode/README.md says how a
session runs)."""

from __future__ import annotations

import argparse
import sys

from gpunode import node_env
from gpunode.lifecycle import node_receive, node_start, node_wait
from gpunode.plans import PLANS, RECIPE_PLANNED, RECIPE_VARIANTS, SKIPPABLE
from gpunode.travel import node_packed

NODE_STEPS = ["receive", "start", "wait", "pipeline", "reference", "synthesis-reference", "agreement", "scaling", "replay",
              "recipe-replay", "recipe-variant", "drafts", "checkpoint", "generation", "scaling-drafts", "gate-plan",
              "verify-probe"]  # fmt: skip
REPEATABLE_CARRY = {"--checkpoint-from", "--scaling-from"}  # oldest first; the last is carried
CARRY_FLAGS = {
    "--run-from": "an earlier session's generation.tar (what `node wait` brought back): its run folder, generation "
    "complete, travels instead of a fresh discovery, and the node does not regenerate",
    "--draft-from": "an earlier session's drafts.tar (`node drafts K`'s parts joined) of a qwen plan: its draft "
    "travels in the run folder, and the node gates it instead of training one",
    "--checkpoint-from": "an earlier session's checkpoint.tar (`node checkpoint K`'s parts joined) of a draft its "
    "session stopped before the end of its schedule: it travels in the run folder, and the node resumes that draft "
    "at its step, at its epochs. Repeatable, oldest first: the last is carried, and the earlier sessions' tars add "
    "the exports of the finished data-scaling drafts it lists (each session packs only those it trained)",
    "--scaling-from": "an earlier session's scaling-drafts.tar (`node scaling-drafts K`'s parts joined): its "
    "data-scaling drafts travel in the run folder, and the node gates them beside the carried draft instead of "
    "training them (needs --run-from and --draft-from, what they trained beside). Repeatable, oldest first, as "
    "--checkpoint-from: the earlier tars (checkpoint.tar or scaling-drafts.tar) add the exports the last lacks",
    "--anchor-from": "an earlier recipe session's drafts.tar (`node drafts K`'s parts joined): SpecForge's draft "
    "in it travels, and the recipe plan gates and replays it beside this session's variants instead of training "
    "SpecForge's again (needs --run-from, the generation it was trained on)",
    "--start-from": "an earlier session's drafts.tar (`node drafts K`'s parts joined): its exported draft travels "
    "beside the run, and the node trains its draft from those weights (train.init_from, no scaling drafts) instead "
    "of random ones. Every session of that draft carries it (with --checkpoint-from once it stopped mid-schedule)",
    "--reuse-from": "an earlier run's complete generation.tar of the same target and sampling: it travels beside "
    "the run folder, and the node's generation reuses its replies for the prompts they share "
    "(generate.reuse_from), sending only the others",
}


def _prepare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="here: wheels, discovery, payload parts")
    p.add_argument("--bundle", required=True, help="folder with the SGLang bundle's part-* and SHA256")
    for flag, text in CARRY_FLAGS.items():
        p.add_argument(flag, help=text, action="append" if flag in REPEATABLE_CARRY else "store")
    p.add_argument("--profile", default=str(node_env.PROFILE), help="the run's profile, inside this repository (default: "
                   "SmolLM2's); its target's wheels travel in the payload and every node step reads it")  # fmt: skip
    p.add_argument("--set", dest="discover_sets", action="append", default=[], metavar="discover.KEY=VALUE",
                   help="an override of the profile's discover section for the discovery made here, as `eaglescale run "
                   "--set` spells it (list items too: discover.sources[0].prompt_turns=every_user); repeatable. The "
                   "node's stages read the prompts it made, not the section; a later session's prepare with --run-from "
                   "must repeat it (the carried prompts' marker holds the section's hash)")  # fmt: skip
    p.add_argument("--target-wheels", help="a folder already holding the target's wheels (`python -m gpunode.model_parts "
                   "download DIR`): nothing downloaded for it (default: .eaglescale/h200/target-wheels, kept between prepares)")  # fmt: skip


def _node_parser(sub: argparse._SubParsersAction) -> None:
    n = sub.add_parser("node", help="on the GPU node")
    n.add_argument("what", choices=NODE_STEPS)
    n.add_argument("arg", nargs="?")
    n.add_argument("--timeout", type=float, default=540.0)
    n.add_argument("--budget", type=float, help="start: the device seconds the pipeline has (bounds training, SpecForge, the gate)")
    n.add_argument("--set", dest="overrides", action="append", default=[])
    n.add_argument("--plan", default="full", choices=sorted(PLANS), help="start: what the pipeline runs (see PLANS)")
    n.add_argument("--skip", action="append", default=[], choices=sorted(SKIPPABLE),
                   help="start: leave this part out of the run (repeatable): " + ", ".join(sorted(SKIPPABLE)))
    n.add_argument("--variant", dest="variants", action="append", default=[], choices=list(RECIPE_VARIANTS),
                   help=f"start --plan recipe: a variant to train (repeatable; default {', '.join(RECIPE_PLANNED)})")
    n.add_argument("--scaling-drafts", type=int, default=0, help="gate-plan: the data-scaling drafts the gate measures")


def node(args: argparse.Namespace) -> int:
    """One `node WHAT` call."""
    node_env.NODE.mkdir(parents=True, exist_ok=True)
    what = args.what
    if what in ("receive", "start", "wait"):
        return {"receive": lambda: node_receive(int(args.arg)), "wait": lambda: node_wait(args.timeout),
                "start": lambda: node_start(args.budget, args.skip, args.plan, args.variants, args.overrides)}[what]()  # fmt: skip
    if what in ("drafts", "checkpoint", "generation", "scaling-drafts"):
        return node_packed(what, int(args.arg or 0))
    if what in ("pipeline", "recipe-variant"):
        from gpunode.pipeline import Pipeline

        if what == "recipe-variant":
            return Pipeline().recipe_variant(args.arg or "")
        Pipeline().run()
        return 0
    if what == "gate-plan":  # ARG: the profile; --set: every stage's overrides
        from gpunode.gate_plan import node_gate_plan

        return node_gate_plan(args.arg or str(node_env.node_profile()), args.overrides, args.scaling_drafts)
    from gpunode import steps

    if what == "scaling":
        return steps.node_scaling(args.arg)
    if what == "synthesis-reference":  # ARG: the generation server's URL
        return steps.node_synthesis_reference(args.arg)
    return {"reference": steps.node_reference, "agreement": steps.node_agreement, "replay": steps.node_replay,
            "recipe-replay": steps.node_recipe_replay, "verify-probe": steps.node_verify_probe}[what]()  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m gpunode", description="Runs eaglescale on a GPU node with no "
                                     "network, one device call at a time (gpunode/README.md).")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    _prepare_parser(sub)
    _node_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        from gpunode.payload import prepare

        return prepare(args)
    return node(args)


if __name__ == "__main__":
    sys.exit(main())
