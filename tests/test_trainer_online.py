"""Online hidden states (train.hidden_states: online) on the tiny target on CPU: the same loss
curve and exported draft as training on the extracted shards, with no extract data at all;
exact resume after kill -9; a checkpoint of one mode is not resumed in the other."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from tasks.draft import checkpoint as ckpt
from tasks.draft.data import DATA_META_KEY, build_index, collate, plan_epoch
from tasks.draft.export import export_run_draft
from tasks.draft.online import OnlineData, OnlineTarget
from tasks.draft.target_heads import load_target_heads
from tasks.draft.trainer import TrainError, train_draft
from tasks.extract.forecast import online_forecast
from tasks.extract.local_capture import CapturedStates
from tasks.extract.sequences import TrainingSequence
from tasks.extract.storage import ShardWriter, iter_shard
from tasks.extract.writer import storage_round_trip
from tasks.gate.stage import replay_draft
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_FINAL, TRAIN_RESULT
from tasks.status.read import read_status
from tasks.status.render import stage_rows
from tests.draft_support import extracted_run
from tests.run_support import cli_env, start_cli

STEPS = 12
SHORT = {"max_steps": STEPS, "eval_every": 6, "save_every": 4}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, dest: Path, online: bool):
    cfg, params = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, dest,
                                hidden_states="online" if online else "offline", **SHORT)  # fmt: skip
    run = RunFolder(cfg.run_root)
    if online:  # the copied template holds extract shards: online must not need them
        run.remove("extract", recursive=True)
    return cfg, params, run


def test_online_training_matches_offline_with_nothing_extracted(tmp_path_factory, tiny_target_dir, tmp_path):
    cfg_off, _, run_off = _run(tmp_path_factory, tiny_target_dir, tmp_path / "offline", online=False)
    cfg_on, _, run_on = _run(tmp_path_factory, tiny_target_dir, tmp_path / "online", online=True)
    offline = train_draft(run_off, cfg_off.train, cfg_off.target.model_path)
    online = train_draft(run_on, cfg_on.train, cfg_on.target.model_path,
                         online=OnlineTarget.from_config(cfg_on))  # fmt: skip

    assert not run_on.exists("extract")
    assert run_on.read_json(DATA_META_KEY)["hidden_states"] == "online"
    assert {k: v for k, v in run_on.read_json(DATA_META_KEY).items() if k != "hidden_states"} == {
        k: v for k, v in run_off.read_json(DATA_META_KEY).items() if k != "hidden_states"}
    assert len(online.history) == len(offline.history) == STEPS
    # Same batches, same step by step: the token counts are exact; the states differ only by
    # how the capture batched them (float rounding, mostly absorbed by the bf16 storage
    # rounding both modes apply; without it, online drifts by ~4e-6 and this fails).
    assert [h["batch_tokens"] for h in online.history] == [h["batch_tokens"] for h in offline.history]
    assert [h["loss"] for h in online.history] == pytest.approx([h["loss"] for h in offline.history], rel=1e-6)
    assert [e["loss"] for e in online.evals] == pytest.approx([e["loss"] for e in offline.evals], rel=1e-6)
    assert offline.history[-1]["loss"] < offline.history[0]["loss"]  # it learned: a curve, not a line

    for run in (run_off, run_on):
        export_run_draft(run, cfg_on.target.model_path)
    exported_off = st_load(run_off.read_bytes(f"{TRAIN_FINAL}/model.safetensors"))
    exported_on = st_load(run_on.read_bytes(f"{TRAIN_FINAL}/model.safetensors"))
    assert exported_on.keys() == exported_off.keys()
    for name, value in exported_off.items():
        torch.testing.assert_close(exported_on[name], value, rtol=1e-3, atol=1e-5, msg=name)

    # The gate's replay of the online run captures the same held-out sequences' states again.
    embed, _ = load_target_heads(cfg_on.target.model_path)
    gate = cfg_on.gate.model_copy(update={"replay_sequences": 6, "n_bootstrap": 100})
    replays = [replay_draft(run, cfg.model_copy(update={"gate": gate}), embed, Path(run_on.path(TRAIN_FINAL)), [1, 2])
               for run, cfg in ((run_off, cfg_off), (run_on, cfg_on))]  # fmt: skip
    assert not run_on.exists("extract")
    ids = [[r.sequence_id for r in result.sequences] for result in replays]
    assert len(ids[0]) == 6 and ids[0] == ids[1]
    assert [r.accepted for r in replays[0].sequences] == [r.accepted for r in replays[1].sequences]


def test_the_online_reader_hands_the_trainer_its_states_in_the_compute_dtype_unchanged(
    tmp_path_factory, tiny_target_dir, tmp_path
):
    """What a GPU trainer gets (states where the capture ran, in compute_dtype, padded there)
    holds the values of the host float32 path exactly: bf16 storage makes them representable."""
    cfg, _, run = _run(tmp_path_factory, tiny_target_dir, tmp_path / "online", online=True)
    assert cfg.extract.storage_dtype == "bf16"
    data = OnlineData(run, OnlineTarget.of(cfg), torch.device("cpu"))
    try:
        index = data.index()
        refs = index.split("train")[:5]
        host = collate(data.reader(index).batch(refs))
        kept = collate(data.reader(index, torch.bfloat16).batch(refs))
    finally:
        data.close()
    assert len(set(host.lengths.tolist())) > 1  # padding is exercised
    assert (host.aux_hidden.dtype, kept.aux_hidden.dtype, kept.last_hidden.dtype) == (
        torch.float32, torch.bfloat16, torch.bfloat16)
    for name in ("aux_hidden", "last_hidden"):
        assert torch.equal(getattr(kept, name).float(), getattr(host, name)), name
    for name in ("input_ids", "loss_mask", "lengths"):
        assert torch.equal(getattr(kept, name), getattr(host, name)), name
    on_host = kept.on_host(pin=False)
    assert torch.equal(on_host.aux_hidden, kept.aux_hidden) and on_host.aux_hidden.device.type == "cpu"


def test_kill_9_during_online_training_resumes_to_the_uninterrupted_curve(tmp_path_factory, tiny_target_dir, tmp_path):
    cfg, _, run = _run(tmp_path_factory, tiny_target_dir, tmp_path / "straight", online=True)
    straight = train_draft(run, cfg.train, cfg.target.model_path, online=OnlineTarget.from_config(cfg))

    cfg2, params2, run2 = _run(tmp_path_factory, tiny_target_dir, tmp_path / "killed", online=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "tasks.train.main", "--params", str(params2)]
    first_save = run2.path(f"{ckpt.checkpoint_key(4)}/meta.json")
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not os.path.exists(first_save) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert child.poll() is None, f"trainer exited before its first checkpoint: {child.stderr.read()[-2000:]}"
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stderr.close()
    assert not ckpt.is_complete(run2.path(ckpt.checkpoint_key(STEPS)))  # killed mid-way

    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed_state = run2.read_json(f"{ckpt.checkpoint_key(STEPS)}/trainer_state.json")
    assert resumed_state["hidden_states"] == "online"
    assert [h["loss"] for h in resumed_state["history"]] == [h["loss"] for h in straight.history]
    final = ckpt.load_checkpoint_model(run.path(straight.last_checkpoint))
    final2 = ckpt.load_checkpoint_model(run2.path(ckpt.checkpoint_key(STEPS)))
    for name, value in final.exportable_state_dict().items():
        assert torch.equal(final2.exportable_state_dict()[name], value), name


def test_a_checkpoint_is_resumed_in_its_own_mode_only(tmp_path_factory, tiny_target_dir, tmp_path):
    cfg, _, run = _run(tmp_path_factory, tiny_target_dir, tmp_path / "mixed", online=False)
    offline_cfg = cfg.train.model_copy(update={"max_steps": 2, "save_every": 2})
    train_draft(run, offline_cfg, cfg.target.model_path)
    online_cfg = offline_cfg.model_copy(update={"hidden_states": "online", "max_steps": 4})
    with pytest.raises(TrainError, match=r"no OnlineTarget was given"):
        train_draft(run, online_cfg, cfg.target.model_path)
    target = OnlineTarget.from_config(cfg.model_copy(update={"train": online_cfg}))
    with pytest.raises(TrainError, match=r"step-2: trained with train.hidden_states 'offline', this run asks for 'online'"):
        train_draft(run, online_cfg, cfg.target.model_path, online=target)
    assert run.read_json(DATA_META_KEY)["hidden_states"] == "offline"  # the refused start wrote nothing


def test_a_held_out_split_changed_since_training_is_refused_at_resume_and_at_replay(
    tmp_path_factory, tiny_target_dir, tmp_path
):
    """The checkpoint and data.json record the held-out split's digest. A resume, or the gate's
    replay of the draft, that would make another split (here eval_fraction changed; in practice
    extract.holdout_unit) is refused before any weight loads or state is captured: the draft
    would train on, or be scored on, what it held out. Records from before the key are per
    prompt, which this run's prompts (one a conversation) split the same way: they go on."""
    import hashlib
    import json

    from tasks.draft.online import OnlineDataError, online_sequences
    from tasks.draft.trainer import TrainCallbacks

    class Preempted(Exception):
        pass

    def preempted(_: str) -> None:
        raise Preempted

    cfg, _, run = _run(tmp_path_factory, tiny_target_dir, tmp_path / "split", online=True)
    four = cfg.train.model_copy(update={"max_steps": 4, "save_every": 2, "eval_every": 2})
    with pytest.raises(Preempted):  # stopped at its first checkpoint, as a preempted node
        train_draft(run, four, cfg.target.model_path, online=OnlineTarget.from_config(cfg),
                    callbacks=TrainCallbacks(on_checkpoint=preempted))  # fmt: skip
    key = ckpt.checkpoint_key(2)
    recorded = run.read_json(DATA_META_KEY)["holdout"]
    assert recorded and run.read_json(f"{key}/trainer_state.json")["holdout"] == recorded
    other = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"eval_fraction": 0.5})})
    with pytest.raises(TrainError, match=rf"{key} was made with another held-out split \({recorded}\)"):
        train_draft(run, four, cfg.target.model_path, online=OnlineTarget.from_config(other))
    with pytest.raises(OnlineDataError, match=r"data.json: the draft was made with another held-out split"):
        next(online_sequences(run, OnlineTarget.of(other), torch.device("cpu"), "eval"))

    # Before the key: neither record holds a digest (the checkpoint's meta.json re-signed).
    state = run.read_json(f"{key}/trainer_state.json")
    del state["holdout"]
    blob = json.dumps(state).encode()
    run.write_bytes_atomic(f"{key}/trainer_state.json", blob)
    meta = run.read_json(f"{key}/meta.json")
    meta["sha256"]["trainer_state.json"] = hashlib.sha256(blob).hexdigest()
    run.write_json_atomic(f"{key}/meta.json", meta)
    run.write_json_atomic(DATA_META_KEY, {k: v for k, v in run.read_json(DATA_META_KEY).items() if k != "holdout"})
    assert next(online_sequences(run, OnlineTarget.of(cfg), torch.device("cpu"), "eval")).sequence_id
    resumed = train_draft(run, four, cfg.target.model_path, online=OnlineTarget.from_config(cfg))
    assert resumed.resumed_from == key and run.read_json(DATA_META_KEY)["holdout"] == recorded


