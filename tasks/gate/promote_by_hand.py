"""`eaglescale promote`: an operator's promotion of a run's exported draft, without a winning gate.

For the cases the gate's rule cannot serve: a first draft for a target that no draft speeds up
yet (later gates need an incumbent to beat), or a rollback to an earlier run's draft. The draft
is checked as the gate checks its own (preflight at every config of the gate's sweep, topk
points included, since a later gate measures an incumbent without a best config at each; against
the target's shapes and the run's aux layers) and published like a gated one
(tasks/gate/promote.py: copied, sha256-verified, pointer last). The record says it was promoted
by hand and why, and carries what the run's own gate decided about this draft when it ran with
these settings; a later gate benchmarks it as the incumbent like any other (at the best config
that decision named, else over the sweep).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from tasks.gate.contenders import run_target
from tasks.gate.plan import sweep_points
from tasks.gate.promote import POINTER, PromotionError, publish_record
from tasks.gate.stage import completed_gate
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_FINAL
from tasks.sglang.command import LaunchError, resolve_spec

if TYPE_CHECKING:
    from tasks.config import EagleScaleConfig


def promote_by_hand(config: EagleScaleConfig, reason: str) -> dict[str, Any]:
    """Publish the run's exported draft to gate.registry_url; returns the registry record.
    PromotionError (before anything is copied) names what is missing or wrong."""
    from tasks.draft.data import training_data_metadata
    from tasks.gate.preflight import PreflightError, preflight_sweep
    from tasks.target.model_dir import read_model_config, resolve_model_dir, text_config

    gate = config.gate
    if not reason.strip():
        raise PromotionError("a promotion by hand needs a reason (--reason): it is what the registry's record says")
    if not gate.registry_url:
        raise PromotionError("gate.registry_url is not set: there is no registry to promote to")
    run = RunFolder(config.run_root, config.storage_options)
    if not run.exists(f"{TRAIN_FINAL}/config.json"):
        raise PromotionError(f"{run.url}/{TRAIN_FINAL}: no exported draft (run the train stage first)")
    target = run_target(run)
    if target is None:
        raise PromotionError(f"{run.url}: records no target identity (run.json): no later gate could match the draft to its target")
    target_config = text_config(read_model_config(resolve_model_dir(config.target.model_path)))
    try:
        specs = [resolve_spec(run.path(TRAIN_FINAL), s, k, n)[0] for s, k, n in sweep_points(gate)]
        preflight_sweep(run.path(TRAIN_FINAL), specs, target_config, training_data_metadata(run)["aux_layer_ids"],
                        storage_options=config.storage_options)  # fmt: skip
    except (PreflightError, LaunchError) as e:
        raise PromotionError(f"{run.url}/{TRAIN_FINAL} does not pass the gate's preflight: {e}") from e
    registry = RunFolder(gate.registry_url, gate.registry_storage_options)
    decided = completed_gate(config)  # this draft's gate decision with these settings, if it ran
    evidence = {
        "by_hand": True,
        "reason": reason,
        "gate": decided,
        "best_spec": (decided or {}).get("best_spec"),  # what a later gate benchmarks it at (else the sweep)
    }
    return publish_record(run, run.path(TRAIN_FINAL), registry, registry.read_json(POINTER), config.storage_options,
                    evidence=evidence, target=target, replaced=None)  # fmt: skip


def promote_main(argv: list[str] | None = None) -> int:
    from tasks.config import ConfigError, load_config

    parser = argparse.ArgumentParser(
        prog="eaglescale promote",
        description="Promote a run's exported draft to the registry by hand (a first draft, a rollback), "
        "without a winning gate; the record says so and why.",
    )
    parser.add_argument("--params", required=True, help="the run's params YAML (its gate.registry_url is the registry)")
    parser.add_argument("--run-root", help="override run_root")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--reason", required=True, help="why, in a sentence: recorded in the registry")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.params, args.overrides, run_root=args.run_root)
        record = promote_by_hand(config, args.reason)
    except (ConfigError, PromotionError) as e:
        print(f"eaglescale promote: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    prev = (record.get("previous") or {}).get("draft_id") or "none"
    print(f"promoted {record['draft_id']} by hand to {record['uri']} (previous: {prev}): {args.reason}")
    return 0
