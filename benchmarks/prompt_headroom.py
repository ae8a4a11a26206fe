"""How many prompts the packaged datasets hold for the Qwen profile, one per conversation against
one per user turn (issue 28: "the data the curve says is needed" is set against this).

    .venv/bin/python benchmarks/prompt_headroom.py [--profile deployments/params/qwen25-coder.yaml]

Runs the real discover stage (`discover_prompts`, the profile's tokenizer and chat template, its
length cap, dedupe and 32 held out per domain) over the profile's sources twice: as the profile
gives them (ShareGPT `prompt_turns: first_user`) and with ShareGPT's `prompt_turns: every_user`.
The domain quotas are lifted, so `available` is every prompt the packages could give a run.
Prints the funnel side by side and writes benchmarks/results/prompt-headroom.json.
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
from tasks.discover import discover_prompts  # noqa: E402
from tasks.target.tokenizer import count_prompt_tokens, load_tokenizer  # noqa: E402

RESULT = REPO / "benchmarks/results/prompt-headroom.json"
MODES = ("first_user", "every_user")


def _discover(base: DiscoverConfig, mode: str, count_tokens: Any) -> dict[str, Any]:
    sources = [
        s.model_copy(update={"prompt_turns": mode}) if s.conversation_format == "sharegpt" else s
        for s in base.sources
    ]
    cfg = base.model_copy(update={"sources": sources, "domain_quotas": {}, "total_prompts": None})
    started = time.perf_counter()
    result = discover_prompts(DiscoverConfig.model_validate(cfg.model_dump()), count_tokens)
    seconds = time.perf_counter() - started
    report = result.report
    tokens = result.manifest.column("n_tokens").to_pylist()
    return {
        "seconds": round(seconds, 1),
        "source_rows": {n: s["source_rows"] for n, s in report["sources"].items()},
        "funnel": report["totals"],
        "available_per_domain": {d: m["available"] for d, m in report["mixture"].items()},
        "available": result.manifest.num_rows,
        "holdout": result.holdout.num_rows,
        "prompt_tokens": sum(tokens),
        "mean_prompt_tokens": round(sum(tokens) / max(len(tokens), 1), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=str(REPO / "deployments/params/qwen25-coder.yaml"))
    args = parser.parse_args()
    cfg = load_config(args.profile)
    tokenizer = load_tokenizer(cfg.target.model_path, cfg.target.chat_template)
    count_tokens = count_prompt_tokens(tokenizer)
    results = {mode: _discover(cfg.discover, mode, count_tokens) for mode in MODES}
    first, every = (results[m] for m in MODES)
    domains = sorted(set(first["available_per_domain"]) | set(every["available_per_domain"]))
    print(f"profile {Path(args.profile).name}: max_prompt_tokens {cfg.discover.max_prompt_tokens}, "
          f"{cfg.discover.holdout_per_domain} held out per domain, quotas lifted")  # fmt: skip
    print(f"{'':34}{'first_user':>14}{'every_user':>14}{'ratio':>8}")
    rows = [
        ("sharegpt rows read", *(r["source_rows"]["sharegpt"] for r in (first, every))),
        ("prompts given (funnel rows)", first["funnel"]["rows_read"], every["funnel"]["rows_read"]),
        *((f"  {k}", first["funnel"][k], every["funnel"][k])
          for k in ("malformed", "duplicates_exact", "too_long", "contaminated", "duplicates_normalized")),  # fmt: skip
        *((f"available: {d}", first["available_per_domain"].get(d, 0),
           every["available_per_domain"].get(d, 0)) for d in domains),  # fmt: skip
        ("available prompts", first["available"], every["available"]),
        ("their prompt tokens", first["prompt_tokens"], every["prompt_tokens"]),
        ("mean prompt tokens", first["mean_prompt_tokens"], every["mean_prompt_tokens"]),
        ("discovery seconds (2 cores)", first["seconds"], every["seconds"]),
    ]
    for name, a, b in rows:
        ratio = f"{b / a:.2f}x" if a else ""
        print(f"{name:34}{a:>14,}{b:>14,}{ratio:>8}" if isinstance(a, int) else
              f"{name:34}{a:>14}{b:>14}{ratio:>8}")  # fmt: skip
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"profile": Path(args.profile).name, **results}, indent=2) + "\n")
    print(f"wrote {RESULT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
