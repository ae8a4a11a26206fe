"""An sglang-router URL as the one endpoint: `eaglescale serve-sglang --router` (a real process)
over two SGLang-compatible servers of the tiny target and one dead URL. Generation through it
commits every request exactly once, its slots follow the healthy workers behind it, and its
health comes from /readiness: /health stays 200 with every worker gone."""

from __future__ import annotations

import time

import httpx
import pytest

from tasks.config import EngineConfig, load_config
from tasks.engines.base import EngineUnavailable, GenerationRequest, SamplingParams
from tasks.engines.sglang_client import SGLangEngine
from tasks.generate.stage import GenerateStage
from tasks.runfolder import ShardStore
from tasks.standins.server import ServerProcess, start_server_thread
from tests.run_support import assert_exactly_once, discover_and_fingerprint, write_params
from tests.s3_support import free_port


def _until(predicate, what: str, limit_s: float = 60.0) -> None:
    deadline = time.time() + limit_s
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def test_generation_through_a_router_and_its_health(tmp_path, tiny_target_dir):
    backends = [start_server_thread(model_path=str(tiny_target_dir)) for _ in range(2)]
    dead = f"http://127.0.0.1:{free_port()}"
    router = ServerProcess(["--router", ",".join([b.url for b in backends] + [dead])])
    try:
        assert httpx.get(f"{router.url}/health").status_code == 200
        assert httpx.get(f"{router.url}/readiness").status_code == 200
        listing = httpx.get(f"{router.url}/workers").json()
        assert {w["url"]: w["is_healthy"] for w in listing["workers"]} == {
            backends[0].url: True,
            backends[1].url: True,
            dead: False,
        }

        params = write_params(
            tmp_path,
            tiny_target_dir,
            str(tmp_path / "run"),
            sampling={"max_new_tokens": 8},
            engine={
                "kind": "sglang",
                "endpoints": [router.url],
                "endpoint_kind": "router",
                "concurrency_per_server": 3,
                "request_timeout_s": 60,
            },
            generate={"shard_size": 20},
            discover={"total_prompts": 40},
        )
        cfg = load_config(params)
        run, tokenizer, fp_hash = discover_and_fingerprint(cfg)
        stage = GenerateStage(cfg, run, fp_hash, SGLangEngine(cfg.engine), tokenizer)
        outcomes = [stage.run_shard(s) for s in stage.prepare()]
        stage.finish()
        [health] = stage.engine.health()
        stage.engine.close()
        assert [o.status for o in outcomes] == ["committed", "committed"]
        rows, dead_letters = assert_exactly_once(run)
        assert (rows, dead_letters) == (40, 0)
        store = ShardStore(run, "generate")
        servers = {s for m in store.committed().values() for s in store.read_rows(m).column("server").to_pylist()}
        assert servers == {router.url}
        # One endpoint, two healthy workers behind it: twice the per-server slots.
        assert health.healthy and health.extra["workers"] == 2 and health.extra["limit"] == 6
        served = [httpx.get(f"{b.url}/_stats").json()["generate_requests"] for b in backends]
        assert min(served) > 0 and sum(served) >= 40, served

        # Every worker gone: the router still answers /health, but is not ready, and the
        # engine (which probes /readiness) refuses it instead of sending requests into it.
        for b in backends:
            b.stop()
        _until(lambda: httpx.get(f"{router.url}/readiness").status_code == 503, "readiness 503")
        assert httpx.get(f"{router.url}/health").status_code == 200
        assert httpx.post(f"{router.url}/generate", json={"input_ids": [1]}).status_code == 503
        engine = SGLangEngine(
            EngineConfig(
                kind="sglang",
                endpoints=[router.url],
                endpoint_kind="router",
                health_recheck_s=0.2,
            ),
            unavailable_after_s=0.5,
        )
        request = GenerationRequest("r" * 16, "p", 0, (1, 2, 3), SamplingParams(max_new_tokens=2))
        with pytest.raises(EngineUnavailable, match="readiness: HTTP 503"):
            engine.generate([request], lambda _o: None)
        engine.close()
    finally:
        router.stop()
        for b in backends:
            b.stop()
