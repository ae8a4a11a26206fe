"""The online trainer's set-up before its first step, on a real run folder: what grows with the
data, before and after, side by side in one process and asserted equal: the prompts' token ids
(one tokenizer call a prompt, against a shard's prompts in one call), the draft vocabulary's count
(a bincount a sequence, against one), and what the held-out batches kept between evaluations weigh
(float32, against the compute dtype). BENCHMARKS.md, P25:

    git show 4a45641d7fb9962f30f8dbe5de1b1a8131b4c836:benchmarks/results/real-run-node/run-21/generation.tar > /tmp/grown.tar
    mkdir -p /tmp/grown && tar -xf /tmp/grown.tar -C /tmp/grown
    PYTHONPATH=.eaglescale/h200/target-site .venv/bin/python benchmarks/online_index_pass.py \\
        --run /tmp/grown/run --profile deployments/params/qwen25-coder.yaml

(the tokenizer is read from Qwen2.5-Coder's package parts `python -m gpunode prepare` installs;
no weights are loaded.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.config import load_config  # noqa: E402
from tasks.draft.data import DataIndex, SeqRef, plan_epoch  # noqa: E402
from tasks.draft.online import OnlineTarget  # noqa: E402
from tasks.draft.vocab import count_tokens  # noqa: E402
from tasks.extract.backends import target_layout  # noqa: E402
from tasks.extract.capture import aux_capture_layers  # noqa: E402
from tasks.extract.sequences import SequenceBuilder  # noqa: E402
from tasks.runfolder import RunFolder, ShardStore  # noqa: E402
from tasks.target.tokenizer import load_tokenizer  # noqa: E402


def count_one_by_one(seqs: list[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """count_tokens as it was: one vocabulary-sized bincount added per sequence."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in seqs:
        ids = input_ids[loss_mask].to(torch.int64)
        if ids.numel():
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="a run folder with prompts/ and committed generate/ shards")
    parser.add_argument("--profile", required=True, help="the run's params (its target and extract settings)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the trainer's rank 0 indexes in its main thread
    cfg = load_config(args.profile, [])
    target = OnlineTarget.of(cfg)
    run = RunFolder(args.run)
    tok = load_tokenizer(target.model_path, target.chat_template, revision=target.revision)
    layout = target_layout(target.model_path, target.revision)
    gen = ShardStore(run, "generate")
    markers = dict(sorted(gen.committed().items()))

    def index_pass(one_by_one: bool) -> tuple[float, dict[str, list]]:
        builder = SequenceBuilder(run, tok, target.max_length, layout.vocab_size, target.eval_fraction, target.seed,
                                  target.holdout_unit)  # fmt: skip
        if one_by_one:  # the prompts rendered one call each, before build() asks for them
            builder._render_all = lambda prompt_ids: [builder._prompt_ids(p) for p in prompt_ids]  # type: ignore[method-assign]
        began = time.perf_counter()
        built = {sid: builder.build(gen.read_rows(m)).sequences for sid, m in markers.items()}
        return time.perf_counter() - began, built

    one_s, one = index_pass(one_by_one=True)
    many_s, many = index_pass(one_by_one=False)
    assert {s: [q.input_ids for q in v] for s, v in one.items()} == {s: [q.input_ids for q in v] for s, v in many.items()}
    seqs = [q for v in many.values() for q in v]

    train = [(torch.tensor(q.input_ids), torch.tensor(q.loss_mask, dtype=torch.bool)) for q in seqs if q.split == "train"]
    began = time.perf_counter()
    before = count_one_by_one(train, layout.vocab_size)
    count_before_s = time.perf_counter() - began
    began = time.perf_counter()
    after = count_tokens(train, layout.vocab_size)
    count_after_s = time.perf_counter() - began
    assert torch.equal(before, after)

    refs = [SeqRef(sid, 0, i, len(q.input_ids), q.split) for sid, v in many.items() for i, q in enumerate(v)]
    index = DataIndex(markers, refs)
    batches = plan_epoch(index, "eval", 0, cfg.train.seed, cfg.train.batch_tokens, shuffle=False)  # the trainer's
    padded = sum(len(b) * max(r.length for r in b) for b in batches)
    width = (len(aux_capture_layers(layout.model_type, layout.num_layers)) + 1) * layout.hidden_size
    compute = 2 if cfg.train.compute_dtype == "bfloat16" else 4
    held_out = sum(1 for r in refs if r.split == "eval")
    out = {"sequences": len(seqs), "training_sequences": len(train), "held_out_sequences": held_out,
           "render_one_call_each_s": one_s, "render_one_call_per_shard_s": many_s,
           "count_per_sequence_s": count_before_s, "count_once_s": count_after_s,
           "eval_padded_tokens": padded, "eval_cache_float32_gib": padded * width * 4 / 2**30,
           "eval_cache_compute_dtype_gib": padded * width * compute / 2**30}  # fmt: skip
    print(f"{args.run}: {len(seqs)} sequences in {len(markers)} shards, {len(train)} for training, {held_out} held out")
    print(f"  index pass (read, render, build), one tokenizer call a prompt:  {one_s:6.1f} s")
    print(f"  index pass, a shard's prompts in one call (now):               {many_s:6.1f} s   (same ids)")
    print(f"  vocabulary count, a bincount a sequence:                       {count_before_s:6.1f} s")
    print(f"  vocabulary count, one bincount (now):                          {count_after_s:6.1f} s   (same counts)")
    print(f"  held-out batches kept between evaluations: {padded:,} padded tokens, "
          f"{out['eval_cache_float32_gib']:.1f} GiB in float32, {out['eval_cache_compute_dtype_gib']:.1f} GiB in "
          f"{cfg.train.compute_dtype} (now)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
