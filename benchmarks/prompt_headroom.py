"""How many prompts the packaged datasets hold for the Qwen profile, one per conversation against
one per user turn (issue 28: "the data the curve says is needed" is set against this).

    .venv/bin/python benchmarks/prompt_headroom.py [--profile deployments/params/qwen25-coder.yaml]

Runs the real discover stage (`discover_prompts`, the profile's tokenizer and chat template, its
dedupe and 32 held out per domain) over the profile's sources three times: as the profile gives
them (ShareGPT `prompt_turns: first_user`, its max_prompt_tokens), with ShareGPT's
`prompt_turns: every_user`, and every_user again with the longest prompt the run's sequences
hold (extract.max_length less sampling.max_new_tokens). The domain quotas are lifted, so
`available` is every prompt the packages could give a run. Prints the funnel side by side and
writes benchmarks/results/prompt-headroom.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.config import DiscoverConfig, load_config  # noqa: E402
from tasks.discover import CountTokens, discover_prompts  # noqa: E402
from tasks.runfolder.shards import table_bytes  # noqa: E402
from tasks.target.tokenizer import count_prompt_tokens, load_tokenizer  # noqa: E402

RESULT = REPO / "benchmarks/results/prompt-headroom.json"


def _discover(base: DiscoverConfig, mode: str, max_prompt_tokens: int, count_tokens: CountTokens) -> dict[str, Any]:
    sources = [
        s.model_copy(update={"prompt_turns": mode}) if s.conversation_format == "sharegpt" else s
        for s in base.sources
    ]
    cfg = base.model_copy(update={"sources": sources, "domain_quotas": {}, "total_prompts": None,
                                  "max_prompt_tokens": max_prompt_tokens})  # fmt: skip
    started = time.perf_counter()
    result = discover_prompts(DiscoverConfig.model_validate(cfg.model_dump()), count_tokens)
    seconds = time.perf_counter() - started
    report = result.report
    tokens = result.manifest.column("n_tokens").to_pylist()
    return {
        "prompt_turns": mode,
        "max_prompt_tokens": max_prompt_tokens,
        "seconds": round(seconds, 1),
        "source_rows": {n: s["source_rows"] for n, s in report["sources"].items()},
        "funnel": report["totals"],
        "available_per_domain": {d: m["available"] for d, m in report["mixture"].items()},
        "available": result.manifest.num_rows,
        "holdout": result.holdout.num_rows,
        "prompt_tokens": sum(tokens),
        "mean_prompt_tokens": round(sum(tokens) / max(len(tokens), 1), 1),
        # What prompts/ weighs as the stage commits it (zstd parquet): it travels with the
        # regenerated shards between sessions (`node wait`'s generation.tar).
        "prompts_bytes": sum(len(table_bytes(t)) for t in result.tables().values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=str(REPO / "deployments/params/qwen25-coder.yaml"))
    args = parser.parse_args()
    cfg = load_config(args.profile)
    tokenizer = load_tokenizer(cfg.target.model_path, cfg.target.chat_template)
    count_tokens = count_prompt_tokens(tokenizer)
    cap = cfg.discover.max_prompt_tokens
    longest = cfg.extract.max_length - cfg.sampling.max_new_tokens
    runs = {
        "first_user": ("first_user", cap),
        "every_user": ("every_user", cap),
        f"every_user, cap {longest}": ("every_user", longest),
    }
    results = {name: _discover(cfg.discover, *run, count_tokens) for name, run in runs.items()}
    columns = list(results.values())
    domains = sorted({d for r in columns for d in r["available_per_domain"]})
    print(f"profile {Path(args.profile).name}: {cfg.discover.holdout_per_domain} held out per "
          f"domain, quotas lifted; ratios against the first column")  # fmt: skip
    print(f"{'':30}" + "".join(f"{name:>24}" for name in results))
    print(f"{'max_prompt_tokens':30}" + "".join(f"{r['max_prompt_tokens']:>24}" for r in columns))
    rows = [
        ("sharegpt rows read", lambda r: r["source_rows"]["sharegpt"]),
        ("prompts given (funnel rows)", lambda r: r["funnel"]["rows_read"]),
        *((f"  {k}", lambda r, k=k: r["funnel"][k])
          for k in ("malformed", "duplicates_exact", "too_long", "contaminated", "duplicates_normalized")),  # fmt: skip
        *((f"available: {d}", lambda r, d=d: r["available_per_domain"].get(d, 0)) for d in domains),
        ("available prompts", lambda r: r["available"]),
        ("their prompt tokens", lambda r: r["prompt_tokens"]),
        ("mean prompt tokens", lambda r: r["mean_prompt_tokens"]),
        ("prompts/ tables (bytes)", lambda r: r["prompts_bytes"]),
        ("discovery seconds (2 cores)", lambda r: r["seconds"]),
    ]
    for name, value in rows:
        first = value(columns[0])
        cells = []
        for r in columns:
            v = value(r)
            ratio = f" ({v / first:.2f}x)" if r is not columns[0] and first else ""
            cells.append(f"{v:,}{ratio}" if isinstance(v, int) else f"{v}{ratio}")
        print(f"{name:30}" + "".join(f"{c:>24}" for c in cells))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"profile": Path(args.profile).name, **results}, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
