"""One engine per process and configuration, shared by every shard task of the process."""

from __future__ import annotations

import threading

from tasks.config import EagleScaleConfig
from tasks.engines.base import Engine

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def _key(cfg: EagleScaleConfig) -> str:
    return cfg.engine.model_dump_json() + cfg.target.model_dump_json()


def get_engine(cfg: EagleScaleConfig) -> Engine:
    with _lock:
        key = _key(cfg)
        if key not in _engines:
            _engines[key] = _build(cfg)
        return _engines[key]


def _build(cfg: EagleScaleConfig) -> Engine:
    if cfg.engine.kind == "local":
        from tasks.engines.local import LocalEngine

        return LocalEngine(
            cfg.target.model_path,
            device=cfg.engine.device,
            dtype=cfg.engine.dtype,
            batch_size=cfg.engine.batch_size,
            chat_template=cfg.target.chat_template,
        )
    if not cfg.engine.endpoints:
        raise ValueError("engine.endpoints: the sglang engine needs at least one server URL")
    from tasks.engines.sglang_client import SGLangEngine

    return SGLangEngine(cfg.engine)


def close_engines() -> None:
    with _lock:
        for engine in _engines.values():
            engine.close()
        _engines.clear()
