"""The node's single-purpose steps, each run by the pipeline as its own process (`python3 -m
gpunode node STEP`) on the bundle's site folder, where tasks/ and its configuration load: the
plain batched reference request, the server's outputs against transformers', the replays, the
scaling drafts, the gate's launch plan (gate_plan.py) and the verify path's logprob probe. Each
reads NODE/params.yaml (the profile as the pipeline wrote it for this run)."""

from __future__ import annotations

import json
import time
from typing import Any

from gpunode import node_env
from gpunode.node_env import read_json
from gpunode.plans import RECIPE_ROOT


def _config() -> Any:
    from tasks.config import load_config

    return load_config(node_env.NODE / "params.yaml")


def node_reference(n: int = 2048) -> int:
    """One plain batched /generate over the run's first prompts, rendered and sampled as the
    generate stage sends them: the rate generation is set beside (reference.json)."""
    from tasks.discover.commit import read_prompts_table
    from tasks.runfolder import RunFolder
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    cfg = _config()
    tok = load_tokenizer(cfg.target.model_path, cfg.target.chat_template)
    table = read_prompts_table(RunFolder(cfg.run_root), "manifest").sort_by("prompt_id")
    prompts = [render_prompt_ids(tok, json.loads(m)) for m in table.column("messages").to_pylist()[:n]]
    sampling = {"temperature": 0.0, "max_new_tokens": cfg.sampling.max_new_tokens}
    return _plain_batch({"input_ids": prompts, "sampling_params": sampling}, "reference", f"http://127.0.0.1:{node_env.PORT}")


def node_synthesis_reference(url: str, n: int = 2048) -> int:
    """One plain batched /generate of the synthesis' own shape on the generation server at `url`,
    its first `n` slots (the target's pre-query prompt, the source's sampling, each slot's seed)
    before the discover stage writes them: the rate the synthesis is set beside
    (synthesis-reference.json)."""
    from tasks.runfolder import RunFolder
    from tasks.synthesize.stage import SynthesisStage
    from tasks.target.tokenizer import load_tokenizer

    cfg = _config()
    stage = SynthesisStage(cfg, RunFolder(cfg.run_root), load_tokenizer(cfg.target.model_path, cfg.target.chat_template))
    try:
        requests = stage.first_requests(n)
    finally:
        stage.close()
    body = {"input_ids": [list(r.input_ids) for r in requests], "sampling_params": [r.sglang_sampling() for r in requests]}
    return _plain_batch(body, "synthesis-reference", url)


def _plain_batch(body: dict[str, Any], name: str, url: str) -> int:
    """`body` as one /generate on the generation server at `url`, timed; NODE/<name>.json says
    how fast (its keys prefixed <name>_), and the cache is flushed after it: the stage starts cold."""
    import httpx

    with httpx.Client(timeout=1800, trust_env=False) as client:
        began = time.perf_counter()
        r = client.post(url + "/generate", json=body)
        seconds = time.perf_counter() - began
        r.raise_for_status()
        answers = r.json()
        client.post(url + "/flush_cache", timeout=60).raise_for_status()
    tokens = sum(a["meta_info"]["completion_tokens"] for a in answers)
    key = name.replace("-", "_")
    result = {f"{key}_prompts": len(body["input_ids"]), f"{key}_completion_tokens": tokens,
              f"{key}_seconds": seconds, f"{key}_tok_s": tokens / seconds}  # fmt: skip
    (node_env.NODE / f"{name}.json").write_text(json.dumps(result))
    print(result)
    return 0


