"""Does synthetic data transfer? (issue 50, item 3): drafts trained on prompts the target wrote
itself, on real prompts, and on a mixture, at equal sequence counts, replayed on the same real
held-out sequences with CIs paired by sequence.

    .venv/bin/python benchmarks/synthetic_transfer.py --params PARAMS [--run-root R] [--sequences N]
        [--max-steps S] [--seed 0] [--out transfer.json]

On a run root whose train stage has run. Each arm (`choose_arms`) trains with the run's recipe and
draft vocabulary in `train/transfer/<arm>-<digest of its sequences>/` (`train_arm`), then all three
are replayed in one pass over the held-out real sequences at gate.num_steps (`replay_arms`). Writes
train/transfer/transfer.json in the run root (and --out) and prints the table. docs/PIPELINE.md,
"Does synthetic data transfer?".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.config import EagleScaleConfig, load_config  # noqa: E402 - after the path set-up
from tasks.discover.commit import read_prompts_table  # noqa: E402
from tasks.draft.data import DATA_META_KEY, DataIndex, build_index, training_data_metadata  # noqa: E402
from tasks.draft.scaling_drafts import TrainElsewhere  # noqa: E402
from tasks.draft.vocab import VocabMap  # noqa: E402
from tasks.gate.replay import SequenceReplay, accept_stats, paired_bootstrap, replay_sequences  # noqa: E402
from tasks.runfolder import RunFolder, ShardStore, content_hash  # noqa: E402

ARMS = ("synthesized", "real", "mixture")
PAIRS = (("synthesized", "real"), ("mixture", "real"), ("mixture", "synthesized"))
TRANSFER_ROOT = "train/transfer"


def sequence_kinds(run: RunFolder, config: EagleScaleConfig) -> dict[str, str]:
    """Every committed generation row's request id (a training sequence's id) -> "synthesized"
    when its prompt came from a synthesized source, else "real"."""
    synthesized = {s.name for s in config.discover.synthesized()}
    manifest = read_prompts_table(run, "manifest")
    source_of = dict(zip(manifest.column("prompt_id").to_pylist(), manifest.column("source").to_pylist(), strict=True))
    store = ShardStore(run, "generate")
    kinds: dict[str, str] = {}
    for marker in store.committed().values():
        rows = store.read_rows(marker)
        for rid, pid in zip(rows.column("request_id").to_pylist(), rows.column("prompt_id").to_pylist(), strict=True):
            kinds[rid] = "synthesized" if source_of.get(pid) in synthesized else "real"
    return kinds


def data_index(run: RunFolder, config: EagleScaleConfig, device: torch.device) -> DataIndex:
    """The training data's index with sequence ids, as the trainer indexes it."""
    if config.train.hidden_states != "online":
        return build_index(run, use_cache=False)
    from tasks.draft.online import OnlineData, OnlineTarget

    data = OnlineData(run, OnlineTarget.of(config), device)
    try:
        return data.index()
    finally:
        data.close()


