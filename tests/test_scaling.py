"""Data-scaling curve: the fit and projection on constructed points, the report and plot, and
one small real run of the train stage's scaling drafts (two data fractions) on the tiny target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tasks.draft.scaling_drafts import TrainElsewhere, scaling_drafts, train_scaling_drafts
from tasks.gate.scaling import (
    MEASURED,
    REPLAY,
    ScalingPoint,
    fit_trend,
    plot_scaling,
    write_scaling_report,
)
from tasks.runfolder import RunFolder
from tests.draft_support import extracted_run

PNG = b"\x89PNG\r\n\x1a\n"


def constructed() -> list[ScalingPoint]:
    # math: accept = 1.2 + 0.1 ln(samples) exactly; code: flat at 1.05 (never reaches 1.6)
    pts = [ScalingPoint("math", s, 1.2 + 0.1 * math.log(s)) for s in (100, 1_000, 10_000)]
    return pts + [ScalingPoint("code", s, 1.05) for s in (100, 1_000)]


def test_fit_and_projection_are_exact():
    fits = fit_trend(constructed())
    assert set(fits) == {"math", "code"}
    assert fits["math"].intercept == pytest.approx(1.2) and fits["math"].slope == pytest.approx(0.1)
    assert fits["math"].points == 3
    # 1.6 = 1.2 + 0.1 ln(s)  =>  s = e^4
    assert fits["math"].samples_for(1.6) == pytest.approx(math.exp(4.0))
    assert fits["math"].at(math.exp(4.0)) == pytest.approx(1.6)
    assert fits["code"].slope == pytest.approx(0.0, abs=1e-12)
    assert fits["code"].samples_for(1.6) is None


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match=r"domain 'math': a trend needs points at two or more sample counts"):
        fit_trend([ScalingPoint("math", 100, 1.3), ScalingPoint("math", 100, 1.4)])
    with pytest.raises(ValueError, match=r"domain 'code': points need samples >= 1"):
        fit_trend([ScalingPoint("code", 0, 1.3), ScalingPoint("code", 10, 1.4)])


def test_report_and_plot(tmp_path: Path):
    run = RunFolder(str(tmp_path / "run"))
    report = write_scaling_report(run, constructed(), break_even=1.6, num_steps=3)
    stored = json.loads(run.read_bytes("gate/scaling/report.json"))
    assert stored == json.loads(json.dumps(report))
    assert set(stored) == {"num_steps", "break_even_accept_length", "points", "fits", "no_fit"}
    assert stored["no_fit"] == {}
    assert stored["fits"]["math"]["samples_for_break_even"] == pytest.approx(math.exp(4.0))
    assert stored["fits"]["code"]["samples_for_break_even"] is None
    assert len(stored["points"]) == 5
    assert run.read_bytes("gate/scaling/curve.png")[:8] == PNG
    assert plot_scaling(constructed(), fit_trend(constructed()), None)[:8] == PNG
    # With the full draft's pre-registered forecast beside its measurements, in the one report.
    beside = {"num_steps": 3, "forecast": 2.4, "measured": {"server": {"value": 2.5, "difference": 0.1}}}
    write_scaling_report(run, constructed(), break_even=1.6, num_steps=3, pre_registered=beside)
    assert json.loads(run.read_bytes("gate/scaling/report.json"))["pre_registered"] == beside


def test_measured_points_win_the_fit_over_replayed_ones():
    replayed = [ScalingPoint("chat", s, 1.0 + 0.5 * math.log(s), REPLAY) for s in (100, 1000)]
    measured = [ScalingPoint("chat", s, 1.1 + 0.2 * math.log(s), MEASURED) for s in (100, 1000)]
    fit = fit_trend(replayed + measured)["chat"]
    assert fit.slope == pytest.approx(0.2) and fit.points == 2
    assert fit_trend(replayed)["chat"].slope == pytest.approx(0.5)


def test_train_keys_are_redirected(tmp_path: Path):
    run = RunFolder(str(tmp_path / "run"))
    view = TrainElsewhere(run, "train/scaling/frac-10")
    assert view.path("train/checkpoints/step-4") == run.path("train/scaling/frac-10/checkpoints/step-4")
    assert view.path("train") == run.path("train/scaling/frac-10")
    assert view.path("extract/_SUCCESS/s0.json") == run.path("extract/_SUCCESS/s0.json")
    view.write_json_atomic("train/best.json", {"step": 4})
    assert run.read_json("train/scaling/frac-10/best.json") == {"step": 4}
    assert not run.exists("train/best.json")


@pytest.fixture
def one_thread():
    # Small ops on 2 shared cores: OpenMP spin-waits make 2 threads many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_scaling_drafts_on_the_tiny_target(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, one_thread: None
):
    cfg, _ = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path_factory.mktemp("scaling"),
                           max_steps=6, eval_every=6, save_every=1000, learning_rate=1e-2)  # fmt: skip
    run = RunFolder(cfg.run_root)
    from tasks.extract.storage import extract_metadata

    n_train = extract_metadata(run)["splits"]["train"]
    train = cfg.train.model_copy(update={"scaling_fractions": [0.25, 0.5]})
    entries = train_scaling_drafts(run, train, cfg.target.model_path)
    small, half = round(0.25 * n_train), round(0.5 * n_train)
    assert [(e["fraction"], e["samples"]) for e in entries] == [(0.25, small), (0.5, half)]
    assert scaling_drafts(run) == entries
    # Each fraction trained in its own folder, exported beside it; the run's own train/ result
    # was never written.
    # The same recipe on less data: max_steps (like the warm-up) scales with the fraction.
    for samples, steps in ((small, round(6 * 0.25)), (half, round(6 * 0.5))):
        assert json.loads(run.read_bytes(f"train/scaling/frac-{samples}/result.json"))["steps"] == steps
        assert run.exists(f"train/scaling/frac-{samples}/final/config.json")
    assert not run.exists("train/result.json")
    # A second call loads no finished draft again: the index's record and the export stand, as on a
    # later session's node, which has them and not the checkpoints.
    import shutil

    for samples in (small, half):
        shutil.rmtree(Path(cfg.run_root, f"train/scaling/frac-{samples}/checkpoints"))
    exported = Path(cfg.run_root, f"train/scaling/frac-{small}/final/model.safetensors").stat().st_mtime_ns
    again = train_scaling_drafts(run, train, cfg.target.model_path)
    assert again == entries and [e["steps"] for e in again] == [round(6 * 0.25), round(6 * 0.5)]
    assert Path(cfg.run_root, f"train/scaling/frac-{small}/final/model.safetensors").stat().st_mtime_ns == exported
    # Other settings train it again: a draft of another recipe is another point.
    other = train_scaling_drafts(run, train.model_copy(update={"learning_rate": 5e-3}), cfg.target.model_path)
    assert [e["settings"]["learning_rate"] for e in other] == [5e-3, 5e-3]
    assert Path(cfg.run_root, f"train/scaling/frac-{small}/final/model.safetensors").stat().st_mtime_ns != exported
    # A full draft of another held-out split (its data.json): the curve's points would be replayed
    # on sequences they trained on. Refused before a step, naming both.
    from tasks.draft.data import DATA_META_KEY
    from tasks.draft.trainer import TrainError

    run.write_json_atomic(DATA_META_KEY, {**extract_metadata(run), "hidden_states": "offline", "holdout": "0123456789abcdef"})
    with pytest.raises(TrainError, match=r"data.json: the full draft was made with the held-out split 0123456789abcdef, "
                                         rf"the extracted shards hold {extract_metadata(run)['holdout']}"):  # fmt: skip
        train_scaling_drafts(run, train.model_copy(update={"scaling_fractions": [0.75]}), cfg.target.model_path)


def test_a_domain_with_one_measured_count_falls_back_to_replay_and_one_without_any_is_reported(tmp_path: Path):
    points = [
        ScalingPoint("chat", 100, 1.6, MEASURED), ScalingPoint("chat", 100, 1.5, REPLAY),
        ScalingPoint("chat", 1000, 1.9, REPLAY), ScalingPoint("code", 1000, 2.0, MEASURED),
    ]  # fmt: skip
    report = write_scaling_report(RunFolder(str(tmp_path / "run")), points, break_even=2.5, num_steps=3)
    assert set(report["fits"]) == {"chat"} and report["fits"]["chat"]["points"] == 2  # the replayed ones
    assert report["no_fit"] == {"code": "fewer than two sample counts measured or replayed"}
    assert len(report["points"]) == 4


def test_the_full_draft_s_forecast_is_written_before_it_trains_and_checked_after(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, one_thread: None
):
    """train.forecast_full_draft: the vocabulary map and data record first, the scaling drafts on
    them, the forecast from their curve written before the full draft's first step, then the full
    draft, whose result names the forecast, and the forecast set beside what it reached."""
    from tasks.draft.forecast import FORECAST_CHECK_KEY, FORECAST_KEY
    from tasks.draft.vocab import VocabMap
    from tasks.runfolder import content_hash
    from tasks.train.stage import train_drafts

    cfg, _ = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path_factory.mktemp("forecast"),
                           max_steps=6, eval_every=3, save_every=1000, learning_rate=1e-2,
                           scaling_fractions=[0.25, 0.5], forecast_full_draft=True)  # fmt: skip
    run = RunFolder(cfg.run_root)
    result = train_drafts(cfg)
    assert result is not None and result.steps == 6
    forecast = run.read_json(FORECAST_KEY)
    n_train = run.read_json("train/data.json")["splits"]["train"]
    assert [p["samples"] for p in forecast["points"]] == [round(0.25 * n_train), round(0.5 * n_train)]
    assert forecast["train_sequences"] == n_train and set(forecast["fits"]) >= {"1", "3"}
    fit = forecast["fits"]["3"]
    assert fit["forecast"] == pytest.approx(fit["intercept"] + fit["slope_per_e_fold"] * math.log(n_train))
    # Written before the full draft trained, and named by its result.
    recorded = run.read_json("train/result.json")
    assert recorded["forecast"] == {"content_hash": content_hash(forecast, 16), "written_at": forecast["written_at"]}
    full_mtime = max(p.stat().st_mtime for p in Path(cfg.run_root, "train/checkpoints").rglob("*") if p.is_file())
    assert forecast["written_at"] < full_mtime
    # The scaling drafts drafted over the full draft's vocabulary map, counted once.
    for samples in (p["samples"] for p in forecast["points"]):
        assert run.read_json(f"train/scaling/frac-{samples}/result.json")["steps"] >= 1
    assert VocabMap.load(run).draft_vocab_size == cfg.train.draft_vocab_size
    check = run.read_json(FORECAST_CHECK_KEY)
    reached = recorded["evals"][-1]["pooled_accept_len_3"]
    assert check["per_num_steps"]["3"] == {"forecast": fit["forecast"], "reached": reached,
                                           "difference": reached - fit["forecast"]}  # fmt: skip
    # What the gate's scaling report sets beside it (gate/scaling/report.json's pre_registered).
    from tasks.draft.forecast import forecast_beside

    beside = forecast_beside(run, 3, {"replay": 1.5, "server": None})
    assert beside is not None and beside["forecast"] == fit["forecast"] and beside["written_at"] == forecast["written_at"]
    assert beside["measured"]["training_evaluation"] == {"value": reached, "difference": reached - fit["forecast"]}
    assert beside["measured"]["replay"]["difference"] == pytest.approx(1.5 - fit["forecast"])
    assert beside["measured"]["server"] == {"value": None, "difference": None}
    assert forecast_beside(run, 9, {}) is None  # no fit at 9 draft positions
    # A config that cannot fit a curve is refused before anything trains.
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="forecast_full_draft fits a curve to the scaling drafts: it needs two"):
        cfg.train.model_validate({**cfg.train.model_dump(), "scaling_fractions": [0.5]})
