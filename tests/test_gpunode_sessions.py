"""A session's stages on the node, through the product's one stage runner (`eaglescale run
--stages X`, the real CLI here): the train stage on an online run with its scaling drafts; a draft
trained within its session's device time (train.time_budget_s), stopped at a checkpoint that
travels to a fresh node, resumed there to the same weights, packed as a draft and gated by the
session after; a generation stopped for the session's end, carried and resumed; a watch that
fails ends its stage."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode import generation, node_env, steps, travel
from gpunode.core import SessionEnds
from gpunode.pipeline import Pipeline
from tests.gpunode_support import SMALL_TRAIN, cli_pipeline, generation_tar, on_node


def test_the_train_stage_trains_the_scaling_drafts_online_too(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline's train stage (`eaglescale run --stages train`) on an online run (nothing
    extracted): the draft, its scaling draft and the export, every one of them on states the
    trainer makes itself (a runner of its own once dropped the online target for the scaling
    drafts)."""
    from tasks.draft.scaling_drafts import scaling_drafts
    from tasks.runfolder import RunFolder
    from tasks.runfolder.layout import TRAIN_FINAL
    from tests.draft_support import extracted_run

    _, params = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path,
                              hidden_states="online", **SMALL_TRAIN)  # fmt: skip
    run = RunFolder(str(tmp_path / "run"))
    run.remove("extract", recursive=True)  # the copied template holds extract shards: online must not need them
    monkeypatch.setenv("H200_PROFILE", str(params))
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    cli_pipeline(tmp_path, monkeypatch).stage("train")
    assert not run.exists("extract")
    (draft,) = scaling_drafts(run)
    assert run.read_json(f"train/scaling/frac-{draft['samples']}/data.json")["hidden_states"] == "online"
    assert run.exists(f"{draft['final']}/config.json") and run.exists(f"{TRAIN_FINAL}/config.json")