def node_agreement(n: int = 32, new_tokens: int = 64) -> int:
    """The server's greedy outputs (the committed rows) against transformers' greedy decoding
    of the same converted target, bf16 on the GPU: the target SGLang serves is the one
    extraction and training read."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.discover.commit import read_prompts_table
    from tasks.runfolder import RunFolder, ShardStore
    from tasks.target.model_dir import resolve_model_dir
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    cfg = _config()
    run = RunFolder(cfg.run_root)
    store = ShardStore(run, "generate")
    marker = sorted(store.committed().items())[0][1]
    rows = store.read_rows(marker).to_pylist()[:n]
    msgs = {r["prompt_id"]: json.loads(r["messages"]) for r in read_prompts_table(run, "manifest").to_pylist()}
    tok = load_tokenizer(cfg.target.model_path)
    device = "cpu" if node_env.REHEARSAL else "cuda"
    dtype = torch.float32 if node_env.REHEARSAL else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(cfg.target.model_path), dtype=dtype).to(device)
    eos = {int(tok.eos_token_id)}
    same, first = 0, []
    for row in rows:
        ids = render_prompt_ids(tok, msgs[row["prompt_id"]])
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens, do_sample=False)
        # Whether a reply carries its stop token differs between the two: compare without it.
        hf = [t for t in out[0, len(ids):].tolist() if t not in eos]
        sg = [t for t in list(row["output_ids"])[:new_tokens] if t not in eos]
        if row["finish_reason"] == "length":  # the server stopped at max_new_tokens: compare that far
            hf = hf[: len(sg)]
        n = min(len(hf), len(sg))
        k = next((i for i in range(n) if hf[i] != sg[i]), None)
        if k is None and len(hf) == len(sg):
            same += 1
        else:
            first.append(k if k is not None else n)
    result = {"agreement_prompts": len(rows), "agreement_tokens": new_tokens, "agreement_identical": same,
              "agreement_first_divergence": first}  # fmt: skip
    measures = read_json(node_env.NODE / "measurements.json") or {}
    (node_env.NODE / "measurements.json").write_text(json.dumps({**measures, **result}, indent=1))
    print(result)
    return 0


def node_replay() -> int:
    """The offline and the online draft over the same held-out sequences (the gate's replay:
    gate.replay_sequences, on gate.device, at gate.num_steps), into replay-compare.json."""
    from tasks.config import load_config
    from tasks.draft.target_heads import load_target_heads
    from tasks.gate.stage import materialize_draft, replay_draft
    from tasks.runfolder import RunFolder

    out: dict[str, Any] = {}
    for name, root in (("offline", node_env.NODE / "run"), ("online", node_env.NODE / "run-online")):
        cfg = load_config(node_env.NODE / "params.yaml", [f"run_root={root}", *node_env.EXTRA_SETS])
        run = RunFolder(cfg.run_root)
        embed, _ = load_target_heads(cfg.target.model_path)
        began = time.perf_counter()
        result = replay_draft(run, cfg, embed, materialize_draft(run, node_env.NODE / f"replay-{name}"), cfg.gate.num_steps)
        out[name] = {**result.to_dict(), "seconds": time.perf_counter() - began}
    (node_env.NODE / "replay-compare.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: v["overall"] for k, v in out.items()}, default=str))
    return 0


def node_recipe_replay() -> int:
    """The recipe plan's drafts that have exported (NODE/recipe-*/train/final, and SpecForge's),
    each replayed over the same held-out sequences: the default variant's run root's, its states
    captured once by the target (online, on gate.device), at gate.num_steps, with the gate's
    bootstrap settings. Into recipe-replay.json, each draft's figures with its per-sequence
    tokens and verify cycles (for a bootstrap of the difference paired by sequence), written
    after each draft; a draft already there is not replayed again."""
    import torch

    from tasks.config import load_config
    from tasks.draft.online import OnlineTarget, online_sequences
    from tasks.draft.target_heads import load_target_heads
    from tasks.gate.replay import replay_run
    from tasks.gate.stage import load_draft
    from tasks.runfolder import RunFolder

    path = node_env.NODE / "recipe-replay.json"
    out: dict[str, Any] = read_json(path) or {}
    drafts = {p.parents[1].name.removeprefix(RECIPE_ROOT): p for p in sorted(node_env.NODE.glob(f"{RECIPE_ROOT}*/train/final"))}
    drafts["specforge"] = node_env.NODE / "specforge/draft"
    todo = {n: p for n, p in drafts.items() if n not in out and (p / "config.json").is_file()}
    if not todo:
        return 0
    cfg = load_config(node_env.NODE / "params.yaml", [f"run_root={node_env.NODE / (RECIPE_ROOT + 'default')}"])
    gate, run = cfg.gate, RunFolder(cfg.run_root)
    began = time.perf_counter()
    sequences = list(online_sequences(run, OnlineTarget.of(cfg), torch.device(gate.device), "eval", gate.replay_sequences))
    capture_s = time.perf_counter() - began
    embed, _ = load_target_heads(cfg.target.model_path)
    for name, folder in todo.items():
        began = time.perf_counter()
        result = replay_run(run, load_draft(embed, folder, gate.device), gate.num_steps, limit=gate.replay_sequences,
                            sequences=sequences, n_bootstrap=gate.n_bootstrap, seed=gate.bootstrap_seed,
                            ci_level=gate.ci_level)  # fmt: skip
        per_sequence = {str(k): {"sequence_id": [r.sequence_id for r in result.sequences],
                                 "tokens": [r.tokens(k) for r in result.sequences],
                                 "cycles": [r.cycles(k) for r in result.sequences]} for k in result.num_steps}  # fmt: skip
        out[name] = {**result.to_dict(), "draft": str(folder), "seconds": time.perf_counter() - began,
                     "capture_s": capture_s, "per_sequence": per_sequence}  # fmt: skip
        path.write_text(json.dumps(out, indent=1, default=str))
        print(json.dumps({name: out[name]["overall"]}, default=str), flush=True)
    return 0


def node_scaling(fractions: str | None) -> int:
    """The scaling drafts of these fractions (comma-separated; default: all of the profile's),
    as the train stage trains them (tasks/train/stage.py). The index it writes lists only these;
    the train stage after it writes the whole one."""
    from tasks.train.stage import train_scaling

    train_scaling(_config(), [float(f) for f in fractions.split(",")] if fractions else None)
    return 0


def node_verify_probe() -> int:
    """The "verify-probe" plan's measurement: one speculative server for the run's carried draft,
    launched as the gate launches num_steps 3 at topk 1, and gpunode/logprob_probe.py
    against it on the gate's held-out prompts at its length (gate.num_prompts,
    gate.max_new_tokens): the verify path's logprobs of the tokens it accepted beside the same
    server's prefill re-score of them, into NODE/recorded/*-eagle3.json."""
    import httpx

    from gpunode.logprob_probe import probe
    from tasks.gate.benchmark import launch_spec, server_launcher
    from tasks.gate.plan import plan_configs
    from tasks.sglang.server_process import PortPool, launch, wait_healthy
    from tasks.target.model_dir import resolve_model_dir

    cfg = _config()
    gate = cfg.gate
    draft = str(node_env.NODE / "run/train/final")
    config = next(c for c in plan_configs(gate, draft) if c.spec is not None and (c.spec.num_steps, c.spec.topk) == (3, 1))
    launcher = server_launcher(gate, "emulated" if node_env.REHEARSAL else "sglang")
    model_dir = str(resolve_model_dir(cfg.target.model_path, cfg.target.revision))
    server = launch(launcher, launch_spec(gate, model_dir, config, PortPool(gate.host)),
                    node_env.NODE / "logs" / "verify-probe-server.log")  # fmt: skip
    try:
        with httpx.Client(timeout=60, trust_env=False) as client:
            ready_s = wait_healthy(server, client, gate.health_timeout_s, gate.health_poll_s)
        began = time.perf_counter()
        summary = probe(server.url, str(node_env.NODE / "params.yaml"), node_env.NODE / "recorded", gate.num_prompts,
                        gate.max_new_tokens, tag="eagle3")  # fmt: skip
    finally:
        server.stop()
    print(json.dumps({"config": config.name, "ready_s": ready_s, "probe_s": time.perf_counter() - began,
                      "deltas": summary["deltas"]}))  # fmt: skip
    return 0
