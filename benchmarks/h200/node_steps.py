"""The node's single-purpose steps, each run by the pipeline as its own process
(`python3 benchmarks/h200_run.py node STEP`) on the bundle's site folder, where tasks/ and its
configuration load: the plain batched reference request, the watched training of the full draft,
the server's outputs against transformers', the replays, the scaling drafts, the verify path's
logprob probe, and a stage through
its plain entry points (the fallback when `eaglescale run` fails). Each reads NODE/params.yaml
(the profile as the pipeline wrote it for this run)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.h200 import node_env, travel
from benchmarks.h200.node_env import read_json
from benchmarks.h200.plans import RECIPE_ROOT


def _config() -> Any:
    from tasks.config import load_config

    return load_config(node_env.NODE / "params.yaml")


def node_reference(n: int = 2048) -> int:
    import httpx

    from tasks.discover.commit import read_prompts_table
    from tasks.runfolder import RunFolder
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    cfg = _config()
    tok = load_tokenizer(cfg.target.model_path, cfg.target.chat_template)
    table = read_prompts_table(RunFolder(cfg.run_root), "manifest").sort_by("prompt_id")
    prompts = [render_prompt_ids(tok, json.loads(m)) for m in table.column("messages").to_pylist()[:n]]
    body = {"input_ids": prompts, "sampling_params": {"temperature": 0.0, "max_new_tokens": cfg.sampling.max_new_tokens}}
    url = f"http://127.0.0.1:{node_env.PORT}"
    with httpx.Client(timeout=1800, trust_env=False) as client:
        began = time.perf_counter()
        r = client.post(url + "/generate", json=body)
        seconds = time.perf_counter() - began
        r.raise_for_status()
        answers = r.json()
        client.post(url + "/flush_cache", timeout=60).raise_for_status()  # the stage starts cold
    tokens = sum(a["meta_info"]["completion_tokens"] for a in answers)
    result = {"reference_prompts": len(prompts), "reference_completion_tokens": tokens,
              "reference_seconds": seconds, "reference_tok_s": tokens / seconds}  # fmt: skip
    (node_env.NODE / "reference.json").write_text(json.dumps(result))
    print(result)
    return 0


# What has to fit in the session after the watched draft's last step: the train stage's resume and
# export (Prefect's start, the index, the fp32 and vLLM exports), the bf16 export and the pack,
# and the calls that bring the draft back. Measured: 46 s (run 15) and 78 s (run 17) to the packed
# draft, ~5 s for the four `node drafts K` calls; 240 s before run 17, whose draft it stopped.
TRAIN_TAIL_S = 120.0
PACE_WARMUP_STEPS = 10  # left out of the pace: torch.compile's first batch shapes
# A checkpoint that travels (`node checkpoint K`): packed on the node (tar and parts: it writes
# its bytes twice, 1.27 GB for this draft with its optimizer's state), then brought back
# travel.PARTS_PER_CALL parts a call at travel.SECONDS_PER_CALL each. The pack measured 3-4 s on
# the node (runs 21 and 22); the rest is a margin for a slower disk.
CHECKPOINT_PACK_S = 30.0


class DoesNotFit(Exception):
    """The watched draft's remaining steps would run past the session's device time."""


def checkpoint_travel_s(nbytes: int) -> float:
    """Device seconds from a stopped draft's last checkpoint to its parts here: the pack, then
    the `node checkpoint K` calls."""
    return CHECKPOINT_PACK_S + travel.calls_for(nbytes) * travel.SECONDS_PER_CALL


def trains_on(step: int, total: int, save_every: int, pace_s: float, eval_save_s: float, left_s: float,
              travel_s: float) -> bool:  # fmt: skip
    """Whether a draft that will not end in the session trains on past the checkpoint it just
    saved at `step`: only while its next checkpoint (save_every steps on, at most the last) and
    that checkpoint's way back (`travel_s`) both end in the `left_s` seconds left. The training
    done in a session then reaches the next one, on a fresh node, as a checkpoint."""
    steps = min(save_every - step % save_every, total - step)
    return steps * pace_s + eval_save_s + travel_s <= left_s


def node_train_watched(reserve_s: float = 0.0) -> int:
    """The full draft trained as the train stage trains it (train_draft, online), watched: at its
    first checkpoint the pace so far (the median step after PACE_WARMUP_STEPS, the evaluation and
    save just made) gives what its remaining steps need; when that, TRAIN_TAIL_S and `reserve_s`
    (what the session does with the draft afterwards: its gate) would run past the session's
    device time (`node start --budget`), the draft will not end in the session, and it trains on
    only while its next checkpoint and that checkpoint's way back fit (trains_on), then stops;
    the pipeline packs that checkpoint (`node checkpoint K`) and the next session's node resumes
    it (`prepare --checkpoint-from`). train-fit.json says which, with the measured pace and the
    steps it counted, where it stopped, and how long the set-up took before the first step
    (ready_after_s) beside the first step itself (first_step_after_s)."""
    import statistics

    from tasks.draft.checkpoint import read_trainer_state
    from tasks.draft.online import OnlineTarget
    from tasks.draft.trainer import TrainCallbacks, train_draft
    from tasks.runfolder import RunFolder

    cfg = _config()
    run = RunFolder(cfg.run_root, cfg.storage_options)
    run_root = Path(cfg.run_root)  # the node's run roots are local folders
    deadline = read_json(node_env.NODE / "deadline.json")
    began = time.time()
    stamps: list[float] = []
    resumes = travel.newest_checkpoint(run_root)  # where train_draft resumes: its newest complete checkpoint
    fit: dict[str, Any] = {"budget_s": deadline and deadline["budget_s"], "decided_at_step": None, "fits": None,
                           "finished": False, "stopped_at_step": None, "tail_allowance_s": TRAIN_TAIL_S,
                           "reserve_s": reserve_s, "resumed_from": resumes and resumes.name}  # fmt: skip

    def write() -> None:
        (node_env.NODE / "train-fit.json").write_text(json.dumps(fit, indent=1))

    def on_checkpoint(key: str) -> None:
        state = read_trainer_state(run, key)
        step, total = int(state["step"]), int(state["total_steps"])
        if fit["fits"] or step >= total:
            return
        steady = stamps[min(PACE_WARMUP_STEPS, len(stamps) // 2) :]
        intervals = [b - a for a, b in zip(steady, steady[1:], strict=False)]
        pace = statistics.median(intervals) if intervals else stamps[-1] - began
        eval_save_s = time.time() - stamps[-1]
        left = deadline["ends_at"] - time.time() if deadline else None
        if fit["decided_at_step"] is None:
            remaining = (total - step) * pace + ((total - step) // cfg.train.eval_every + 1) * eval_save_s + TRAIN_TAIL_S
            fit.update(decided_at_step=step, total_steps=total, steps_per_epoch=state.get("steps_per_epoch"),
                       pace_s=pace, eval_save_s=eval_save_s, first_step_after_s=stamps[0] - began,
                       remaining_s=remaining, seconds_left=left, fits=left is None or remaining + reserve_s <= left)  # fmt: skip
            write()
            if fit["fits"]:
                return
        assert left is not None  # without a deadline it fits
        travel_s = checkpoint_travel_s(sum(map(node_env.bytes_under, travel.checkpoint_members(run_root).values())))
        if trains_on(step, total, cfg.train.save_every, pace, eval_save_s, left, travel_s):
            fit.update(trains_on_from_step=step, checkpoint_travel_s=travel_s)  # what `node wait` shows meanwhile
            write()
            return
        fit.update(stopped_at_step=step, stopped_seconds_left=left, checkpoint_travel_s=travel_s)
        write()
        raise DoesNotFit(f"{total - step} steps remain at {pace:.3f} s/step; {left:.0f} s are left, and the "
                         f"checkpoint's way back needs {travel_s:.0f} s: it travels from step {step}")  # fmt: skip

    def on_ready() -> None:  # run 15's 127 s before the first step: set-up, or the first step's own?
        fit["ready_after_s"] = time.time() - began

    waits: list[float] = []  # each step's wait for its batch (the trainer's data_wait_s)

    def on_step(record: dict[str, Any]) -> None:
        stamps.append(time.time())
        waits.append(record["data_wait_s"])

    callbacks = TrainCallbacks(on_step=on_step, on_checkpoint=on_checkpoint, on_ready=on_ready)
    try:
        train_draft(run, cfg.train, cfg.target.model_path, callbacks=callbacks, online=OnlineTarget.from_config(cfg))
        fit["finished"] = True
    except DoesNotFit as e:
        print(f"node train-watched: stopped at step {fit['stopped_at_step']}: {e}", flush=True)
    # A stopped draft writes no train/result.json: the wait for the batches is kept here too.
    fit.update(steps_trained=len(stamps), seconds=time.time() - began,
               data_wait_s_mean=sum(waits) / len(waits) if waits else None)  # fmt: skip
    write()
    print(json.dumps(fit))
    return 0


def node_agreement(n: int = 32, new_tokens: int = 64) -> int:
    """The server's greedy outputs (the committed rows) against transformers' greedy decoding
    of the same converted target, bf16 on the GPU: the target SGLang serves is the one
    extraction and training read."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.discover.commit import read_prompts_table
    from tasks.runfolder import RunFolder, ShardStore
    from tasks.target.model_dir import resolve_model_dir
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    cfg = _config()
    run = RunFolder(cfg.run_root)
    store = ShardStore(run, "generate")
    marker = sorted(store.committed().items())[0][1]
    rows = store.read_rows(marker).to_pylist()[:n]
    msgs = {r["prompt_id"]: json.loads(r["messages"]) for r in read_prompts_table(run, "manifest").to_pylist()}
    tok = load_tokenizer(cfg.target.model_path)
    device = "cpu" if node_env.REHEARSAL else "cuda"
    dtype = torch.float32 if node_env.REHEARSAL else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(cfg.target.model_path), dtype=dtype).to(device)
    eos = {int(tok.eos_token_id)}
    same, first = 0, []
    for row in rows:
        ids = render_prompt_ids(tok, msgs[row["prompt_id"]])
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens, do_sample=False)
        # Whether a reply carries its stop token differs between the two: compare without it.
        hf = [t for t in out[0, len(ids):].tolist() if t not in eos]
        sg = [t for t in list(row["output_ids"])[:new_tokens] if t not in eos]
        if row["finish_reason"] == "length":  # the server stopped at max_new_tokens: compare that far
            hf = hf[: len(sg)]
        n = min(len(hf), len(sg))
        k = next((i for i in range(n) if hf[i] != sg[i]), None)
        if k is None and len(hf) == len(sg):
            same += 1
        else:
            first.append(k if k is not None else n)
    result = {"agreement_prompts": len(rows), "agreement_tokens": new_tokens, "agreement_identical": same,
              "agreement_first_divergence": first}  # fmt: skip
    measures = read_json(node_env.NODE / "measurements.json") or {}
    (node_env.NODE / "measurements.json").write_text(json.dumps({**measures, **result}, indent=1))
    print(result)
    return 0