def choose_arms(index: DataIndex, kinds: dict[str, str], sequences: int | None, seed: int) -> dict[str, frozenset[str]]:
    """Each arm's training sequences: N synthesized, N real, and half of each of those."""
    train = sorted(r.sequence_id for r in index.refs if r.split == "train")
    pools = {k: [i for i in train if kinds.get(i) == k] for k in ("synthesized", "real")}
    n = sequences or min(len(p) for p in pools.values())
    short = {k: len(p) for k, p in pools.items() if len(p) < n}
    if n < 2 or short:
        raise ValueError(f"{n} training sequences per arm asked, {({k: len(p) for k, p in pools.items()})} "
                         "available: each arm needs at least 2, and as many of each kind")  # fmt: skip
    rng = random.Random(seed)
    synthesized, real = (sorted(rng.sample(pools[k], n)) for k in ("synthesized", "real"))
    mixture = rng.sample(synthesized, n // 2) + rng.sample(real, n - n // 2)
    return {"synthesized": frozenset(synthesized), "real": frozenset(real), "mixture": frozenset(mixture)}


def train_arm(run: RunFolder, config: EagleScaleConfig, arm: str, ids: frozenset[str], max_steps: int | None) -> dict[str, Any]:
    """One arm's draft, trained (or resumed, or found finished) and exported to its final/."""
    from tasks.draft import checkpoint as ckpt
    from tasks.draft.export import export_to_run
    from tasks.draft.online import OnlineTarget
    from tasks.draft.trainer import TrainResult, train_draft

    prefix = f"{TRANSFER_ROOT}/{arm}-{content_hash(sorted(ids), 8)}"
    view = TrainElsewhere(run, prefix)
    final = f"{prefix}/final"
    recipe = config.train if max_steps is None else config.train.model_copy(update={"max_steps": max_steps})
    full = training_data_metadata(run)

    def ship(result: TrainResult) -> None:
        best = result.best or {}
        chosen = ckpt.checkpoint_key(best["step"]) if best.get("step") is not None else result.last_checkpoint
        export_to_run(ckpt.load_run_checkpoint_model(view, chosen), run, final)

    result = train_draft(view, recipe, config.target.model_path, vocab_map=VocabMap.load(run), train_subset=ids,
                         split_of=(full.get("holdout"), f"{run.url}/{DATA_META_KEY}: the run's draft"),
                         export=ship, online=OnlineTarget.from_config(config))  # fmt: skip
    return {"arm": arm, "prefix": prefix, "final": final, "train_sequences": len(ids), "steps": result.steps}


def held_out_real(run: RunFolder, config: EagleScaleConfig, kinds: dict[str, str], device: torch.device) -> Iterator[Any]:
    """The held-out split's sequences of real prompts, with their states (one at a time)."""
    if training_data_metadata(run).get("hidden_states") == "online":
        from tasks.draft.online import OnlineTarget, online_sequences

        sequences: Iterable[Any] = online_sequences(run, OnlineTarget.of(config), device, "eval")
    else:
        from tasks.extract.storage import iter_extracted

        sequences = iter_extracted(run, "eval")
    return (s for s in sequences if kinds.get(s.sequence_id) == "real")


def replay_arms(run: RunFolder, config: EagleScaleConfig, arms: dict[str, dict[str, Any]], kinds: dict[str, str]) -> dict[str, Any]:
    """Every arm's draft replayed in one pass over the same real held-out sequences; each arm's
    accept length and each pair's ratio and difference, CIs paired by sequence."""
    from tasks.draft.target_heads import load_target_heads
    from tasks.gate.stage import load_draft, materialize_draft

    gate = config.gate
    embed, _ = load_target_heads(config.target.model_path)
    with tempfile.TemporaryDirectory(prefix="eaglescale-transfer-") as work:
        drafts = {a: load_draft(embed, materialize_draft(run, Path(work) / a, info["final"]), gate.device)
                  for a, info in arms.items()}  # fmt: skip
    records: dict[str, list[SequenceReplay]] = {a: [] for a in drafts}
    for seq in held_out_real(run, config, kinds, torch.device(gate.device)):
        for arm, draft in drafts.items():
            records[arm] += replay_sequences(draft, [seq], gate.num_steps)
    if not records[ARMS[0]]:
        raise ValueError(f"{run.url}: the held-out split has no sequence of a real prompt to replay")
    boot = (gate.n_bootstrap, gate.bootstrap_seed, gate.ci_level)
    out: dict[str, Any] = {"sequences": len(records[ARMS[0]]), "per_arm": {}, "pairs": {}}
    for k in sorted(set(gate.num_steps)):
        units = {a: (np.array([r.tokens(k) for r in rs], float), np.array([r.cycles(k) for r in rs], float))
                 for a, rs in records.items()}  # fmt: skip
        out["per_arm"][str(k)] = {a: accept_stats(rs, k, *boot) for a, rs in records.items()}
        out["pairs"][str(k)] = {f"{a}/{b}": paired_bootstrap(units[a], units[b], *boot) for a, b in PAIRS}
    return out


def compare(config: EagleScaleConfig, sequences: int | None = None, max_steps: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The whole comparison on `config`'s run root; returns (and writes) its result."""
    run = RunFolder(config.run_root, config.storage_options)
    kinds = sequence_kinds(run, config)
    index = data_index(run, config, torch.device(config.train.device))
    chosen = choose_arms(index, kinds, sequences, seed)
    arms = {arm: train_arm(run, config, arm, chosen[arm], max_steps) for arm in ARMS}
    for arm, ids in chosen.items():
        arms[arm]["kinds"] = {k: sum(kinds[i] == k for i in ids) for k in ("synthesized", "real")}
    result = {"arms": arms, "seed": seed, "replay": replay_arms(run, config, arms, kinds)}
    run.write_json_atomic(f"{TRANSFER_ROOT}/transfer.json", result)
    return result


def table(result: dict[str, Any]) -> str:
    lines = ["| num_steps | arm / pair | accept length | CI | ratio | ratio CI |", "|---|---|---|---|---|---|"]
    for k, per_arm in result["replay"]["per_arm"].items():
        for arm, s in per_arm.items():
            lines.append(f"| {k} | {arm} | {s['accept_length']:.3f} | {s['ci_low']:.3f}..{s['ci_high']:.3f} | | |")
        for pair, p in result["replay"]["pairs"][k].items():
            lines.append(f"| {k} | {pair} | {p['difference']:+.3f} | {p['difference_ci'][0]:+.3f}..{p['difference_ci'][1]:+.3f} "
                         f"| {p['ratio']:.3f} | {p['ratio_ci'][0]:.3f}..{p['ratio_ci'][1]:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", required=True)
    parser.add_argument("--run-root")
    parser.add_argument("--sequences", type=int, help="training sequences per arm (default: the smaller kind's)")
    parser.add_argument("--max-steps", type=int, help="steps of every arm (default: train.max_steps or epochs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the result here")
    args = parser.parse_args(argv)
    config = load_config(args.params, run_root=args.run_root)
    result = compare(config, args.sequences, args.max_steps, args.seed)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