def test_the_parent_flow_skips_extract_and_the_status_says_why(tmp_path_factory, tiny_target_dir, tmp_path):
    """The real CLI (ephemeral Prefect API): extract is skipped, nothing is stored, the train
    stage trains online and exports, and `eaglescale status` names the mode."""
    cfg, params, run = _run(tmp_path_factory, tiny_target_dir, tmp_path / "flow", online=True)
    log = tmp_path / "cli.log"
    args = ["run", "--params", str(params), "--stages", "extract,train",
            "--set", "train.max_steps=4", "--set", "train.eval_every=4"]  # fmt: skip
    assert start_cli(args, cli_env(tmp_path), log).wait(timeout=300) == 0, log.read_text()[-3000:]
    assert not run.exists("extract")
    assert run.read_json(DATA_META_KEY)["hidden_states"] == "online"
    assert run.exists(f"{TRAIN_FINAL}/config.json")
    assert run.read_json(TRAIN_RESULT)["steps"] == 4
    rows = dict(stage_rows(read_status(run)))
    assert rows["extract"] == "skipped: online hidden states (the trainer runs the target; 0 B stored)"
    forecast = online_forecast(run, cfg.extract.max_length)
    assert forecast["total_bytes"] == 0 and forecast["projected_tokens"] > 0
    assert forecast["summary"].startswith("0 B: online hidden states")