def node_replay() -> int:
    """The offline and the online draft over the same held-out sequences (the gate's replay:
    gate.replay_sequences, on gate.device, at gate.num_steps), into replay-compare.json."""
    from tasks.config import load_config
    from tasks.draft.target_heads import load_target_heads
    from tasks.gate.stage import materialize_draft, replay_draft
    from tasks.runfolder import RunFolder

    out: dict[str, Any] = {}
    for name, root in (("offline", node_env.NODE / "run"), ("online", node_env.NODE / "run-online")):
        cfg = load_config(node_env.NODE / "params.yaml", [f"run_root={root}", *node_env.EXTRA_SETS])
        run = RunFolder(cfg.run_root)
        embed, _ = load_target_heads(cfg.target.model_path)
        began = time.perf_counter()
        result = replay_draft(run, cfg, embed, materialize_draft(run, node_env.NODE / f"replay-{name}"), cfg.gate.num_steps)
        out[name] = {**result.to_dict(), "seconds": time.perf_counter() - began}
    (node_env.NODE / "replay-compare.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: v["overall"] for k, v in out.items()}, default=str))
    return 0


def node_recipe_replay() -> int:
    """The recipe plan's drafts that have exported (NODE/recipe-*/train/final, and SpecForge's),
    each replayed over the same held-out sequences: the default variant's run root's, its states
    captured once by the target (online, on gate.device), at gate.num_steps, with the gate's
    bootstrap settings. Into recipe-replay.json, each draft's figures with its per-sequence
    tokens and verify cycles (for a bootstrap of the difference paired by sequence), written
    after each draft; a draft already there is not replayed again."""
    import torch

    from tasks.config import load_config
    from tasks.draft.online import OnlineTarget, online_sequences
    from tasks.draft.target_heads import load_target_heads
    from tasks.gate.replay import replay_run
    from tasks.gate.stage import load_draft
    from tasks.runfolder import RunFolder

    path = node_env.NODE / "recipe-replay.json"
    out: dict[str, Any] = read_json(path) or {}
    drafts = {p.parents[1].name.removeprefix(RECIPE_ROOT): p for p in sorted(node_env.NODE.glob(f"{RECIPE_ROOT}*/train/final"))}
    drafts["specforge"] = node_env.NODE / "specforge/draft"
    todo = {n: p for n, p in drafts.items() if n not in out and (p / "config.json").is_file()}
    if not todo:
        return 0
    cfg = load_config(node_env.NODE / "params.yaml", [f"run_root={node_env.NODE / (RECIPE_ROOT + 'default')}"])
    gate, run = cfg.gate, RunFolder(cfg.run_root)
    began = time.perf_counter()
    sequences = list(online_sequences(run, OnlineTarget.of(cfg), torch.device(gate.device), "eval", gate.replay_sequences))
    capture_s = time.perf_counter() - began
    embed, _ = load_target_heads(cfg.target.model_path)
    for name, folder in todo.items():
        began = time.perf_counter()
        result = replay_run(run, load_draft(embed, folder, gate.device), gate.num_steps, limit=gate.replay_sequences,
                            sequences=sequences, n_bootstrap=gate.n_bootstrap, seed=gate.bootstrap_seed,
                            ci_level=gate.ci_level)  # fmt: skip
        per_sequence = {str(k): {"sequence_id": [r.sequence_id for r in result.sequences],
                                 "tokens": [r.tokens(k) for r in result.sequences],
                                 "cycles": [r.cycles(k) for r in result.sequences]} for k in result.num_steps}  # fmt: skip
        out[name] = {**result.to_dict(), "draft": str(folder), "seconds": time.perf_counter() - began,
                     "capture_s": capture_s, "per_sequence": per_sequence}  # fmt: skip
        path.write_text(json.dumps(out, indent=1, default=str))
        print(json.dumps({name: out[name]["overall"]}, default=str), flush=True)
    return 0


def node_scaling(fractions: str | None) -> int:
    """The scaling drafts of these fractions (comma-separated; default: all of the profile's),
    as the train stage trains them (tasks/train/stage.py). The index it writes lists only these;
    the train stage after it writes the whole one."""
    from tasks.train.stage import train_scaling

    train_scaling(_config(), [float(f) for f in fractions.split(",")] if fractions else None)
    return 0


def _summary(outcome: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: v for k, v in asdict(outcome).items() if k != "marker"}


def _shards_one_at_a_time(stage: Any) -> None:
    """A sharded stage's shards, one after another under their leases, as its flow schedules
    them (without Prefect's task runs); prints the stage's summary."""
    from tasks.runfolder.schedule import ShardScheduler, run_one_at_a_time

    try:
        pending = stage.prepare()
        run_one_at_a_time(ShardScheduler(stage, pending, 1), lambda i: _summary(stage.run_shard(i)), 5.0,
                          lambda waiting: None)  # fmt: skip
        print(stage.finish())
    finally:
        stage.close()


def node_verify_probe() -> int:
    """The "verify-probe" plan's measurement: one speculative server for the run's carried draft,
    launched as the gate launches num_steps 3 at topk 1, and benchmarks/sglang_logprob_probe.py
    against it on the gate's held-out prompts at its length (gate.num_prompts,
    gate.max_new_tokens): the verify path's logprobs of the tokens it accepted beside the same
    server's prefill re-score of them, into NODE/recorded/*-eagle3.json."""
    import httpx

    from benchmarks.sglang_logprob_probe import probe
    from tasks.gate.benchmark import launch_spec, server_launcher
    from tasks.gate.plan import plan_configs
    from tasks.sglang.server_process import PortPool, launch, wait_healthy
    from tasks.target.model_dir import resolve_model_dir

    cfg = _config()
    gate = cfg.gate
    draft = str(node_env.NODE / "run/train/final")
    config = next(c for c in plan_configs(gate, draft) if c.spec is not None and (c.spec.num_steps, c.spec.topk) == (3, 1))
    launcher = server_launcher(gate, "emulated" if node_env.REHEARSAL else "sglang")
    model_dir = str(resolve_model_dir(cfg.target.model_path, cfg.target.revision))
    server = launch(launcher, launch_spec(gate, model_dir, config, PortPool(gate.host)),
                    node_env.NODE / "logs" / "verify-probe-server.log")  # fmt: skip
    try:
        with httpx.Client(timeout=60, trust_env=False) as client:
            ready_s = wait_healthy(server, client, gate.health_timeout_s, gate.health_poll_s)
        began = time.perf_counter()
        summary = probe(server.url, str(node_env.NODE / "params.yaml"), node_env.NODE / "recorded", gate.num_prompts,
                        gate.max_new_tokens, tag="eagle3")  # fmt: skip
    finally:
        server.stop()
    print(json.dumps({"config": config.name, "ready_s": ready_s, "probe_s": time.perf_counter() - began,
                      "deltas": summary["deltas"]}))  # fmt: skip
    return 0


def node_plain(stage: str, overrides: list[str]) -> int:
    """A stage through its plain entry points (tasks/), no Prefect: the compositions the flows
    call (the stage opened, trained or gated by the same function), on the same run folder."""

    from tasks.config import load_config
    from tasks.runfolder import RunFolder
    from tasks.target.tokenizer import load_tokenizer

    cfg = load_config(node_env.NODE / "params.yaml", overrides)
    run = RunFolder(cfg.run_root, cfg.storage_options)
    tok = load_tokenizer(cfg.target.model_path, cfg.target.chat_template)
    if stage == "generate":
        from tasks.engines.factory import close_engines
        from tasks.generate.stage import open_generate_stage

        try:
            _shards_one_at_a_time(open_generate_stage(cfg, run, tok))
        finally:
            close_engines()
    elif stage == "extract":
        from tasks.extract.stage import ExtractStage

        _shards_one_at_a_time(ExtractStage(cfg, run, tok))
    elif stage == "train":
        from tasks.train.stage import run_train_stage

        print(run_train_stage(cfg).summary)
    elif stage == "gate":
        from tasks.gate.stage import GateOutcome, run_gate_once

        outcome = run_gate_once(cfg)
        print(outcome.summary if isinstance(outcome, GateOutcome) else {"skipped": "decided already", **outcome})
    else:
        raise SystemExit(f"unknown stage {stage}")
    return 0
