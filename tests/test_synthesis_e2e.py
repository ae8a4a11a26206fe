"""A synthesized source through the whole DAG on the tiny target, with the real CLI and a real
Prefect server: discovery (its synthesis kill -9'd at a commit and at random moments, then
resumed) -> generate (code replies to a longer cap of their own) -> extract -> train -> gate; then
issue 50's transfer comparison on the same run.

Before the run, one synthesis shard is committed by hand as the filter step's fixture: a near-copy
of a held-out prompt (the held-out set pinned with discover.holdout_from) and a few requests that
pass every filter. The synthesis finds it committed and writes the others; discovery must refuse
the near-copy, report it, and keep it out of everything that trains.
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tasks.config import EagleScaleConfig, load_config
from tasks.discover.commit import read_prompts_table
from tasks.discover.stage import run_discover_stage
from tasks.extract.storage import iter_extracted
from tasks.generate.rows import DEAD_SCHEMA, ROW_SCHEMA, to_table
from tasks.runfolder import RunFolder, ShardCommit, ShardStore, new_attempt_id
from tasks.synthesize.plan import slot_index
from tasks.synthesize.stage import SynthesisStage, run_synthesis
from tasks.target.tokenizer import load_tokenizer
from tests.prefect_support import prefect_server
from tests.run_support import (
    cli_env,
    kill_at_progress,
    kill_group,
    rows_by_request,
    start_cli,
    unmarked_objects,
    write_params,
)

SLOTS, SHARD = 60, 6
SYNTH = "synth-code"
CODE = "agentic_coding"
REPLY, CODE_REPLY = 12, 40  # the default reply cap, and code's own (sampling.max_new_tokens_by_domain)
PASSING = [  # planted beside the near-copy: each passes every filter and trains
    "Explain how a Python decorator with arguments wraps the function it decorates",
    "Show me a Rust program that reads a CSV file and prints the sum of one column",
    "Why does my JavaScript fetch call return a pending promise instead of JSON data",
    "Write a bash one-liner that finds the ten largest files under my home folder",
    "What is the difference between a mutex and a semaphore when threads share a queue",
]
RANDOM_KILLS = 2


def _journal_lines(run_dir: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (run_dir / "synthesize" / "journal").rglob("*.jsonl"))


def _params(base: Path, model_dir: Path, run_root: Path, pin: Path) -> Path:
    params = write_params(
        base, model_dir, str(run_root),
        sampling={"max_new_tokens": REPLY, "max_new_tokens_by_domain": {CODE: CODE_REPLY}},
        # Small batches: the synthesis takes seconds, so that a kill lands inside it.
        engine={"kind": "local", "batch_size": 2},
        generate={"shard_size": SHARD, "max_parallel_shards": 2, "journal_flush_s": 0.2, "lease_ttl_s": 2.0,
                  "lease_heartbeat_s": 0.5},
        extract={"max_length": 320, "batch_size": 8},
        train={"max_steps": 24, "eval_every": 12, "save_every": 12, "warmup_steps": 3, "batch_tokens": 768},
        gate={"num_steps": [1, 2], "repetitions": 2, "num_prompts": 4, "max_new_tokens": 8, "warmup_requests": 1,
              "cost_iters": 3, "replay_sequences": 16, "n_bootstrap": 200},
    )  # fmt: skip
    p = yaml.safe_load(params.read_text())
    for src in p["discover"]["sources"]:
        src["max_rows"] = 30  # a few of each file source: the run is about the synthesized one
    p["discover"].update(max_prompt_tokens=256, holdout_from=str(pin), holdout_per_domain=4)
    p["discover"]["sources"].append({"name": SYNTH, "kind": "synthesized", "domain": CODE, "count": SLOTS,
                                     "system_prompt": "You help people with their code.", "max_request_tokens": 64,
                                     "temperature": 0.7, "top_k": 20})  # fmt: skip
    params.write_text(yaml.safe_dump(p))
    return params


def _pin_holdout(base: Path, model_dir: Path) -> tuple[Path, dict[str, Any]]:
    """An earlier run's held-out set (the file sources alone, discovered in plain code), and one of
    its code prompts to plant a near-copy of."""
    (base / "pin-params").mkdir()
    params = write_params(base / "pin-params", model_dir, str(base / "pin"))
    p = yaml.safe_load(params.read_text())
    for src in p["discover"]["sources"]:
        src["max_rows"] = 30
    p["discover"].update(max_prompt_tokens=256, holdout_per_domain=4)
    params.write_text(yaml.safe_dump(p))
    cfg = load_config(params)
    run = RunFolder(cfg.run_root)
    run_discover_stage(cfg, run, load_tokenizer(str(model_dir)))
    held = [r for r in read_prompts_table(run, "holdout").to_pylist() if r["domain"] == CODE]
    target = max(held, key=lambda r: len(json.loads(r["messages"])[-1]["content"].split()))
    return base / "pin", target


def _plant(cfg: EagleScaleConfig, model_dir: Path, near_copy: str) -> tuple[str, int]:
    """Commit the synthesis' last shard by hand: the near-copy in its first slot, PASSING after it
    (the filter step's fixture). Returns (shard id, the near-copy's slot)."""
    tok = load_tokenizer(str(model_dir))

    def no_engine() -> Any:
        raise AssertionError("planting sends nothing")

    stage = SynthesisStage(cfg, RunFolder(cfg.run_root), tok, engine=no_engine)
    shard = stage.shards[-1]
    plan = stage.sources[SYNTH]
    planned = shard.planned(plan.hash)
    texts = [near_copy, *PASSING][: len(planned)]
    attempt = new_attempt_id()
    records = []
    for p, text in zip(planned, texts, strict=True):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        records.append({"request_id": p.request_id, "prompt_id": p.prompt_id, "sample_index": 0, "output_ids": ids,
                        "text": text, "finish_reason": "stop", "prompt_tokens": len(plan.prompt_ids),
                        "completion_tokens": len(ids), "cached_tokens": 0, "latency_s": 0.0, "engine": "planted",
                        "server": "test", "attempt": attempt})  # fmt: skip
    commit = ShardCommit(shard.shard_id, attempt, plan.hash, [p.request_id for p in planned], to_table([], DEAD_SCHEMA),
                         extra={"quality": {"finish_length": 0}})  # fmt: skip
    assert stage.store.commit(to_table(records, ROW_SCHEMA), commit).won
    return shard.shard_id, slot_index(planned[0].prompt_id)


@pytest.fixture(scope="module")
def synth_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("synth-e2e")
    run_dir = base / "run"
    pin, held = _pin_holdout(base, tiny_target_dir)
    held_text = json.loads(held["messages"])[-1]["content"]
    near_copy = "Quick question: " + held_text.rstrip("?.! ") + ", thanks"
    params = _params(base, tiny_target_dir, run_dir, pin)
    cfg = load_config(params)
    planted, planted_slot = _plant(cfg, tiny_target_dir, near_copy)
    log = base / "cli.log"
    args = ["run", "--params", str(params)]
    rng = random.Random(50)
    kills: list[str] = []
    with prefect_server(base / "prefect-home") as url:
        env = cli_env(base, PREFECT_API_URL=url, OMP_NUM_THREADS="1")
        # kill -9 inside the synthesis' first commit, then at random moments of its journaling.
        proc = start_cli([*args, "--stages", "discover"], {**env, "EAGLESCALE_FAILPOINT": "commit.before_marker"}, log)
        assert proc.wait(timeout=300) == -signal.SIGKILL, log.read_text()[-3000:]
        kill_group(proc)
        kills.append("commit.before_marker")
        for _ in range(RANDOM_KILLS):
            done = _journal_lines(run_dir)
            proc = start_cli([*args, "--stages", "discover"], env, log)
            first_at = done + rng.randint(1, 4)
            if kill_at_progress(proc, lambda: _journal_lines(run_dir), first_at, rng.uniform(0, 0.3), first_at + 4):
                kills.append("random")
        assert not (run_dir / "prompts/_SUCCESS.json").exists(), (kills, _journal_lines(run_dir))
        final = start_cli(args, env, log)
        assert final.wait(timeout=600) == 0, log.read_text()[-4000:]
    return {"run": RunFolder(str(run_dir)), "cfg": cfg, "kills": kills, "planted": planted,
            "planted_slot": planted_slot, "near_copy": near_copy, "held": held, "base": base, "params": params}  # fmt: skip


def test_the_synthesis_resumed_after_kill9_wrote_every_slot_once_and_the_same_prompts(synth_run: dict[str, Any],
                                                                                      tiny_target_dir: Path) -> None:  # fmt: skip
    run, cfg = synth_run["run"], synth_run["cfg"]
    assert synth_run["kills"][0] == "commit.before_marker" and len(synth_run["kills"]) >= 2, synth_run["kills"]
    store = ShardStore(run, "synthesize")
    markers = store.committed()
    assert len(markers) == SLOTS // SHARD and store.is_complete()
    ids = [i for m in markers.values() for i in store.read_rows(m).column("request_id").to_pylist()]
    dead = [i for m in markers.values() for i in store.read_dead(m).column("request_id").to_pylist()]
    assert len(ids) + len(dead) == SLOTS and len(set(ids) | set(dead)) == SLOTS  # every slot once
    # The resumes were real: a shard's journal holds attempts of more than one process.
    attempts = [len(list(p.iterdir())) for p in (Path(run.url) / "synthesize/journal").iterdir()]
    assert max(attempts) >= 2, attempts
    assert unmarked_objects(run, "synthesize") == set()
    # The same prompts an uninterrupted synthesis writes (same request ids: per-slot seeds), in
    # other batches (12 a batch, not 2): a slot's prompt depends on its seed alone.
    ref_cfg = cfg.model_copy(update={"run_root": str(synth_run["base"] / "reference"),
                                     "engine": cfg.engine.model_copy(update={"batch_size": 12})})  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI runs (OMP_NUM_THREADS=1)
    try:
        run_synthesis(ref_cfg, RunFolder(ref_cfg.run_root), load_tokenizer(str(tiny_target_dir)))
    finally:
        torch.set_num_threads(threads)
    ours, reference = rows_by_request(run, "synthesize"), rows_by_request(RunFolder(ref_cfg.run_root), "synthesize")
    compared = [rid for rid, row in ours.items() if row["engine"] != "planted"]
    assert len(compared) == SLOTS - SHARD
    differ = [rid for rid in compared if (ours[rid]["output_ids"], ours[rid]["text"]) != (reference[rid]["output_ids"],
                                                                                          reference[rid]["text"])]  # fmt: skip
    assert not differ, differ


def test_a_planted_held_out_near_copy_is_refused_reported_and_never_trains(synth_run: dict[str, Any]) -> None:
    run, held = synth_run["run"], synth_run["held"]
    filtered = [f for f in read_prompts_table(run, "filtered").to_pylist() if f["source"] == SYNTH]
    refused = [f for f in filtered if f["row_index"] == synth_run["planted_slot"]]
    assert [(f["reason"], f["duplicate_of"]) for f in refused] == [("near_holdout", held["prompt_id"])]
    assert held["prompt_id"] in read_prompts_table(run, "holdout").column("prompt_id").to_pylist()
    manifest = read_prompts_table(run, "manifest")
    planted_id = refused[0]["prompt_id"]
    assert planted_id not in manifest.column("prompt_id").to_pylist()
    assert not any(synth_run["near_copy"] in m for m in manifest.column("messages").to_pylist())
    generated = rows_by_request(run, "generate")
    assert planted_id not in {r["prompt_id"] for r in generated.values()}
    trained = {s.sequence_id for s in iter_extracted(run)}  # every extracted sequence, train and eval
    assert trained and not trained & {rid for rid, r in generated.items() if r["prompt_id"] == planted_id}
    assert "near_holdout" in (Path(run.url) / "prompts/discovery_report.md").read_text()


def test_every_slot_is_one_outcome_and_the_report_shows_synthesized_beside_real(synth_run: dict[str, Any]) -> None:
    run = synth_run["run"]
    report = json.loads((Path(run.url) / "prompts/discovery_report.json").read_text())
    counts = report["sources"][SYNTH]
    outcomes = {k: v for k, v in counts.items() if isinstance(v, int) and k not in ("rows_read", "source_rows")}
    assert counts["synthesis"]["count"] == SLOTS and counts["kind"] == "synthesized"
    assert counts["rows_read"] == SLOTS == sum(outcomes.values())
    filtered = [f for f in read_prompts_table(run, "filtered").to_pylist() if f["source"] == SYNTH]
    for reason in {f["reason"] for f in filtered}:
        assert counts[reason] == sum(f["reason"] == reason for f in filtered), reason
    assert counts["near_holdout"] >= 1 and counts["kept"] >= len(PASSING)
    manifest = read_prompts_table(run, "manifest").to_pylist()
    kept_synth = sum(r["source"] == SYNTH for r in manifest)
    assert report["synthesis"]["kept_by_domain"][CODE]["synthesized"] == kept_synth == counts["kept"]
    md = (Path(run.url) / "prompts/discovery_report.md").read_text()
    assert "## Real and synthesized prompts kept, per domain" in md and f"Synthesis: {SLOTS} requests over {SLOTS // SHARD} shard(s)" in md
    assert not any(r["source"] == SYNTH for r in read_prompts_table(run, "holdout").to_pylist())


def test_longer_code_replies_ran_through_generate_extract_train_and_the_gate(synth_run: dict[str, Any]) -> None:
    run = synth_run["run"]
    summary = json.loads((Path(run.url) / "generate/_COMPLETE").read_text())
    by_domain = summary["finish_length_by_domain"]
    assert by_domain[CODE]["max_new_tokens"] == CODE_REPLY and by_domain["general_chat"]["max_new_tokens"] == REPLY
    assert sum(d["rows"] for d in by_domain.values()) == summary["rows"]
    rows = rows_by_request(run, "generate").values()
    domain_of = {r["prompt_id"]: r["domain"] for r in read_prompts_table(run, "manifest").to_pylist()}
    longest = {d: max(r["completion_tokens"] for r in rows if domain_of[r["prompt_id"]] == d) for d in by_domain}
    assert REPLY < longest[CODE] <= CODE_REPLY and longest["general_chat"] <= REPLY
    assert by_domain[CODE]["finish_length"] == sum(
        r["finish_reason"] == "length" for r in rows if domain_of[r["prompt_id"]] == CODE)  # fmt: skip
    # Extraction kept every reply whole (extract.max_length was checked to hold them).
    extract = json.loads((Path(run.url) / "extract/_COMPLETE").read_text())
    assert extract.get("truncated", 0) == 0
    longest_code = max(int(s.loss_mask.sum()) for s in iter_extracted(run) if s.domain == CODE)
    assert longest_code > REPLY
    result = json.loads((Path(run.url) / "train/result.json").read_text())
    assert result["steps"] == 24 and (Path(run.url) / "train/final/config.json").is_file()
    assert (Path(run.url) / "gate/_SUCCESS.json").is_file()


def test_drafts_on_synthesized_real_and_mixed_prompts_replay_on_the_same_real_held_out_set(synth_run: dict[str, Any]) -> None:
    import benchmarks.synthetic_transfer as transfer

    result = transfer.compare(synth_run["cfg"], max_steps=3)
    arms = result["arms"]
    n = arms["synthesized"]["train_sequences"]
    assert n >= 2 and {a["train_sequences"] for a in arms.values()} == {n}  # equal sequence counts
    assert arms["synthesized"]["kinds"] == {"synthesized": n, "real": 0}
    assert arms["real"]["kinds"] == {"synthesized": 0, "real": n}
    assert arms["mixture"]["kinds"] == {"synthesized": n // 2, "real": n - n // 2}
    assert all(a["steps"] == 3 for a in arms.values())
    replay = result["replay"]
    assert replay["sequences"] >= 1
    for k in ("1", "2"):
        assert {s["sequences"] for s in replay["per_arm"][k].values()} == {replay["sequences"]}  # the same held-out set
        for pair in ("synthesized/real", "mixture/real", "mixture/synthesized"):
            p = replay["pairs"][k][pair]
            assert p["ratio_ci"][0] <= p["ratio"] <= p["ratio_ci"][1]
    assert (Path(synth_run["run"].url) / "train/transfer/transfer.json").is_file()
    table = transfer.table(result)
    assert all(pair in table for pair in ("synthesized/real", "mixture/real", "mixture/synthesized"))