def test_node_scaling_trains_on_the_run_s_own_store(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node scaling` on a run root in S3 (moto): the scaling draft reaches the store through the
    run's storage_options (its endpoint), like every other stage's writes."""
    import yaml

    from tasks.draft.scaling_drafts import scaling_drafts
    from tasks.runfolder import RunFolder
    from tests.draft_support import extracted_run
    from tests.s3_support import moto_s3

    cfg, params = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path, **SMALL_TRAIN)
    with moto_s3(monkeypatch) as s3:
        url = f"s3://{s3['bucket']}/runs/scaling"
        run = RunFolder(url, s3["storage_options"])
        run.fs.put(cfg.run_root + "/", run.path(""), recursive=True)
        data = yaml.safe_load(params.read_text())
        params.write_text(yaml.safe_dump({**data, "run_root": url, "storage_options": s3["storage_options"]}))
        on_node(monkeypatch, tmp_path)
        assert steps.node_scaling("0.5") == 0
        (draft,) = scaling_drafts(run)
        assert draft["fraction"] == 0.5 and run.exists(f"{draft['final']}/config.json")
    assert not (tmp_path / "run/train/scaling").exists()  # trained in the store, not beside the params


def test_a_draft_trained_across_sessions_resumes_on_a_fresh_node_and_is_gated_in_the_next(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft that will not end in its session: the train stage, given train.time_budget_s for
    the device time left less its checkpoint's way back, stops at a checkpoint (train-fit.json
    says where), and the pipeline packs that checkpoint whole (`node checkpoint K`); it is what
    `prepare --checkpoint-from` unpacks, sha256-checked, and a fresh node given it (with the
    generation) knows it carried a checkpoint and resumes the draft at that step, to the same
    weights as a resume on the machine that stopped it. The draft it finishes, packed to travel
    (`node drafts K`), is its best checkpoint in bf16 with the files the gate and the scaling
    drafts read, what `prepare --draft-from` unpacks; the next node gates it beside a scaling
    draft, and the one after gates the scaling drafts carried to it."""

    import torch
    from safetensors.torch import load_file


    train = {"hidden_states": "online", "max_steps": 4, "eval_every": 2, "save_every": 2, "scaling_fractions": []}
    node = tmp_path / "node"
    # The stage stops at its first checkpoint, step 2 of 4.
    _trained_with_60_s_left(tmp_path_factory.getbasetemp(), tiny_target_dir, node, train, monkeypatch, reserve_s=600.0)
    fit = json.loads((node / "train-fit.json").read_text())
    assert fit["time_budget_s"] == 1 and fit["reserve_s"] == 600.0 and fit["finished"] is False
    assert fit["stopped_at_step"] == 2 and fit["resumed_from"] is None and fit["steps_trained"] == 2
    assert fit["total_steps"] == 4 and fit["pace_s"] > 0 and fit["data_wait_s_mean"] >= 0
    status = json.loads((node / "status.json").read_text())["steps"]
    assert status["train"]["state"] == "stopped" and status["checkpoint-pack"]["state"] == "done"
    index, packed_checkpoint = _brought_back(tmp_path, node, "checkpoint", monkeypatch)
    assert index["checkpoint"] == "train/checkpoints/step-2" and index["step"] == 2 and index["total_steps"] == 4
    # The machine that stopped it resumes it (`node start` again there; no deadline: to the end).
    (node / "deadline.json").unlink()
    restarted = cli_pipeline(node, monkeypatch)
    restarted.train_in_session(restarted.trainer_env())
    fit = json.loads((node / "train-fit.json").read_text())
    assert fit["finished"] is True and fit["resumed_from"] == "step-2" and fit["steps_trained"] == 2
    assert fit["time_budget_s"] is None and not (node / "run/train/result.json").read_text().count('"stopped_for_budget": true')
    # The next session's node: the run folder as `prepare --run-from --checkpoint-from` carries it.
    resumed = tmp_path / "node-resumed"
    generation, pipeline = _a_fresh_node(tmp_path, resumed, [packed_checkpoint], tiny_target_dir, train, monkeypatch)
    assert sorted(p.name for p in (resumed / "src/run/train").iterdir()) == ["best.json", "checkpoints", "vocab_map.safetensors"]
    assert travel.carried() == {"generation": True, "draft": False, "checkpoint": True, "scaling": False}
    pipeline.train_in_session(pipeline.trainer_env())
    fit = json.loads((resumed / "train-fit.json").read_text())
    assert fit["finished"] is True and fit["resumed_from"] == "step-2" and fit["steps_trained"] == 2
    here, there = (load_file(n / "run/train/checkpoints/step-4/model.safetensors") for n in (node, resumed))
    assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)
    _a_broken_checkpoint_is_refused(tmp_path, packed_checkpoint, generation)
    drafts = _the_finished_draft_travels_as_a_draft(tmp_path, pipeline, monkeypatch)
    _the_next_sessions_gate_it(tmp_path, tiny_target_dir, generation, drafts, train, monkeypatch)


def test_a_forecast_run_stopped_in_a_scaling_draft_resumes_it_on_a_fresh_node_and_trains_nothing_twice(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "qwen-forecast" order (train.forecast_full_draft) across three sessions, each on a
    fresh node: the first session's budget finishes the smaller scaling draft and stops the
    larger one at its first checkpoint, which travels with the finished draft (exported in bf16,
    its record and the index) and none of its checkpoints; the second trains the finished one no
    more, resumes the stopped one at its step, writes the forecast from both before the full
    draft's first step, and stops the full draft in its turn; its checkpoint carries the export of
    the scaling draft it finished and only the record of the one it was given, which the third
    session's prepare takes from the first's tar (and refuses to go without, naming it); the third
    finishes the full draft on the standing forecast, and the gate's session gathers every
    scaling draft's export from the tars so far."""
    import tarfile

    train = {"hidden_states": "online", "max_steps": 8, "eval_every": 4, "save_every": 4,
             "scaling_fractions": [0.5, 0.75], "forecast_full_draft": True}  # fmt: skip
    node = tmp_path / "node"
    # The 0.5 draft's first checkpoint is its last step (4 of 4), the 0.75 draft's is step 4 of 6,
    # where it stops.
    _trained_with_60_s_left(tmp_path_factory.getbasetemp(), tiny_target_dir, node, train, monkeypatch)
    index = json.loads((node / "run/train/scaling/index.json").read_text())
    (half,) = index["drafts"]
    larger = index["stopped_for_budget"]
    fit = json.loads((node / "train-fit.json").read_text())
    assert fit["draft"] == larger and fit["stopped_at_step"] == 4 and fit["total_steps"] == 6 and not fit["finished"]
    assert not (node / "run/train/result.json").exists() and not (node / "run/train/forecast.json").exists()
    assert json.loads((node / "status.json").read_text())["steps"]["checkpoint-pack"]["state"] == "done"
    packed_index, packed = _brought_back(tmp_path, node, "checkpoint", monkeypatch)
    assert packed_index["checkpoint"] == f"{larger}/checkpoints/step-4" and packed_index["total_steps"] == 6
    assert packed_index["exports"] == [half["samples"]]
    finished = half["final"].rsplit("/", 1)[0]
    with tarfile.open(packed) as tar:
        names = set(tar.getnames())
    assert f"run/{larger}/checkpoints/step-4/meta.json" in names and "run/train/scaling/index.json" in names
    assert {f"run/{finished}/result.json", f"run/{half['final']}/model.safetensors"} <= names
    assert not any(n.startswith(f"run/{finished}/checkpoints") for n in names)  # finished: its export travels
    # The second session's node (`prepare --run-from --checkpoint-from`), with 60 s left again.
    resumed = tmp_path / "node-resumed"
    _, pipeline = _a_fresh_node(tmp_path, resumed, [packed], tiny_target_dir, train, monkeypatch)
    assert _bf16_only(resumed / f"src/run/{half['final']}/model.safetensors")
    assert travel.carried()["checkpoint"] is True and travel.newest_checkpoint(resumed / "run").parent.parent.name == larger.rsplit("/", 1)[1]
    (resumed / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 60, "budget_s": 1800.0}))
    pipeline.train_in_session(pipeline.trainer_env())
    run = resumed / "run"
    fit = json.loads((resumed / "train-fit.json").read_text())
    assert fit["draft"] == "train" and fit["stopped_at_step"] == 4 and not fit["finished"]
    assert not (run / finished / "checkpoints").exists()  # the finished draft was not trained again
    assert json.loads((run / larger / "result.json").read_text())["resumed_from"].endswith("step-4")
    forecast = json.loads((run / "train/forecast.json").read_text())
    assert [p["samples"] for p in forecast["points"]] == [half["samples"], int(larger.rsplit("-", 1)[1])]
    first_step = min(p.stat().st_mtime for p in (run / "train/checkpoints").rglob("*") if p.is_file())
    assert forecast["written_at"] < first_step
    second_index, second = _brought_back(tmp_path, resumed, "checkpoint", monkeypatch, tar_name="checkpoint-2")
    assert second_index["checkpoint"] == "train/checkpoints/step-4"
    assert second_index["exports"] == [int(larger.rsplit("-", 1)[1])]  # the one it finished, not the one given
    with tarfile.open(second) as tar:
        names = set(tar.getnames())
    assert {f"run/{finished}/result.json", "run/train/forecast.json", f"run/{larger}/final/model.safetensors"} <= names
    assert not any(n.startswith(f"run/{half['final']}") for n in names)
    # The third session's prepare takes the export from the session that trained it, and refuses
    # to carry the draft without it, naming what is missing.
    with pytest.raises(ValueError, match=rf"checkpoint-2\.tar: its scaling index lists {half['final']} as finished"):
        travel.unpack_oldest_first([second], travel.unpack_checkpoint, tmp_path / "alone")
    third = tmp_path / "node-third"
    _, pipeline = _a_fresh_node(tmp_path, third, [packed, second], tiny_target_dir, train, monkeypatch)
    assert _bf16_only(third / f"src/run/{half['final']}/model.safetensors")
    assert not (third / f"src/run/{larger}/checkpoints").exists()  # the first tar's stale checkpoint stays out
    pipeline.train_in_session(pipeline.trainer_env())
    run = third / "run"
    fit = json.loads((third / "train-fit.json").read_text())
    assert fit["finished"] is True and fit["draft"] == "train" and fit["steps"] == 8
    assert json.loads((run / "train/result.json").read_text())["forecast"]["written_at"] == forecast["written_at"]
    # The full draft travels to the gate's session with the forecast its report sets beside it.
    assert pipeline.pack_trained_draft() is True
    drafts = json.loads((third / "drafts/index.json").read_text())
    joined = tmp_path / "drafts.tar"
    joined.write_bytes(b"".join((third / "drafts" / Path(part).name).read_bytes() for part in drafts["parts"]))
    with tarfile.open(joined) as tar:
        assert {"run/train/forecast.json", "run/train/forecast-check.json"} <= set(tar.getnames())
    # And the scaling drafts' index and records (both came in: no export goes back again); the
    # gate's session gathers their exports from the sessions that trained them.
    pipeline.pack_scaling_drafts()
    scaling_index, scaling = _brought_back(tmp_path, third, "scaling-drafts", monkeypatch)
    assert scaling_index["scaling-drafts"] == [d["samples"] for d in forecast["points"]] and scaling_index["exports"] == []
    gate = tmp_path / "gate-src"
    travel.unpack_oldest_first([packed, second, scaling], travel.unpack_scaling_drafts, gate)
    for point in forecast["points"]:
        assert _bf16_only(gate / f"run/train/scaling/frac-{point['samples']}/final/model.safetensors")


def _trained_with_60_s_left(base: Path, tiny_target_dir: Path, node: Path, train: dict,
                            monkeypatch: pytest.MonkeyPatch, reserve_s: float = 0.0) -> None:  # fmt: skip
    """A node whose run holds its generation, trained within a session with 60 s left: less than
    a checkpoint's way back (~300 s at its forecast size), so the train stage's budget is the
    least, 1 s, and each draft stops at its first checkpoint (a draft whose first is its last
    step finishes)."""
    from tests.draft_support import extracted_run

    _, params = extracted_run(base, tiny_target_dir, node, **train)
    monkeypatch.setenv("H200_PROFILE", str(params))
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 60, "budget_s": 1800.0}))
    pipeline = cli_pipeline(node, monkeypatch)
    pipeline.train_in_session(pipeline.trainer_env(), reserve_s=reserve_s)


def _brought_back(tmp_path: Path, node: Path, name: str, monkeypatch: pytest.MonkeyPatch,
                  tar_name: str | None = None) -> tuple[dict, Path]:  # fmt: skip
    """What the node packed as `name` (checkpoint, scaling-drafts), as `node NAME K` returns it:
    its index, and its parts joined (`tar_name`.tar, NAME.tar by default), checked against the
    index's sha256."""
    index = json.loads((node / name / "index.json").read_text())
    tar_name = tar_name or name
    out = tmp_path / f"out-{tar_name}"
    monkeypatch.setenv("OUT", str(out))
    for k in range(travel.calls_for(index["bytes"])):
        assert travel.node_packed(name, k) == 0
    packed = tmp_path / f"{tar_name}.tar"
    packed.write_bytes(b"".join((out / p).read_bytes() for p in index["parts"]))
    assert node_env.sha256(packed) == index["sha256"]
    return index, packed


def _a_fresh_node(tmp_path: Path, resumed: Path, packed: list[Path], tiny_target_dir: Path, train: dict,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Pipeline]:  # fmt: skip
    """The next session's node: the generation (`node wait`'s) and the checkpoints (the sessions'
    so far, oldest first) unpacked into its src as `prepare --run-from --checkpoint-from ...`
    carries them, its run folder from there, and what it carried noted. Returns the
    generation.tar and the node's pipeline."""
    import shutil

    from tests.draft_support import params_for

    generation = generation_tar(tmp_path / "out-generation", tmp_path / "out-generation/generation.tar")
    travel.unpack_generation(generation, resumed / "src")
    travel.unpack_oldest_first(packed, travel.unpack_checkpoint, resumed / "src")
    shutil.copytree(resumed / "src/run", resumed / "run")
    monkeypatch.setenv("H200_PROFILE", str(params_for(resumed, tiny_target_dir, **train)))
    pipeline = cli_pipeline(resumed, monkeypatch)
    pipeline._note_carried()
    return generation, pipeline


def _a_broken_checkpoint_is_refused(tmp_path: Path, packed_checkpoint: Path, generation: Path) -> None:
    """A checkpoint brought back broken is refused before anything is unpacked, naming the file."""
    import tarfile

    broken = tmp_path / "broken.tar"
    data = bytearray(packed_checkpoint.read_bytes())
    with tarfile.open(packed_checkpoint) as tar:
        data[tar.getmember("run/train/checkpoints/step-2/optimizer.pt").offset_data + 100] ^= 0xFF
    broken.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"broken\.tar: run/train/checkpoints/step-2/optimizer\.pt does not match the sha256"):
        travel.unpack_checkpoint(broken, tmp_path / "bad-checkpoint")
    assert not (tmp_path / "bad-checkpoint").exists()
    with pytest.raises(ValueError, match=r"generation\.tar: members outside run/train/"):
        travel.unpack_checkpoint(generation, tmp_path / "bad-checkpoint")


def _bf16_only(path: Path) -> bool:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    return "BF16" in dtypes and "F32" not in dtypes  # the weights; the vocabulary maps keep their integer types


def _the_finished_draft_travels_as_a_draft(tmp_path: Path, pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The finished draft (exported by the train stage that finished it) packed as `node drafts K`
    returns it: its best checkpoint in bf16, what `prepare --draft-from` unpacks."""
    assert pipeline.pack_trained_draft() is True
    index = json.loads((node_env.NODE / "drafts/index.json").read_text())
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    assert travel.node_packed("drafts", 0) == 0
    packed = tmp_path / "drafts.tar"
    packed.write_bytes(b"".join((out / p).read_bytes() for p in index["parts"]))
    train = travel.unpack_draft(packed, tmp_path / "src")
    assert sorted(p.name for p in train.iterdir()) == ["best.json", "data.json", "final", "plots", "result.json",
                                                        "vocab_map.safetensors"]  # fmt: skip
    assert _bf16_only(train / "final/model.safetensors")
    assert json.loads((train / "final/config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=r"generation\.tar: members outside run/train/"):
        travel.unpack_draft(_tar_of(tmp_path, node_env.NODE), tmp_path / "bad")
    return packed


def _the_next_sessions_gate_it(tmp_path: Path, tiny_target_dir: Path, generation: Path, drafts: Path,
                               train: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The session after: the run folder as `prepare --run-from --draft-from` carries it, where a
    scaling draft trains online beside it, on its vocabulary map (qwen-scaling), and travels in
    its turn (`node scaling-drafts K`, `prepare --scaling-from`); the node after that gates the
    carried draft with it through the gate stage, training none: emulated SGLang, the baseline
    and 3 steps twice each, the scaling draft once."""
    import shutil
    import tarfile

    from tests.draft_support import params_for

    fresh = tmp_path / "node2"
    travel.unpack_generation(generation, fresh / "src")
    travel.unpack_draft(drafts, fresh / "src")
    shutil.copytree(fresh / "src/run", fresh / "run")
    params_for(fresh, tiny_target_dir, **{**train, "scaling_fractions": [0.5]})
    pipeline = cli_pipeline(fresh, monkeypatch)
    pipeline._note_carried()
    assert travel.carried() == {"generation": True, "draft": True, "checkpoint": False, "scaling": False}
    (tmp_path / "out2").mkdir()
    travel.collect_generation(tmp_path / "out2")
    assert list((tmp_path / "out2").iterdir()) == []
    assert steps.node_scaling(None) == 0
    pipeline.pack_scaling_drafts()
    index, scaling_tar = _brought_back(tmp_path, fresh, "scaling-drafts", monkeypatch)
    assert index["scaling-drafts"] == [d["samples"] for d in json.loads((fresh / "run/train/scaling/index.json").read_text())["drafts"]]
    third = tmp_path / "node3"
    travel.unpack_generation(generation, third / "src")
    travel.unpack_draft(drafts, third / "src")
    scaling = travel.unpack_scaling_drafts(scaling_tar, third / "src")
    (samples,) = index["scaling-drafts"]
    assert sorted(p.name for p in (scaling / f"frac-{samples}").iterdir()) == ["best.json", "final", "result.json"]
    assert _bf16_only(scaling / f"frac-{samples}/final/model.safetensors")
    with pytest.raises(ValueError, match=r"drafts\.tar: members outside run/train/scaling/"):
        travel.unpack_scaling_drafts(drafts, tmp_path / "bad-scaling")
    index_only = tmp_path / "index-only.tar"  # the index without the drafts it lists
    with tarfile.open(index_only, "w") as tar:
        tar.add(scaling / "index.json", "run/train/scaling/index.json")
    with pytest.raises(ValueError, match=rf"index-only\.tar: its scaling index lists train/scaling/frac-{samples}/final as finished"):
        travel.unpack_oldest_first([index_only], travel.unpack_scaling_drafts, tmp_path / "bad-scaling")
    assert not (tmp_path / "bad-scaling").exists()
    shutil.copytree(third / "src/run", third / "run")
    monkeypatch.setenv("H200_PROFILE", str(params_for(third, tiny_target_dir, **{**train, "scaling_fractions": [0.5]})))
    pipeline = cli_pipeline(third, monkeypatch)
    pipeline._note_carried()
    assert travel.carried() == {"generation": True, "draft": True, "checkpoint": False, "scaling": True}
    gate = ["gate.engine=emulated", "gate.num_steps=[3]", "gate.topk_points=[]", "gate.repetitions=2",
            "gate.num_prompts=4", "gate.max_new_tokens=8", "gate.replay_sequences=8", "gate.n_bootstrap=200",
            "gate.cost_iters=2", "gate.breakeven_accept_lengths=[]", 'gate.incumbent="off"']  # fmt: skip
    pipeline.stage("gate", *gate)
    report = json.loads((third / "run/gate/report.json").read_text())
    names = [c["name"] for c in report["decision"]["configs"]]
    assert names[:2] == ["baseline", "eagle3-s3-k1-n4"] and len(names) == 3
    assert names[2].startswith("scaling-") and names[2].endswith(":eagle3-s3-k1-n4")
    assert report["decision"]["outcome"] in ("promote", "reject")


def _tar_of(tmp_path: Path, node: Path) -> Path:
    """A generation.tar-shaped tar (members under run/, not run/train/)."""
    import tarfile

    path = tmp_path / "generation.tar"
    with tarfile.open(path, "w") as tar:
        tar.add(node / "run/run.json", "run/run.json")
    return path


def _stops_for_the_session_end(node: Path, step: Callable[[], None], journaled: Callable[[], int]) -> None:
    """`step` (a watched stage) in a thread until 8 requests are journaled; then the session's end
    moves near (`node start` again with less: less than the way back), and it must end raising
    SessionEnds, its stage stopped."""
    import threading

    raised: list[BaseException] = []

    def run() -> None:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - the test asserts what it was
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    began = time.monotonic()
    while journaled() < 8 and thread.is_alive() and time.monotonic() - began < 240:
        time.sleep(0.05)
    (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 30, "budget_s": 3600.0}))
    thread.join(timeout=180)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], SessionEnds), raised


def test_a_generation_its_session_cannot_finish_stops_in_time_travels_and_resumes_on_the_next_node(
    tmp_path: Path, tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generate stage (the real CLI, against a simulated SGLang server) is watched against
    the session's device time: once what is left would not cover stopping it and bringing its
    generation back, the pipeline stops it (SIGTERM), packs the run folder's generation with the
    journals of its uncommitted shards and says so in status.json; `node wait` brings it back,
    `prepare --run-from` takes it (a generation not complete: the node regenerates what is
    missing), and a fresh node resumes it to the end, sending only the requests no journal held,
    none of them twice; that node's complete generation then travels as any other."""

    import httpx

    from tasks.config import load_config
    from tasks.runfolder import RunFolder, read_journal
    from tasks.standins.server import ServerProcess
    from tests.run_support import discover_and_fingerprint, write_params

    prompts = 96

    def journaled(run: Path, shards: set[str] | None = None) -> list[str]:
        folder = RunFolder(str(run))
        return [r["request_id"] for shard in folder.listdir("generate/journal") if shards is None or shard in shards
                for r in read_journal(folder, "generate", shard).records if r["status"] == "ok"]  # fmt: skip

    def sent() -> int:
        return httpx.get(f"{server.url}/_stats").json()["generate_requests"]

    def pipeline_on(node: Path) -> Pipeline:
        return cli_pipeline(node, monkeypatch)

    # ~20 s of requests (16 steps of 20 ms, 8 at a time): long enough to be stopped in the middle.
    server = ServerProcess(["--simulate", "--step-latency-ms", "20", "--vocab-size", "2048", "--max-batch", "8"])
    try:
        node = tmp_path / "node"
        params = write_params(node.parent, tiny_target_dir, str(node / "run"), stages=["discover", "generate"],
                              sampling={"max_new_tokens": 16}, discover={"total_prompts": prompts},
                              engine={"kind": "sglang", "endpoints": [server.url], "concurrency_per_server": 4},
                              generate={"shard_size": 12, "max_parallel_shards": 2, "progress_interval_s": 1})  # fmt: skip
        discover_and_fingerprint(load_config(params))
        # What prepare's discovery leaves in the payload: prompts/, and no run.json yet (the
        # generate stage's flow writes it after the watch has begun: run 21's first pass failed so).
        (node / "run/run.json").unlink()
        monkeypatch.setenv("H200_PROFILE", str(params))
        monkeypatch.setattr(generation, "GENERATION_POLL_S", 0.2)
        pipeline = pipeline_on(node)
        pipeline._note_carried()
        (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 3600, "budget_s": 3600.0}))
        _stops_for_the_session_end(node, lambda: pipeline.generate(server.url), lambda: len(journaled(node / "run")))
        stopped = json.loads((node / travel.GENERATION_STOPPED).read_text())
        assert stopped["exit"] == 143 and stopped["way_back_s"] >= generation.GENERATION_STOP_S
        done_here = journaled(node / "run")
        assert 8 <= len(done_here) < prompts and not (node / "run/generate/_COMPLETE").exists()
        status = json.loads((node / "status.json").read_text())
        assert status["steps"]["generate"]["state"] == "stopped" and "`prepare --run-from` resumes it" in status["detail"]
        # `node wait` brings it back; prepare --run-from unpacks it, a generation not complete.
        packed = generation_tar(tmp_path / "out", tmp_path / "generation.tar")
        fresh = tmp_path / "fresh"
        run = travel.unpack_generation(packed, fresh / "src")
        assert travel.run_holds(run)["generation"] is False and not list(run.rglob("leases"))
        committed = {m.stem for m in (run / "generate/_SUCCESS").glob("*.json")}
        uncommitted = set(RunFolder(str(node / "run")).listdir("generate/journal")) - committed
        assert set(RunFolder(str(run)).listdir("generate/journal")) == uncommitted  # committed: their data holds them
        assert sorted(journaled(run)) == sorted(journaled(node / "run", uncommitted))
        # The next session's node: the run folder as the payload's setup copies it.
        import shutil

        shutil.copytree(run, fresh / "run")
        resumed = pipeline_on(fresh)
        resumed._note_carried()
        assert travel.carried()["generation"] is False and not resumed.generated()
        before = sent()
        resumed.generate(server.url)
        assert (fresh / "run/generate/_COMPLETE").is_file()
        rows = RunFolder(str(fresh / "run")).read_json("generate/progress.json")["requests"]
        assert rows["done"] == prompts
        assert sent() - before <= prompts - len(done_here)  # only what no journal held was sent
        assert len(set(journaled(fresh / "run"))) == len(journaled(fresh / "run"))  # none journaled twice
        again = tmp_path / "out-again"
        again.mkdir()
        travel.collect_generation(again)  # a generation completed here travels: it came partial
        assert list(again.glob("generation.tar.part-*"))
    finally:
        server.stop()


def test_a_watch_that_fails_leaves_no_stage_running(
    tmp_path: Path, tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage's watch that fails (run 21's first pass: its generation watch read a run.json not
    yet written) ends the stage's CLI before the failure goes on: no generation keeps sending
    requests behind a pipeline that reported it failed."""

    import httpx

    from tasks.config import load_config
    from tasks.standins.server import ServerProcess
    from tests.run_support import cli_env, discover_and_fingerprint, write_params

    server = ServerProcess(["--simulate", "--step-latency-ms", "20", "--vocab-size", "2048", "--max-batch", "8"])
    try:
        node = tmp_path / "node"
        params = write_params(node.parent, tiny_target_dir, str(node / "run"), stages=["discover", "generate"],
                              sampling={"max_new_tokens": 16}, discover={"total_prompts": 96},
                              engine={"kind": "sglang", "endpoints": [server.url], "concurrency_per_server": 4},
                              generate={"shard_size": 12, "max_parallel_shards": 2})  # fmt: skip
        discover_and_fingerprint(load_config(params))
        monkeypatch.setenv("H200_PROFILE", str(params))
        monkeypatch.setattr(node_env, "NODE", node)
        pipeline = Pipeline()
        pipeline.env = {**cli_env(node, OMP_NUM_THREADS="1"), "PYTHONPATH": str(node_env.REPO)}
        (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 3600, "budget_s": 3600.0}))
        watched = []

        def failing_watch(proc) -> None:
            watched.append(proc)
            while not (node / "run/generate/journal").is_dir() and proc.poll() is None:  # requests are under way
                time.sleep(0.05)
            raise FileNotFoundError("the watch's own failure")

        with pytest.raises(FileNotFoundError, match="the watch's own failure"):
            pipeline.stage("generate", f"engine.endpoints=[{server.url}]", watch=failing_watch)
        (proc,) = watched
        assert proc.returncode is not None  # ended before the failure went on, not left behind
        sent = httpx.get(f"{server.url}/_stats").json()["generate_requests"]
        time.sleep(1.0)
        assert httpx.get(f"{server.url}/_stats").json()["generate_requests"] == sent < 96
    finally:
        server.stop()




def test_a_synthesis_its_session_cannot_finish_stops_in_time_travels_and_resumes_before_discovery(
    tmp_path: Path, tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with a synthesized source comes to the node without its discovery (prepare leaves it
    there: payload.node_discovery). The node's discover stage (the real CLI, against a simulated
    SGLang server) writes the synthesized prompts on the generation server, watched as generation
    is: stopped in time for the session's end, packed with the journals of its uncommitted
    shards, taken by `prepare --run-from` though it holds no discovery yet, and resumed by a fresh
    node, which sends only the slots no journal held, none twice, and then discovers."""
    import shutil

    import httpx

    from tasks.runfolder import RunFolder, read_journal
    from tasks.standins.server import ServerProcess
    from tests.run_support import write_params

    slots = 96

    def journaled(run: Path, shards: set[str] | None = None) -> list[str]:
        folder = RunFolder(str(run))
        if not folder.exists("synthesize/journal"):
            return []
        return [r["request_id"] for shard in folder.listdir("synthesize/journal") if shards is None or shard in shards
                for r in read_journal(folder, "synthesize", shard).records if r["status"] == "ok"]  # fmt: skip

    server = ServerProcess(["--simulate", "--step-latency-ms", "20", "--vocab-size", "2048", "--max-batch", "8"])
    try:
        node = tmp_path / "node"
        synth = {"name": "synth-chat", "kind": "synthesized", "domain": "general_chat", "count": slots, "seed": 0,
                 "max_request_tokens": 16}  # fmt: skip
        params = write_params(node.parent, tiny_target_dir, str(node / "run"), stages=["discover", "generate"],
                              engine={"kind": "sglang", "endpoints": [server.url], "concurrency_per_server": 4},
                              generate={"shard_size": 12, "max_parallel_shards": 2, "progress_interval_s": 1})  # fmt: skip
        import yaml

        profile = yaml.safe_load(params.read_text())
        profile["discover"]["sources"].append(synth)
        params.write_text(yaml.safe_dump(profile))
        (node / "run").mkdir(parents=True)  # what setup makes of a payload without a run folder
        monkeypatch.setenv("H200_PROFILE", str(params))
        monkeypatch.setattr(generation, "GENERATION_POLL_S", 0.2)
        pipeline = cli_pipeline(node, monkeypatch)
        pipeline._note_carried()
        pipeline.write_params()  # what the node's helper steps read (the synthesis reference)
        (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 3600, "budget_s": 3600.0}))
        _stops_for_the_session_end(node, lambda: pipeline.discover_here(server.url), lambda: len(journaled(node / "run")))
        stopped = json.loads((node / travel.GENERATION_STOPPED).read_text())
        assert stopped["step"] == "discover" and stopped["exit"] == 143
        done_here = journaled(node / "run")
        assert 8 <= len(done_here) < slots and not (node / "run/prompts/_SUCCESS.json").exists()
        status = json.loads((node / "status.json").read_text())
        assert status["steps"]["discover"]["state"] == "stopped" and "the synthesis (before discovery) travels" in status["detail"]
        packed = generation_tar(tmp_path / "out", tmp_path / "generation.tar")
        fresh = tmp_path / "fresh"
        run = travel.unpack_generation(packed, fresh / "src")  # no discovery in it: a synthesis to resume
        assert not (run / "prompts").exists() and not list(run.rglob("leases"))
        committed = {m.stem for m in (run / "synthesize/_SUCCESS").glob("*.json")}
        uncommitted = set(RunFolder(str(node / "run")).listdir("synthesize/journal")) - committed
        assert set(RunFolder(str(run)).listdir("synthesize/journal")) == uncommitted  # committed: their data holds them
        assert sorted(journaled(run)) == sorted(journaled(node / "run", uncommitted))
        shutil.copytree(run, fresh / "run")
        resumed = cli_pipeline(fresh, monkeypatch)
        resumed._note_carried()
        resumed.write_params()
        before = httpx.get(f"{server.url}/_stats").json()["generate_requests"]
        resumed.discover_here(server.url)
        assert (fresh / "run/prompts/_SUCCESS.json").is_file()
        sent = httpx.get(f"{server.url}/_stats").json()["generate_requests"] - before
        assert sent <= 1 + slots - len(done_here)  # only what no journal held, beside the one batched reference
        # Each session sets the synthesis beside one plain batched request of its shape, first.
        first = json.loads((node / "synthesis-reference.json").read_text())
        assert first["synthesis_reference_prompts"] == slots and first["synthesis_reference_tok_s"] > 0
        rate = json.loads((fresh / "measurements.json").read_text())["synthesis"]
        assert rate["tok_s"] > 0 and rate["reference_tok_s"] > 0 and rate["vs_reference"] == rate["tok_s"] / rate["reference_tok_s"]
        again = journaled(fresh / "run")
        assert len(set(again)) == len(again)  # none journaled twice
        report = json.loads((fresh / "run/prompts/discovery_report.json").read_text())
        assert "synth-chat" in json.dumps(report)
    finally:
        server.stop()
