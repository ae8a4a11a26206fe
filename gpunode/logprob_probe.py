"""Records what a real SGLang server answers to the gate's logprob requests, for the parsers'
tests (tests/fixtures/sglang-0.5.14/) and for the threshold's evidence: run on the H200 node
against the generation server of the SmolLM2 run (gpunode, plan "lossless").

    python3 -m gpunode.logprob_probe --url http://127.0.0.1:30000 --params P.yaml --out DIR

For a few held-out prompts of the run (rendered as the gate renders them), it sends
1. a greedy /generate of 24 tokens with return_logprob and top_logprobs_num 5 (the decode's own
   view of each token it chose): `gen-logprobs-decode-base.json`;
2. the gate's re-score of that output (tasks/gate/lossless.py `rescore_body`: prompt + output,
   logprob_start_len len(prompt) - 1, top_logprobs_num 5): `gen-logprobs-base.json`, the answer the
   gate parses (tests/test_sglang_recorded.py reads it exactly);
3. the same greedy request with frequency_penalty 1.0: `gen-frequency-penalty-base.json`.

Each answer is kept as the server sent it, parsed and written again (floats round-trip exactly),
with the request beside it under `request`; tests/fixtures/sglang-0.5.14/ holds them split into
the answer and `*.request.json`.
`probe.json` sums up: per prompt, the positions where the decode's token is not the re-score's
top token, and the largest |decode logprob - re-score logprob| of the same token (how far the
two kernel paths are apart on this target: what gate.near_tie_nats must cover), and over every
position the median, 99th percentile and largest.

Against a speculative server (`--tag eagle3`: the node's `verify-probe` plan launches one for
the run's draft as the gate does) the "decode" logprobs are those the verify forward computed
for the tokens it accepted, and the re-score is the same server's prefill: the spread between
the verify and prefill paths, at every position, which is what the lossless threshold must
cover (BENCHMARKS P12). The files are then named `*-eagle3.json` and `probe-eagle3.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _post(client: Any, url: str, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    r = client.post(url + "/generate", json=body)
    r.raise_for_status()
    return r.content, json.loads(r.content)


def _keep(out: Path, name: str, body: dict[str, Any], raw: bytes) -> None:
    (out / name).write_text(json.dumps({"request": body, "response": json.loads(raw)}, indent=1))


def probe(url: str, params: str, out: Path, n_prompts: int = 4, new_tokens: int = 24, k: int = 5,
          tag: str = "base") -> dict[str, Any]:  # fmt: skip
    import httpx

    from tasks.config import load_config
    from tasks.engines.sglang_wire import read_generate_reply
    from tasks.gate.lossless import evidence_from_sglang, path_deltas, rescore_body
    from tasks.gate.prompts import encoder_for_target, load_bench_prompts
    from tasks.runfolder import RunFolder

    cfg = load_config(params)
    prompts = load_bench_prompts(RunFolder(cfg.run_root, cfg.storage_options), n_prompts, cfg.gate.prompt_seed,
                                 encoder_for_target(cfg.target.model_path, cfg.target.chat_template))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"url": url, "prompts": []}
    every: list[float] = []
    with httpx.Client(timeout=120, trust_env=False) as client:
        for p in prompts:
            ids = list(p.input_ids)
            decode = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens},
                      "return_logprob": True, "top_logprobs_num": k}  # fmt: skip
            raw_decode, _ = _post(client, url, decode)
            reply = read_generate_reply(raw_decode)
            rescore = rescore_body(ids, list(reply.output_ids), k, f"probe-rescore-{p.index}")
            raw_rescore, _ = _post(client, url, rescore)
            penalized = {**decode, "sampling_params": {**decode["sampling_params"], "frequency_penalty": 1.0}}
            penalized.pop("return_logprob"), penalized.pop("top_logprobs_num")
            raw_pen, _ = _post(client, url, penalized)
            if p.index == 0:  # one of each as a fixture
                _keep(out, f"gen-logprobs-decode-{tag}.json", decode, raw_decode)
                _keep(out, f"gen-logprobs-{tag}.json", rescore, raw_rescore)
                _keep(out, f"gen-frequency-penalty-{tag}.json", penalized, raw_pen)
            evidence = evidence_from_sglang(read_generate_reply(raw_rescore).logprobs, ids, list(reply.output_ids), k)
            deltas = path_deltas(reply.logprobs.output_token if reply.logprobs else [], evidence)
            every += deltas
            summary["prompts"].append({
                "index": p.index, "domain": p.domain, "prompt_tokens": len(ids), "output_tokens": len(reply.output_ids),
                "decode_vs_rescore_argmax_flips": evidence.argmax_flips(),
                "max_abs_logprob_delta": max(deltas) if deltas else None,
                "penalized_output_differs_at": next((i for i, (a, b) in enumerate(
                    zip(reply.output_ids, read_generate_reply(raw_pen).output_ids, strict=False)) if a != b), None),
            })  # fmt: skip
    summary["deltas"] = delta_quantiles(every)
    (out / ("probe.json" if tag == "base" else f"probe-{tag}.json")).write_text(json.dumps(summary, indent=1))
    return summary


def delta_quantiles(deltas: list[float]) -> dict[str, Any]:
    """|decode - re-score| of every token compared: how many, and their median, 99th percentile
    and largest (nearest rank)."""
    if not deltas:
        return {"positions": 0}
    ranked = sorted(deltas)

    def at(q: float) -> float:
        return ranked[min(len(ranked) - 1, max(0, round(q * len(ranked)) - 1))]

    return {"positions": len(ranked), "p50": at(0.5), "p99": at(0.99), "max": ranked[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--params", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts, as the gate selects them")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--tag", default="base", help="the recorded files' suffix: base, or eagle3 for a speculative server")
    args = parser.parse_args()
    print(json.dumps(probe(args.url, args.params, Path(args.out), args.prompts, args.new_tokens, tag=args.tag), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
