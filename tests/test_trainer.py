"""The draft trainer on the tiny target's regenerated (greedy) data, extracted by the real
stages: learning is real, more data beats less, resume is exact, checkpoints are honest."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tasks.draft import checkpoint as ckpt
from tasks.draft.target_heads import load_target_heads
from tasks.draft.trainer import TrainCallbacks, TrainError, train_draft
from tasks.draft.vocab import VocabMap, build_vocab_map, count_tokens
from tasks.gate.replay import replay_run
from tasks.runfolder.layout import TRAIN_BEST, TRAIN_RESULT
from tasks.target.tiny import build_tiny_target

LEARN_STEPS = 300


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_learning_is_real_and_more_data_beats_less(make_run):
    cfg, run = make_run("full", learning_rate=1e-2, max_steps=LEARN_STEPS, eval_every=100,
                        save_every=1000)
    evals_seen, events = [], []
    full = train_draft(run, cfg.train, cfg.target.model_path,
                       callbacks=TrainCallbacks(on_eval=evals_seen.append, on_ready=lambda: events.append("ready"),
                                                on_step=lambda record: events.append(record["step"])))  # fmt: skip
    untrained, trained = full.evals[0], full.evals[-1]
    assert (untrained["step"], trained["step"], full.steps) == (0, LEARN_STEPS, LEARN_STEPS)
    assert [e["step"] for e in evals_seen] == [0, 100, 200, 300]
    # Ready once, after the untrained evaluation and before the first step (a caller
    # times the set-up by it).
    assert events == ["ready", *range(1, LEARN_STEPS + 1)]
    # An untrained draft is at chance; predicting the most frequent token would give ~0.03.
    assert untrained["sim_accept"] < 0.01
    assert trained["acc_0"] > 0.10 and trained["sim_accept"] > 0.12
    assert trained["sim_accept"] > 10 * max(untrained["sim_accept"], 0.005)
    assert trained["sim_accept_len"] == pytest.approx(1 + trained["sim_accept"])
    assert trained["loss"] < untrained["loss"] - 0.5

    best = run.read_json(TRAIN_BEST)
    assert best["checkpoint"] == ckpt.checkpoint_key(best["step"])
    assert ckpt.is_complete(run.path(best["checkpoint"]))
    assert best["sim_accept"] == max(e["sim_accept"] for e in full.evals[1:])
    # The held-out pooled accept length is the gate's offline replay of the same draft over the
    # same sequences: one definition (tasks.draft.acceptance), batched or one sequence at a time.
    embed, _ = load_target_heads(cfg.target.model_path)
    at_best = next(e for e in full.evals if e["step"] == best["step"])
    replayed = replay_run(run, ckpt.load_checkpoint_model(run.path(best["checkpoint"]), embed), [1, 2, 3])
    for k in (1, 2, 3):
        assert at_best[f"pooled_accept_len_{k}"] == pytest.approx(replayed.overall[k]["accept_length"], rel=1e-12)
    assert at_best["pooled_accept_len_3"] > 1.1
    assert run.read_bytes("train/plots/accuracy.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert run.read_json(TRAIN_RESULT)["steps"] == LEARN_STEPS
    # Each step records how long it waited for its batch; the first waited for its reading.
    waits = [h["data_wait_s"] for h in run.read_json(TRAIN_RESULT)["history"]]
    assert len(waits) == LEARN_STEPS and waits[0] > 0 and min(waits) >= 0
    vocab = VocabMap.load(run)
    assert vocab.draft_vocab_size == cfg.train.draft_vocab_size

    cfg_less, run_less = make_run("less", learning_rate=1e-2, max_steps=LEARN_STEPS,
                                  eval_every=LEARN_STEPS, save_every=1000)
    less = train_draft(run_less, cfg_less.train, cfg_less.target.model_path, max_train_sequences=48)
    assert less.evals[-1]["positions"] == trained["positions"]  # the same held-out set
    assert trained["sim_accept"] > 1.3 * less.evals[-1]["sim_accept"]


def test_resume_reproduces_the_uninterrupted_loss_curve(make_run, monkeypatch):
    steps, crash_at = 24, 10
    cfg, run = make_run("straight", max_steps=steps, eval_every=8, save_every=crash_at)
    straight = train_draft(run, cfg.train, cfg.target.model_path)

    cfg2, run2 = make_run("resumed", max_steps=steps, eval_every=8, save_every=crash_at)

    class Crash(Exception):
        pass

    def crash(key: str) -> None:
        if key == ckpt.checkpoint_key(crash_at):
            raise Crash(key)

    with pytest.raises(Crash):
        train_draft(run2, cfg2.train, cfg2.target.model_path,
                    callbacks=TrainCallbacks(on_checkpoint=crash))
    # A save that died mid-way (no meta.json) must not be resumed from.
    run2.write_bytes_atomic(f"{ckpt.checkpoint_key(crash_at + 1)}/model.safetensors", b"partial")
    from tasks.draft.data import ShardReader

    events: list[str] = []
    read = ShardReader.batch
    monkeypatch.setattr(ShardReader, "batch", lambda self, refs: events.append(refs[0].split) or read(self, refs))
    resumed = train_draft(run2, cfg2.train, cfg2.target.model_path, callbacks=TrainCallbacks(on_ready=lambda: events.append("ready")))
    # The resumed draft read its held-out batches before its first step, as a fresh one does in
    # its untrained evaluation: none of its evaluations reads them again (run 23's first did).
    ready = events.index("ready")
    assert "eval" in events[:ready] and "eval" not in events[ready:] and events[ready + 1 :].count("train") > 0

    assert resumed.resumed_from == ckpt.checkpoint_key(crash_at)
    assert not run2.exists(ckpt.checkpoint_key(crash_at + 1))
    losses = [h["loss"] for h in straight.history]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    assert [h["loss"] for h in resumed.history] == losses  # bit for bit
    assert [e["sim_accept"] for e in resumed.evals] == [e["sim_accept"] for e in straight.evals]
    final = ckpt.load_checkpoint_model(run.path(straight.last_checkpoint))
    final2 = ckpt.load_checkpoint_model(run2.path(resumed.last_checkpoint))
    for name, value in final.exportable_state_dict().items():
        assert torch.equal(final2.exportable_state_dict()[name], value), name


def test_held_out_batches_past_the_cache_budget_are_read_again_with_the_same_figures(make_run):
    """The held-out batches are kept between evaluations in compute_dtype, up to
    train.eval_cache_gib; past it each evaluation reads them again. Either way the figures are
    those of casting at each evaluation, as before the cache kept them cast (bfloat16 here)."""
    kept_cfg, kept_run = make_run("kept", max_steps=8, eval_every=4, save_every=1000, compute_dtype="bfloat16")
    kept = train_draft(kept_run, kept_cfg.train, kept_cfg.target.model_path)
    read_cfg, read_run = make_run("read-again", max_steps=8, eval_every=4, save_every=1000,
                                  compute_dtype="bfloat16", eval_cache_gib=1e-6)  # fmt: skip
    read = train_draft(read_run, read_cfg.train, read_cfg.target.model_path)
    assert [e["eval_batches_kept"] for e in kept.evals] == [True, True, True]
    assert [e["eval_batches_kept"] for e in read.evals] == [False, False, False]
    # What the machine measured (memory, time), not the figures.
    drop = {"eval_batches_kept", "cuda_peak_allocated_gib", "cuda_peak_reserved_gib", "train_step_s", "train_data_wait_s"}
    assert [{k: v for k, v in e.items() if k not in drop} for e in kept.evals] == \
        [{k: v for k, v in e.items() if k not in drop} for e in read.evals]  # fmt: skip
    assert kept.evals[-1]["positions"] > 0


def test_a_batch_cast_once_is_what_casting_at_each_copy_gives() -> None:
    from tasks.draft.ttt import Batch

    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.randint(0, 100, (2, 5), generator=g), torch.ones(2, 5, dtype=torch.bool),
                  torch.randn(2, 5, 12, generator=g) * 37, torch.randn(2, 5, 4, generator=g), torch.tensor([5, 5]))  # fmt: skip
    cast, copied = batch.cast(torch.bfloat16), batch.to("cpu", torch.bfloat16)
    assert cast.aux_hidden.dtype == torch.bfloat16 and torch.equal(cast.aux_hidden, copied.aux_hidden)
    assert torch.equal(cast.last_hidden, copied.last_hidden) and cast.nbytes < batch.nbytes


def test_refuses_a_target_whose_aux_layers_differ_from_the_extraction(make_run, tmp_path: Path):
    cfg, run = make_run("other", max_steps=2)
    twelve = build_tiny_target(tmp_path / "twelve", num_layers=12)
    with pytest.raises(TrainError, match=r"extracted aux layers \[1, 3, 4\] differ from the draft's \[1, 5, 8\]"):
        train_draft(run, cfg.train, str(twelve))


def test_the_targets_own_greedy_replies_agree_and_another_models_stop_training_before_a_step(make_run, tmp_path: Path):
    """The run's replies were regenerated greedily by the tiny target (seed 0): at the untrained
    evaluation nearly every response token is its argmax. The same replies under a target of
    other weights (seed 1: same tokenizer, vocabulary and shape, what a server of another model
    or target.model_path at other weights gives) agree far less, and training stops before its
    first step, naming the figure and the fix, with nothing written; null turns the check off."""
    cfg, run = make_run("own", max_steps=2, eval_every=100, save_every=100)
    own = train_draft(run, cfg.train, cfg.target.model_path)
    untrained = own.evals[0]
    assert untrained["step"] == 0 and untrained["target_agreement_tokens"] > 500
    assert untrained["target_agreement"] > 0.97

    other = build_tiny_target(tmp_path / "seed1", seed=1)
    cfg, run = make_run("other-weights", max_steps=2, eval_every=100, save_every=100)
    with pytest.raises(TrainError, match=r"the replies are not the target's greedy output: \d+\.\d% of the [\d,]+ "
                                         r"response tokens .* \(at most \d+\.\d% within sampling noise\), "
                                         r"below train.min_target_agreement \(85%\)"):
        train_draft(run, cfg.train, str(other))
    assert not run.exists(TRAIN_RESULT) and run.listdir("train/checkpoints") == []
    off = cfg.train.model_copy(update={"min_target_agreement": None})
    trained = train_draft(run, off, str(other))
    assert trained.steps == 2 and trained.evals[0]["target_agreement"] < 0.5


def test_a_few_held_out_tokens_below_the_threshold_are_not_enough_to_stop_a_run():
    """Run on a tiny Qwen2 in bf16 (test_qwen25_profile): 18 of 24 response tokens agreed, random
    weights' near-ties flipped. 75% of 24 could be 85% within its noise; of 20,000 it could not."""
    from tasks.draft.trainer import check_target_agreement, wilson_upper

    assert 0.85 < wilson_upper(0.75, 24, 3.29) < 0.95
    check_target_agreement({"target_agreement": 0.75, "target_agreement_tokens": 24}, 0.85, True, "run")
    with pytest.raises(TrainError, match=r"75\.0% of the 20,000 response tokens .* \(at most 76\.\d% within"):
        check_target_agreement({"target_agreement": 0.75, "target_agreement_tokens": 20_000}, 0.85, True, "run")
    check_target_agreement({"target_agreement": 0.75, "target_agreement_tokens": 20_000}, 0.85, False, "run")  # sampled
    check_target_agreement({"target_agreement": 0.75, "target_agreement_tokens": 20_000}, None, True, "run")  # off


