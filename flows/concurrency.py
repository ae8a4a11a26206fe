"""Prefect global concurrency limits around stage work: one run of a stage per run root, and a
shared pool of GPU slots.

The run folder's exclusive markers already keep two writers from committing one shard twice;
the run-root lock keeps two runs from doing the same work side by side (and from competing for
the same servers), and says so by name instead of letting them race.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from tasks.config import EagleScaleConfig
from tasks.errors import ExpectedFailure

# A holder that dies without releasing (kill -9) keeps its slot until the lease lapses; the
# live holder renews it every 0.75 x this.
LEASE_S = 60.0
# Long enough for a crashed holder's lease to lapse, so a resume right after a crash waits for
# it instead of failing; a second live run fails after this with RunRootBusy.
RUN_ROOT_WAIT_S = 2 * LEASE_S


class RunRootBusy(RuntimeError, ExpectedFailure):
    """Another run holds this stage of this run root."""


class GpuLimitError(RuntimeError, ExpectedFailure):
    """The configured GPU limit is missing or smaller than one request."""


def canonical_run_root(run_root: str) -> str:
    """One spelling per run folder: local paths absolute, no trailing slash."""
    root = run_root.rstrip("/") or "/"
    return root if "://" in root else os.path.abspath(os.path.expanduser(root))


def run_root_limit_name(run_root: str, stage: str) -> str:
    digest = hashlib.sha256(canonical_run_root(run_root).encode()).hexdigest()[:16]
    return f"eaglescale-{stage}-{digest}"


def _ensure_limit(name: str, limit: int) -> None:
    # Read first: a create that conflicts makes the server log a traceback (on the ephemeral
    # API, into this process's output). Two first-time creators racing still end with one.
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return
        except ObjectNotFound:
            pass
        with suppress(ObjectAlreadyExists):
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))


@contextmanager
def run_root_lock(
    config: EagleScaleConfig, stage: str, timeout_s: float | None = RUN_ROOT_WAIT_S, slots: int = 1
) -> Iterator[str]:
    """Hold one of the `slots` of `stage` on this run root while the block runs (the limit is
    created with that many when missing); yields the limit's name. Raises RunRootBusy, naming
    the run root, when other holders keep them past timeout_s."""
    name = run_root_limit_name(config.run_root, stage)
    _ensure_limit(name, slots)
    acquired = False
    try:
        with concurrency(name, occupy=1, timeout_seconds=timeout_s, strict=True, lease_duration=LEASE_S):
            acquired = True
            yield name
    except TimeoutError as e:
        if acquired:
            raise
        raise RunRootBusy(
            f"{stage} on run root {config.run_root} is held by another run (Prefect global "
            f"concurrency limit {name!r}); waited {timeout_s:g} s. A crashed holder's slot frees "
            f"within {LEASE_S:g} s; `prefect gcl inspect {name}` shows it."
        ) from e


@contextmanager
def gpu_slots(config: EagleScaleConfig, n: int, timeout_s: float | None = None) -> Iterator[None]:
    """Occupy n slots of `orchestration.gpu_concurrency_limit` while the block runs (waiting for
    them, by default without bound); a no-op when no limit is configured or n is 0 (CPU work).
    The limit is the cluster's GPU count and is created by the operator, so a missing one is an
    error."""
    name = config.orchestration.gpu_concurrency_limit
    if name is None or n == 0:
        yield
        return
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            raise GpuLimitError(
                f"GPU concurrency limit {name!r} (orchestration.gpu_concurrency_limit) does not exist; "
                f"create it with `prefect gcl create {name} --limit <number of GPUs>`"
            ) from None
    if n > limit:
        raise GpuLimitError(f"a stage asks for {n} GPU slots but limit {name!r} has only {limit}")
    with concurrency(name, occupy=n, timeout_seconds=timeout_s, strict=True, lease_duration=LEASE_S):
        yield


def gpus_needed(config: EagleScaleConfig, stage: str) -> int:
    """GPU slots a stage occupies: 0 when it runs on the CPU or talks to servers elsewhere."""
    if stage == "extract":
        return 1 if config.extract.device.startswith("cuda") else 0
    if stage == "train":
        return config.train.nproc if config.train.device.startswith("cuda") else 0
    if stage == "gate":
        gate = config.gate
        if gate.engine == "local":
            return 1 if gate.device.startswith("cuda") else 0
        return gate.tp_size if gate.engine == "sglang" else 0
    raise ValueError(f"no GPU placement for stage {stage!r}")
