"""`eaglescale`: run the DAG, read a run folder's status, build the tiny target, serve SGLang."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import Any

from tasks.errors import ExpectedFailure  # imports nothing: the CLI starts as fast

EXIT_FAILED, EXIT_CONFIG = 1, 2


def is_expected(exc: BaseException) -> bool:
    """Whether `exc` is a failure the user fixes from its message: an `ExpectedFailure`
    (tasks/errors.py), or a stop signal. Anything else is a bug or an unforeseen condition,
    and keeps its traceback. Generation's summary of failed shards is expected when every
    shard failed that way; so is a write the run root refuses (read-only, full: the message
    names it), whatever OSError carries it."""
    from flows.stopping import is_stop
    from tasks.generate.failures import GenerateFailed
    from tasks.runfolder import unwritable

    if is_stop(exc):  # a signal: one line says so and how to resume
        return True
    if isinstance(exc, GenerateFailed):
        causes = list(exc.causes.values())
        return bool(causes) and all(isinstance(c, BaseException) and is_expected(c) for c in causes)
    return isinstance(exc, ExpectedFailure) or unwritable(exc)


class _NoTracebackWhenExpected(logging.Filter):
    """Prefect logs every failed task and flow run with its traceback: for an expected failure
    keep the log line (it names the exception) and drop the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and is_expected(exc):
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_expected_tracebacks() -> None:
    quiet = _NoTracebackWhenExpected()
    for name in ("prefect", "prefect.flow_runs", "prefect.task_runs", "prefect.flow_engine", "prefect.task_engine"):
        logger = logging.getLogger(name)
        if quiet not in logger.filters:
            logger.addFilter(quiet)


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglescale run", description="Run the data-scaling DAG.")
    parser.add_argument("--params", required=True, help="params YAML (deployments/params/*.yaml)")
    parser.add_argument("--run-root", help="override run_root (local path or s3://bucket/prefix)")
    parser.add_argument("--stages", help="comma-separated subset, e.g. discover,generate,extract,train")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the plan (stages, shards, servers, disk forecast) and start nothing",
    )  # fmt: skip
    return parser


def _run(argv: list[str]) -> int:
    args = _run_parser().parse_args(argv)

    from tasks.config import ConfigError, check_input_paths, load_config
    from tasks.runfolder import RunRootUnwritable, check_writable

    overrides = list(args.overrides)
    if args.stages:
        overrides.append(f"stages=[{args.stages}]")
    # Everything a user can get wrong in the params is refused here, in about a second, and
    # not ~20 s later from inside a flow run after Prefect's start-up.
    try:
        config = load_config(args.params, overrides, run_root=args.run_root)
        check_input_paths(config)
    except ConfigError as e:
        print(f"eaglescale: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.dry_run:  # before anything of Prefect is imported or started
        from tasks.dryrun import plan_run, render_plan

        print(render_plan(plan_run(config)))
        return 0
    try:  # a read-only or full run root is named now, not after Prefect's start and retries
        check_writable(config.run_root, config.storage_options)
    except RunRootUnwritable as e:
        print(f"eaglescale: RunRootUnwritable: {e}", file=sys.stderr)
        return EXIT_FAILED
    from tasks.runlog import quiet_terminal

    quiet_terminal()  # before transformers is imported: no weight-loading progress bars
    resume = ["eaglescale", "run", "--params", args.params, "--run-root", config.run_root]
    resume += (["--stages", args.stages] if args.stages else []) + [f"--set={o}" for o in args.overrides]
    return _run_stoppable(config, resume)


def _run_stoppable(config: Any, resume: list[str]) -> int:
    """Run the flow (on a temporary Prefect API unless PREFECT_API_URL names one). From here a
    signal stops the run cleanly: within seconds, leases released, children gone, one line
    naming the `resume` command (flows/stopping.py)."""
    from flows import stopping

    previous_handlers = stopping.install()
    api, temporary_url = None, None
    try:
        if not os.environ.get("PREFECT_API_URL"):
            from flows import temporary_api

            # Prefect's own default is 20 s; a loaded 2-core box (or a GPU node starting a dozen
            # SGLang servers) can need more, and then the whole run fails at once.
            timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or 120)
            try:
                api = temporary_api.start(timeout, meanwhile=_import_before_prefect)
            except temporary_api.TemporaryApiError as e:
                print(f"eaglescale: {e}", file=sys.stderr)
                return EXIT_FAILED
            # Set before Prefect is imported: its settings are read once, at import.
            os.environ["PREFECT_API_URL"] = temporary_url = api.url
            print(
                f"eaglescale: PREFECT_API_URL is not set; a temporary Prefect API at {api.url} "
                "serves this run and stops with it",
                file=sys.stderr,
            )
        return _run_flow(config)
    except BaseException as e:
        if (signum := stopping.stop_signal(e)) is None:
            raise
        if api is not None:
            api.stop()
            api = None
        # What a stage started and its unwinding did not end (a trainer, a server): the run is
        # over. Only on a stop: a caller running `main` in-process keeps its own children.
        stopping.end_children()
        print(stopping.stopped_message(signum, resume), file=sys.stderr)
        return stopping.exit_code(signum)
    finally:
        if api is not None:
            api.stop()
        if temporary_url is not None and os.environ.get("PREFECT_API_URL") == temporary_url:
            os.environ.pop("PREFECT_API_URL", None)  # it named the temporary API, now gone
        stopping.restore(previous_handlers)


