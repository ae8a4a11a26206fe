"""The local speculative engine on the tiny target: its static forwards are transformers' and
the draft's, it is lossless against greedy decoding (untrained and trained drafts), and its
measured acceptance equals offline replay's on the same prompts."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tasks.draft import checkpoint as ckpt
from tasks.draft.architecture import DraftConfig
from tasks.draft.export import export_sglang
from tasks.draft.model import Eagle3Draft
from tasks.draft.trainer import train_draft
from tasks.engines.base import GenerationRequest, SamplingParams
from tasks.engines.local_decode import BatchDecoder
from tasks.extract.local_capture import LocalCapture
from tasks.extract.storage import iter_extracted
from tasks.gate.replay import replay, replay_run
from tasks.gate.spec_engine import SpecEngine
from tasks.gate.spec_engine_graphs import StaticDraft, StaticTarget
from tasks.gate.spec_engine_measure import measure_step_costs
from tasks.runfolder import RunFolder
from tests.draft_support import MAX_NEW_TOKENS, extracted_run

STEPS = (1, 2, 3, 5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Small ops on 2 shared cores: OpenMP spin-waits make 2 threads many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), local_files_only=True).eval()
    config = json.loads((tiny_target_dir / "config.json").read_text())
    return model, config


def untrained_draft(model, config) -> Eagle3Draft:
    torch.manual_seed(0)
    cfg = DraftConfig.from_target(config, 1024, 128)
    return Eagle3Draft(cfg, model.get_input_embeddings().weight.detach()).eval()


def random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (n,), generator=g).tolist()
    return [torch.randint(10, 2048, (m,), generator=g).tolist() for m in lengths]


def captured(model, aux_ids, prompts, outputs) -> list[SimpleNamespace]:
    """Prompt + output sequences with full-forward states: what extraction would store."""
    cap = LocalCapture(model, aux_ids, batch_size=8)
    seqs = [p + o for p, o in zip(prompts, outputs, strict=True)]
    states = cap.capture(seqs)
    return [
        SimpleNamespace(
            sequence_id=str(i), domain=("even", "odd")[i % 2], input_ids=torch.tensor(s),
            loss_mask=torch.tensor([False] * len(p) + [True] * (len(s) - len(p))),
            aux_hidden=st.aux,
        )  # fmt: skip
        for i, (p, s, st) in enumerate(zip(prompts, seqs, states, strict=True))
    ]


def test_static_forwards_are_transformers_and_the_drafts(target):
    model, config = target
    ids = random_prompts(1, 5)[0] + random_prompts(1, 6)[0]
    static = StaticTarget(model, [1, 3, 4], max_len=128)
    with torch.inference_mode():
        # Prefill 10 tokens, then the rest in pieces of 3 and 1, as decoding feeds them.
        logits, aux = [], []
        for lo, hi in [(0, 10), (10, 13), *[(i, i + 1) for i in range(13, len(ids))]]:
            lg, ax = static.forward(torch.tensor(ids[lo:hi]), torch.arange(lo, hi))
            logits.append(lg)
            aux.append(ax)
        ref = model(torch.tensor([ids])).logits[0]
        full = LocalCapture(model, [1, 3, 4]).capture([ids])[0]
    torch.testing.assert_close(torch.cat(logits), ref, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(aux), full.aux, atol=2e-4, rtol=1e-4)

    draft = untrained_draft(model, config)
    sdraft = StaticDraft(draft, max_len=128)
    cache = draft.new_cache()
    hidden = torch.randn(len(ids), 3 * 64)
    with torch.inference_mode():
        a_logits, a_hidden = sdraft.forward(torch.tensor(ids[:12]), hidden[:12], torch.arange(12))
        b = draft.step(torch.tensor([ids[:12]]), hidden[None, :12], torch.arange(12)[None], cache)
        torch.testing.assert_close(a_logits, b.logits[0])
        # One rollout step on top (H-wide hidden), then a rollback and a different step.
        a2, _ = sdraft.forward(torch.tensor([7]), a_hidden[-1:], torch.tensor([12]))
        b2 = draft.step(torch.tensor([[7]]), b.hidden[:, -1:], torch.tensor([[12]]), cache)
        torch.testing.assert_close(a2, b2.logits[0])
        cache.truncate(12)
        a3, _ = sdraft.forward(torch.tensor([9]), a_hidden[-1:], torch.tensor([12]))
        b3 = draft.step(torch.tensor([[9]]), b.hidden[:, -1:], torch.tensor([[12]]), cache)
        torch.testing.assert_close(a3, b3.logits[0])


def test_baseline_is_the_local_engines_greedy_decoding(target):
    model, config = target
    eos = config["eos_token_id"]
    prompts = random_prompts(12, 1)
    engine = SpecEngine(model, None, eos_ids={eos}, max_len=128)
    ours = [engine.greedy(p, 40) for p in prompts]
    decoder = BatchDecoder(model, pad_id=0, eos_ids=frozenset({eos}))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = [
        decoder.decode([GenerationRequest(f"{i:012x}", "p", 0, tuple(p), greedy)])[0]
        for i, p in enumerate(prompts)
    ]
    assert [r.output_ids for r in ours] == [r.output_ids for r in ref]
    assert [r.finish_reason for r in ours] == [r.finish_reason for r in ref]
    assert {r.finish_reason for r in ours} == {"stop", "length"}  # both endings exercised
    assert all(r.verify_steps == 0 and r.accept_length is None for r in ours)


def test_the_local_gate_gives_the_lossless_rule_the_re_score_sglang_gives(target):
    """tasks.gate.local_benchmark.rescore: the target's own distribution at each position of a
    reference output, the fields SGLang's re-score fills, judged by the same rule."""
    from tasks.gate.local_benchmark import rescore
    from tasks.gate.lossless import NEAR_TIE, NOT_LOSSLESS, classify

    model, _ = target
    prompt = random_prompts(1, 11)[0]
    reference = SpecEngine(model, None, max_len=128).greedy(prompt, 12).output_ids
    evidence = rescore(model, prompt, reference, 4)
    with torch.inference_mode():
        logprobs = model(torch.tensor([prompt + reference])).logits[0, len(prompt) - 1 :].float().log_softmax(-1)
    assert len(evidence.positions) == len(reference) + 1 and evidence.k == 4
    for j, view in enumerate(evidence.positions):
        best = logprobs[j].topk(4)
        assert [t for t, _ in view.top] == best.indices.tolist()
        assert [lp for _, lp in view.top] == pytest.approx(best.values.tolist(), abs=1e-5)
        if j < len(reference):
            assert view.token == reference[j] and view.logprob == pytest.approx(float(logprobs[j, reference[j]]), abs=1e-5)
    assert evidence.positions[-1].token is None and evidence.argmax_flips() == 0  # float32: decode is the argmax
    # A speculative output that emits the runner-up at position 3, judged on this evidence.
    (_, top1), (second, top2) = evidence.positions[3].top[:2]
    output = reference[:3] + [second]
    near = classify(reference, output, None, None, evidence, top1 - top2 + 0.01)
    assert near is not None and (near.cls, near.position, near.speculative_token) == (NEAR_TIE, 3, second)
    assert near.gap == pytest.approx(top1 - top2) and near.baseline_logprob == pytest.approx(top1)
    assert classify(reference, output, None, None, evidence, top1 - top2 - 0.01).cls == NOT_LOSSLESS