def test_target_agreement_counts_response_tokens_only():
    """Position p's argmax against the token at p+1 where that is a response token: prompt
    tokens and padding are not counted."""
    from tasks.draft.ttt import target_agreement

    lm_head = torch.eye(4)  # the argmax of a hidden state is its largest coordinate
    hidden = torch.eye(4)[[1, 2, 3, 0, 0]].unsqueeze(0)  # predicts 1, 2, 3, 0, 0 at positions 0..4
    input_ids = torch.tensor([[0, 1, 2, 0, 0]])  # the tokens at 1, 2 and 4 agree; at 3 not
    loss_mask = torch.tensor([[False, False, True, True, False]])  # responses at 2 and 3; 4 is padding
    assert target_agreement(hidden, lm_head, input_ids, loss_mask, chunk=1) == (1, 2)
    assert target_agreement(hidden, lm_head, input_ids, torch.ones(1, 5, dtype=torch.bool), chunk=3) == (3, 4)


def test_max_train_sequences_is_a_smaller_run_on_the_same_data(make_run):
    """train.max_train_sequences: the first N training sequences, the vocabulary counted over
    those alone, the held-out set unchanged; a resume with another N is refused."""
    from tasks.draft.data import DATA_META_KEY, build_index

    cfg, run = make_run("first48", max_steps=4, eval_every=100, save_every=2, max_train_sequences=48)
    result = train_draft(run, cfg.train, cfg.target.model_path)
    meta = run.read_json(DATA_META_KEY)
    assert meta["splits"]["train"] == 48
    assert result.steps == 4

    seen: list = []
    build_index(run, lambda seq: seen.append(seq) if seq.split == "train" else None, use_cache=False)
    assert len(seen) > 48  # the data holds more than the run trained on

    def vocab_of(seqs: list) -> torch.Tensor:
        counts = count_tokens([(s.input_ids, s.loss_mask) for s in seqs], VocabMap.load(run).vocab_size)
        return build_vocab_map(counts, cfg.train.draft_vocab_size).d2t

    assert torch.equal(VocabMap.load(run).d2t, vocab_of(seen[:48]))
    assert not torch.equal(vocab_of(seen[:48]), vocab_of(seen))  # so the count really was limited

    more = cfg.train.model_copy(update={"max_train_sequences": 60, "max_steps": 6})
    with pytest.raises(TrainError, match="trained on 48 training sequences, this run has 60"):
        train_draft(run, more, cfg.target.model_path)