def _import_before_prefect() -> None:
    """What every run imports and Prefect's settings do not wait for: transformers and torch,
    through the target's tokenizer (~8 s of the run's ~13 s of imports on a 2-core box), taken
    while the temporary API starts in its own process. Prefect itself is imported after, once
    PREFECT_API_URL names that API."""
    import tasks.target.tokenizer  # noqa: F401


def _run_flow(config: Any) -> int:
    from flows.data_scaling import data_scaling
    from flows.stopping import is_stop
    from tasks.config import ConfigError
    from tasks.engines.factory import close_engines

    _quiet_expected_tracebacks()
    from tasks.runlog import FILE_ONLY, run_log

    with run_log(config.run_root) as log_path:
        try:
            data_scaling(config)
        except Exception as e:  # the flow run's state and logs hold the details
            if is_stop(e):  # a failure a signal caused: the stop is what to report
                raise
            logging.getLogger("eaglescale").error("run failed", exc_info=e, extra={FILE_ONLY: True})
            if is_expected(e):
                print(f"eaglescale: {type(e).__name__}: {e}\n(log: {log_path})", file=sys.stderr)
                return EXIT_CONFIG if isinstance(e, ConfigError) else EXIT_FAILED
            traceback.print_exception(e)
            print(f"eaglescale: run failed: {type(e).__name__}: {e}\n(log: {log_path})", file=sys.stderr)
            return EXIT_FAILED
        finally:
            close_engines()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "run": "run the data-scaling DAG (ephemeral Prefect API unless PREFECT_API_URL is set)",
        "status": "show a run folder's progress (reads only the run folder)",
        "verify": "check every file a run folder vouches for (sizes, sha256s), naming the fix",
        "export-data": "write a run's regenerated dataset as JSONL conversations (SpecForge, speculators)",
        "tiny-target": "build the tiny local target model",
        "export": "export a draft checkpoint (SGLang EAGLE3 or vLLM speculators format)",
        "promote": "promote a run's exported draft to the registry by hand (recorded as such, with the reason)",
        "serving-policy": "print the promoted draft's serving policy: SGLang flags, adaptive config, vLLM schedule",
        "serve-sglang": "serve a model or a simulator over SGLang's HTTP endpoints",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: eaglescale COMMAND [ARGS]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:<15} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        return _run(rest)
    if command == "status":
        from tasks.status.command import status_main

        return status_main(rest)
    if command == "verify":
        from tasks.runfolder.verify import verify_main

        return verify_main(rest)
    if command == "export-data":
        from tasks.generate.dataset_export import export_data_main

        return export_data_main(rest)
    if command == "export":
        from tasks.draft.export import export_main

        return export_main(rest)
    if command == "promote":
        from tasks.gate.promote_by_hand import promote_main

        return promote_main(rest)
    if command == "serving-policy":
        from tasks.gate.serving_policy import serving_policy_main

        return serving_policy_main(rest)
    if command == "tiny-target":
        from tasks.target.tiny import tiny_target_main

        return tiny_target_main(rest)
    from tasks.standins.server import serve_main

    return serve_main(rest)


if __name__ == "__main__":
    sys.exit(main())