def test_untrained_draft_is_lossless_and_matches_replay(target):
    model, config = target
    eos = config["eos_token_id"]
    draft = untrained_draft(model, config)
    engine = SpecEngine(model, draft, eos_ids={eos}, max_len=128)
    prompts = random_prompts(40, 2)
    base = [engine.greedy(p, 32) for p in prompts]
    seqs = captured(model, draft.config.aux_layer_ids, prompts, [b.output_ids for b in base])
    offline = replay(draft, seqs, STEPS, n_bootstrap=200)
    for k in STEPS:
        spec = [engine.speculate(p, 32, k) for p in prompts]
        assert [s.output_ids for s in spec] == [b.output_ids for b in base], f"num_steps={k}"
        assert [s.finish_reason for s in spec] == [b.finish_reason for b in base]
        assert [s.emitted for s in spec] == [r.emitted[k] for r in offline.sequences]
        measured = sum(s.decode_tokens for s in spec) / sum(s.verify_steps for s in spec)
        assert offline.overall[k]["accept_length"] == pytest.approx(measured, abs=1e-12)
        # A random draft gets no draft accepted: every cycle emits the target's token alone,
        # so this test checks rejection and rollback only (the trained one below, acceptance).
        assert {e for s in spec for e in s.emitted} == {1} and measured == 1.0