def test_a_draft_continues_from_an_exported_one_and_a_resume_keeps_its_start(make_run, tiny_target_dir, tmp_path):
    """train.init_from: a shipped draft continued on the data. The continued draft's untrained
    evaluation is the shipped draft's last (the same weights on the same held-out set), its
    vocabulary map is the shipped one's, and it learns on from there; its checkpoints record the
    start, so a resume from another start is refused. A draft that does not fit (another
    intermediate size) is refused before any data is read, each difference named."""
    from tasks.config import ConfigError, check_input_paths, load_config
    from tasks.draft.export import export_sglang, read_exported
    from tasks.draft.starting_draft import StartingDraftError, tensors_sha256
    from tests.draft_support import params_for

    cfg, run = make_run("shipped", learning_rate=1e-2, max_steps=120, eval_every=120, save_every=120)
    shipped = train_draft(run, cfg.train, cfg.target.model_path)
    embed, _ = load_target_heads(cfg.target.model_path)
    final = export_sglang(ckpt.load_checkpoint_model(run.path(shipped.last_checkpoint), embed), tmp_path / "final",
                          dtype="float32")  # fmt: skip
    _, weights, _ = read_exported(final)

    cfg2, run2 = make_run("continued", max_steps=40, eval_every=20, save_every=20, init_from=str(final))
    continued = train_draft(run2, cfg2.train, cfg2.target.model_path)
    start, last = continued.evals[0], shipped.evals[-1]
    assert start["step"] == 0 and last["step"] == 120
    for key in ("sim_accept", "loss", "pooled_accept_len_3"):
        assert start[key] == pytest.approx(last[key], rel=1e-6), key
    assert start["sim_accept"] > 5 * max(shipped.evals[0]["sim_accept"], 0.005)  # far from a random start
    assert torch.equal(VocabMap.load(run2).d2t, VocabMap.load(run).d2t)
    assert continued.evals[-1]["loss"] < start["loss"]  # it learns on
    state = ckpt.read_trainer_state(run2, continued.last_checkpoint)
    assert state["recipe"]["init_from_sha256"] == tensors_sha256(weights)

    # A resume with another start (none: random weights) is neither run's continuation.
    cfg3 = cfg2.model_copy(update={"train": cfg2.train.model_copy(update={"init_from": None, "max_steps": 60})})
    with pytest.raises(TrainError, match=r"train\.init_from \(its weights' sha256\): checkpoint '[0-9a-f]{64}', this run None"):
        train_draft(run2, cfg3.train, cfg3.target.model_path)

    # Another intermediate size: refused at the start, before the data is indexed.
    cfg4, run4 = make_run("misfit", max_steps=4, intermediate_size=64, init_from=str(final))
    with pytest.raises(StartingDraftError, match="intermediate_size 128 where this run's is 64"):
        train_draft(run4, cfg4.train, cfg4.target.model_path)
    assert not run4.exists("train/vocab_map.safetensors")

    # Before the run: the folder must hold an exported draft of this draft vocabulary size.
    params = params_for(tmp_path / "preflight", tiny_target_dir)
    for given, message in ((tmp_path / "nowhere", "no exported draft folder at"),
                           (tmp_path, r"holds no exported draft \(no config.json or model.safetensors\)")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"train.init_from: .*{message}"):
            check_input_paths(load_config(params, [f"train.init_from={given}"]))
    with pytest.raises(ConfigError, match="has a draft vocabulary of 1024 tokens, this run's train.draft_vocab_size is 512"):
        check_input_paths(load_config(params, [f"train.init_from={final}", "train.draft_vocab_size=512"]))
    check_input_paths(load_config(params, [f"train.init_from={final}"]))