def test_online_under_torchrun_two_processes(tmp_path_factory, tiny_target_dir, tmp_path):
    """DDP (gloo on CPU): each rank loads the target and captures its own batches, every
    world-th of the same plan the offline index would give."""
    cfg, params, run = _run(tmp_path_factory, tiny_target_dir, tmp_path / "ddp", online=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "tasks.train.main", "--params", str(params), "--set", "train.max_steps=4"],
        cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    for rank in (0, 1):
        assert f"train_main rank {rank}/2 done: steps 4," in output, output[-3000:]
    assert not run.exists("extract")
    state = run.read_json(f"{ckpt.checkpoint_key(4)}/trainer_state.json")
    assert state["hidden_states"] == "online"
    # The offline plan, from the extraction of an identical copy of the run: step k trained
    # on its batches 2k (rank 0) and 2k + 1 (rank 1).
    _, _, run_off = _run(tmp_path_factory, tiny_target_dir, tmp_path / "ddp-offline", online=False)
    plan = plan_epoch(build_index(run_off), "train", 0, cfg.train.seed, cfg.train.batch_tokens)
    assert [h["batch_tokens"] for h in state["history"]] == [
        sum(r.length for r in plan[2 * k] + plan[2 * k + 1]) for k in range(4)]
    assert all(math.isfinite(h["loss"]) for h in state["history"])


@pytest.mark.parametrize("storage_dtype", ["bf16", "fp8_e4m3"])
def test_online_states_are_what_a_stored_shard_reads_back(storage_dtype):
    """storage_round_trip against the real writer and reader, for both storage dtypes."""
    h, n = 8, 5
    gen = torch.Generator().manual_seed(0)
    states = CapturedStates(torch.randn(n, 3 * h, generator=gen) * 7, torch.randn(n, h, generator=gen))
    seq = TrainingSequence("r0", "p0", "chat", "train", list(range(n)), [0, 0, 1, 1, 1], False)
    writer = ShardWriter(h, [1, 3, 4], storage_dtype)
    writer.add(seq, states)
    stored = next(iter_shard(writer.to_bytes()))
    assert torch.equal(storage_round_trip(states.aux, storage_dtype, 3), stored.aux_hidden)
    assert torch.equal(storage_round_trip(states.last, storage_dtype, 1), stored.last_hidden)
    assert not torch.equal(stored.aux_hidden, states.aux)  # the rounding is real