def test_engine_refuses_what_it_cannot_run(target):
    model, config = target
    engine = SpecEngine(model, None, max_len=64)
    with pytest.raises(ValueError, match="exceeds the engine's max_len 64"):
        engine.greedy(list(range(10, 60)), 20)
    with pytest.raises(ValueError, match="no draft"):
        engine.speculate([5, 6], 4, 2)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA target"):
        SpecEngine(model, None, use_cuda_graphs=True)
    draft = untrained_draft(model, config)
    costs = measure_step_costs(SpecEngine(model, draft, max_len=64), [1, 2], iters=2, position=8)
    assert set(costs) == {"baseline_step_s", "verify_s", "draft_cycle_s", "source", "cuda_graphs", "device"}
    assert set(costs["verify_s"]) == {"2", "3"} and set(costs["draft_cycle_s"]) == {"1", "2"}
    assert costs["cuda_graphs"] is False and all(v > 0 for v in costs["verify_s"].values())


# The draft is overfit on the first OVERFIT training sequences (the trainer's
# max_train_sequences) and tested on their prompts: it then accepts most drafts (accept length
# >= 2 at num_steps 3), so multi-token acceptance and partial rejections (rollbacks) are both
# exercised many times, where a draft that generalises poorly from tiny data accepts ~1.
OVERFIT = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path):
    """A draft overfit by the real trainer on the tiny target's extracted greedy data,
    exported in SGLang's format, and the run it came from."""
    base = tmp_path_factory.getbasetemp()
    dest = tmp_path_factory.mktemp("spec_trained")
    cfg, _ = extracted_run(base, tiny_target_dir, dest, learning_rate=1e-2, max_steps=300,
                           eval_every=300, save_every=1000)  # fmt: skip
    run = RunFolder(cfg.run_root)
    result = train_draft(run, cfg.train, cfg.target.model_path, max_train_sequences=OVERFIT)
    draft = ckpt.load_checkpoint_model(run.path(result.last_checkpoint))
    export_dir = export_sglang(draft, dest / "export")
    return run, export_dir, result


def test_trained_draft_is_lossless_and_matches_replay(trained, tiny_target_dir: Path):
    run, export_dir, result = trained
    engine = SpecEngine.from_pretrained(str(tiny_target_dir), str(export_dir), max_len=512)
    train_seqs = list(itertools.islice(iter_extracted(run, "train"), OVERFIT))
    prompts = [s.input_ids[: int(s.loss_mask.long().argmax())].tolist() for s in train_seqs]
    assert len(prompts) == OVERFIT
    base = [engine.greedy(p, MAX_NEW_TOKENS) for p in prompts]
    seqs = captured(engine.model, engine.draft.config.aux_layer_ids, prompts, [b.output_ids for b in base])
    offline = replay(engine.draft, seqs, (1, 3), n_bootstrap=200)
    spec = {}
    for k in (1, 3):
        spec[k] = [engine.speculate(p, MAX_NEW_TOKENS, k) for p in prompts]
        assert [s.output_ids for s in spec[k]] == [b.output_ids for b in base], f"num_steps={k}"
        # fp32 on one CPU: the incremental and the full forward agree to ~1e-6, and no draft
        # argmax sits that close to a tie here, so the cycles match one for one.
        assert [s.emitted for s in spec[k]] == [r.emitted[k] for r in offline.sequences]
        measured = sum(s.decode_tokens for s in spec[k]) / sum(s.verify_steps for s in spec[k])
        assert offline.overall[k]["accept_length"] == pytest.approx(measured, abs=1e-12)
    # Lossless where it is hard to be: most cycles accept several drafts, and many reject some.
    assert offline.overall[3]["accept_length"] >= 2.0
    cycles = [e for s in spec[3] for e in s.emitted]
    assert sum(e >= 3 for e in cycles) >= 50  # two or three drafts accepted (+ the bonus token)
    assert 4 in cycles  # every draft accepted
    assert sum(e < 4 for e in cycles) >= 50  # a draft rejected: the caches roll back

    # Replay on the run's own stored sequences (extracted from the generate stage's batched
    # greedy outputs, terminator appended where the length limit cut the reply) lands close.
    stored = replay_run(run, engine.draft, (1, 3), split="train", limit=OVERFIT, n_bootstrap=200)
    assert stored.overall[3]["sequences"] == OVERFIT
    assert stored.overall[3]["accept_length"] == pytest.approx(offline.overall[3]["accept_length"], abs=0.03)
    assert set(stored.per_domain) == {s.domain for s in train_seqs}
