"""benchmarks/recipe_ab_report.py over a small hand-made results folder of the "recipe" plan
(what `node wait` brings back): the gate's per-request records written as the gate's own
RequestRecord, its decision's accept lengths from the gate's own pooling, the replay's
per-sequence counts, the trainers' results and a stage log's Prefect lines."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from dataclasses import asdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.real_run_report import Results  # noqa: E402
from benchmarks.recipe_ab_report import build, main  # noqa: E402
from tasks.gate.records import RequestRecord, pooled_accept_lengths  # noqa: E402

PROMPTS = 6
CONFIG = "eagle3-s3-k1-n4"
# Verify cycles per request for 100 tokens after the first (completion 101): SpecForge's
# accept length is 2.0 at every prompt but one, ours today a little lower, betas clearly higher.
VERIFIES = {
    "challenger-specforge": [50, 50, 50, 50, 50, 48],
    "new draft": [55, 53, 56, 54, 52, 55],
    "challenger-betas": [40, 41, 39, 40, 42, 40],
}


def _config_name(contender: str) -> str:
    return CONFIG if contender == "new draft" else f"{contender}:{CONFIG}"


def _records(contender: str, rep: int) -> list[RequestRecord]:
    out = []
    for i, verifies in enumerate(VERIFIES[contender]):
        r = RequestRecord(_config_name(contender), "default", rep, i, f"p{i}", "general_chat", completion_tokens=101,
                          spec_verify_ct=verifies, correct_drafts_histogram=[verifies // 2, verifies // 4, 0, verifies // 4])  # fmt: skip
        if contender == "new draft" and rep == 1 and i == 0:  # a failed request counts nothing
            r.error, r.spec_verify_ct = "timeout", 1
        out.append(r)
    return out


def _log(lines: list[tuple[str, str]]) -> bytes:
    return "\n".join(f"{t} | INFO    | Flow run 'x' - {what}" for t, what in lines).encode()


@pytest.fixture()
def results(tmp_path: Path) -> Path:
    def write(rel: str, data: object) -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(data))

    write("measurements.json", {"recipe": {"variants": {"default": [], "betas": ["train.adam_betas=[0.9, 0.999]"]}}})
    launches, configs, contenders = [], [], []
    for contender in VERIFIES:
        records = [r for rep in (0, 1) for r in _records(contender, rep)]
        launches += [{"config": _config_name(contender), "repetition": rep, "requests": [asdict(r) for r in records if r.repetition == rep]}
                     for rep in (0, 1)]  # fmt: skip
        accept, _ = pooled_accept_lengths(records)
        configs.append({"name": _config_name(contender), "accept_per_position": [0.5, 0.25, 0.25]})
        contenders.append({"name": contender, "config": _config_name(contender), "accept_length": accept,
                           "median_tok_s": 400.0, "speedup": 0.8, "ci_low": 0.7, "ci_high": 0.9, "exact_match_fraction": 0.5})  # fmt: skip
    configs.append({"name": "baseline", "median_tok_s": 500.0, "accept_per_position": None})
    write("recipe-default/gate/report.json", {
        "gate_config": {"n_bootstrap": 400, "bootstrap_seed": 0, "ci_level": 0.95, "repetitions": 2, "num_steps": [3]},
        "bench": {"prompts": [{"index": i} for i in range(PROMPTS)], "launches": launches},
        "decision": {"outcome": "reject", "baseline": "baseline", "configs": configs, "contenders": contenders, "left_out": []},
    })  # fmt: skip
    seq_ids = [f"s{i}" for i in range(8)]
    tokens, cycles = [30, 40, 20, 50, 35, 45, 25, 60], [15, 21, 10, 24, 18, 22, 13, 29]

    def replayed(ids: list[str], tok: list[int], cyc: list[int]) -> dict[str, object]:
        return {"overall": {"3": {"accept_length": sum(tok) / sum(cyc), "ci_low": 1.8, "ci_high": 2.2,
                                  "accept_per_position": [0.5, 0.3, 0.2], "sequences": len(ids)}},
                "settings": {"n_bootstrap": 400, "seed": 0, "ci_level": 0.95},
                "per_sequence": {"3": {"sequence_id": ids, "tokens": tok, "cycles": cyc}}}  # fmt: skip

    # betas replays exactly SpecForge's counts, listed in another order: paired by sequence, no difference.
    write("recipe-replay.json", {"specforge": replayed(seq_ids, tokens, cycles),
                                 "betas": replayed(seq_ids[::-1], tokens[::-1], cycles[::-1]),
                                 "default": replayed(seq_ids, [t - 3 for t in tokens], cycles)})  # fmt: skip
    history = [{"step": s, "batch_tokens": 1000.0, "tok_per_s": 50_000.0, "clipped": s < 3, "grad_norm": 1.0, "loss": 10.0 - s}
               for s in range(1, 5)]  # fmt: skip
    evals = [{"step": 0, "loss": 12.0, "pooled_accept_len_3": 1.0}, {"step": 4, "loss": 6.0, "pooled_accept_len_3": 1.7,
                                                                     "train_clip_rate": 0.5, "train_grad_norm": 1.0}]  # fmt: skip
    for name in ("default", "betas"):
        write(f"recipe-{name}/train/result.json", {"steps": 4, "history": history, "evals": evals, "recipe": {}})
    write("specforge/specforge_train.json", {"steps": 4, "planned_steps": 4, "stopped_early": False, "train_tokens": 4000,
                                             "seconds": 0.4, "tok_per_s": 10_000.0, "losses": [], "last_step_acc": []})  # fmt: skip
    with tarfile.open(tmp_path / "results.tar.gz", "w:gz") as tar:  # the logs travel only in the archive
        # An older log's eval line (a dict), then today's.
        data = _log([("10:00:00.000", "notify: [run] train started"), ("10:00:05.000", "eval: {'step': 0, 'loss': 12.0}"),
                     ("10:00:05.250", "eval: step 4, loss 6")])  # fmt: skip
        info = tarfile.TarInfo("logs/stage-train-default.log")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return tmp_path


def test_the_gate_accept_lengths_and_their_ratio_to_specforge_come_from_the_request_records(results: Path) -> None:
    fig = build(Results(results))
    rows = fig["contenders"]
    for name, contender in (("default", "new draft"), ("betas", "challenger-betas"), ("specforge", "challenger-specforge")):
        verifies = [v for rep in (0, 1) for i, v in enumerate(VERIFIES[contender]) if not (name == "default" and rep == 1 and i == 0)]
        want = 100 * len(verifies) / sum(verifies)
        gate = rows[name]["gate"]
        assert gate["vs_specforge"]["accept_length"] == pytest.approx(want)
        assert gate["accept_length"] == pytest.approx(want)  # the gate's own pooling agrees
        low, high = gate["vs_specforge"]["ci"]
        assert low <= want <= high and gate["accept_length_ci"] == [low, high]  # the same resampling
    assert rows["default"]["gate"]["requests"] == 2 * PROMPTS - 1  # the failed request left out
    sf = 100 * 12 / sum(VERIFIES["challenger-specforge"] * 2)
    betas = rows["betas"]["gate"]["vs_specforge"]
    assert betas["ratio"] == pytest.approx(100 * 12 / sum(VERIFIES["challenger-betas"] * 2) / sf)
    assert betas["difference_ci"][0] > 0 and betas["ratio_ci"][0] > 1.05
    assert rows["default"]["gate"]["vs_specforge"]["difference_ci"][1] < 0
    assert rows["specforge"]["gate"]["vs_specforge"]["difference_ci"] == [0.0, 0.0]
    assert rows["betas"]["gate"]["accept_per_position"] == [0.5, 0.25, 0.25]
    goals = fig["goals"]["accept_length"]
    assert goals["betas"]["met"] is True and goals["default"]["met"] is False
    assert rows["betas"]["settings"] == ["train.adam_betas=[0.9, 0.999]"]


def test_a_variant_trained_on_more_tokens_than_specforge_is_not_judged_by_the_goal(results: Path) -> None:
    """The goal is at the same data and tokens; the equal-wall-clock draft (more epochs) is shown
    beside it with its ratio, its verdict left open."""
    goals = build(Results(results))["goals"]["accept_length"]
    assert goals["betas"]["same_tokens"] is True and goals["betas"]["met"] is True
    record = json.loads((results / "specforge/specforge_train.json").read_text())
    (results / "specforge/specforge_train.json").write_text(json.dumps({**record, "train_tokens": 3000}))
    goals = build(Results(results))["goals"]["accept_length"]
    assert goals["betas"]["same_tokens"] is False and goals["betas"]["met"] is None
    assert goals["betas"]["ratio"] > 1.05 and goals["default"]["met"] is None


def test_the_replay_difference_is_paired_by_held_out_sequence(results: Path) -> None:
    rows = build(Results(results))["contenders"]
    assert rows["betas"]["replay"]["vs_specforge"]["difference_ci"] == [0.0, 0.0]  # the same counts, another order
    default = rows["default"]["replay"]["vs_specforge"]
    assert default["difference"] == pytest.approx((305 - 24) / 152 - 305 / 152)
    assert default["difference_ci"][1] < 0
    # Against today's default too (whether a setting earns a change of default), by the same pairing.
    betas = rows["betas"]["replay"]["vs_default"]
    assert betas["difference"] == pytest.approx(305 / 152 - (305 - 24) / 152) and betas["difference_ci"][0] > 0
    assert "vs_default" not in rows["default"]["replay"] and "vs_specforge" not in rows["specforge"]["replay"]


def test_without_specforge_replayed_the_variants_still_compare_with_the_default(results: Path) -> None:
    """Run 10's case: SpecForge's draft never replayed, ours did."""
    replay = json.loads((results / "recipe-replay.json").read_text())
    del replay["specforge"]
    (results / "recipe-replay.json").write_text(json.dumps(replay))
    rows = build(Results(results))["contenders"]
    assert rows["specforge"]["replay"] is None and "vs_specforge" not in rows["betas"]["replay"]
    assert rows["betas"]["replay"]["vs_default"]["difference_ci"][0] > 0


def test_a_variant_trained_after_the_pipeline_joins_the_replay_table(results: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """--after: a variant trained alone on the same run once the pipeline was done, and the node's
    recipe-replay.json with it beside the pipeline's drafts: compared by the replay alone, paired
    by sequence with the default and SpecForge's, its training from its own folder."""
    after = tmp_path_factory.mktemp("after")
    replay = json.loads((results / "recipe-replay.json").read_text())
    replay["noise"] = {**replay["default"], "per_sequence": {"3": {**replay["specforge"]["per_sequence"]["3"],
                                                                  "tokens": [t + 2 for t in replay["specforge"]["per_sequence"]["3"]["tokens"]]}}}  # fmt: skip
    (after / "recipe-replay.json").write_text(json.dumps(replay))
    (after / "recipe-noise/train").mkdir(parents=True)
    (after / "recipe-noise/train/result.json").write_text((results / "recipe-default/train/result.json").read_text())
    (after / "logs").mkdir()  # beside the archive, where `node recipe-variant` leaves it
    (after / "logs/stage-train-noise.log").write_bytes(_log([("10:00:00.000", "notify: [run] train started"),
                                                            ("10:00:05.000", "eval: {'step': 0, 'loss': 12.0}"),
                                                            ("10:00:05.500", "eval: {'step': 4, 'loss': 6.0}")]))  # fmt: skip
    rows = build(Results(results), Results(after))["contenders"]
    assert list(rows) == ["default", "betas", "noise", "specforge"]
    noise = rows["noise"]
    assert noise["settings"] == ["train.aux_state_noise=0.05"] and noise["gate"] is None
    assert noise["training"]["steps"] == 4 and noise["training"]["loop_tok_s"] == pytest.approx(8_000.0)  # 4,000 tokens in 0.5 s
    assert noise["replay"]["vs_specforge"]["difference"] == pytest.approx(16 / 152) and noise["replay"]["vs_specforge"]["difference_ci"][0] > 0
    assert noise["replay"]["vs_default"]["difference"] == pytest.approx(40 / 152)
    assert rows["specforge"]["settings"] == "SpecForge 0.2.0's own" and rows["default"]["settings"] == []
    assert "noise" not in build(Results(results))["contenders"]  # without --after, the pipeline's figures alone


def test_training_throughput_and_the_step_goal(results: Path) -> None:
    fig = build(Results(results))
    default, sf = fig["contenders"]["default"]["training"], fig["contenders"]["specforge"]["training"]
    assert default["tokens"] == 4000 and default["step_tok_s"] == pytest.approx(50_000.0)
    assert default["loop_s"] == pytest.approx(0.25) and default["loop_tok_s"] == pytest.approx(16_000.0)
    assert default["clip_rate"] == 0.5 and default["evals"][-1]["pooled_accept_len_3"] == 1.7
    assert fig["contenders"]["betas"]["training"]["loop_tok_s"] is None  # no log came back for it
    assert sf["loop_tok_s"] == 10_000.0
    step = fig["goals"]["training_step"]
    assert step["default"]["loop_tok_s_ratio"] == pytest.approx(1.6) and step["default"]["met"] is True
    assert "betas" not in step


def test_main_writes_recipe_ab_json_beside_the_results(results: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["recipe_ab_report.py", str(results)])
    assert main() == 0
    written = json.loads((results / "recipe-ab.json").read_text())
    assert set(written["contenders"]) == {"default", "betas", "specforge"}
    assert "goal betas" in capsys.readouterr().out
