"""`eaglescale`: run the DAG, read a run folder's status, build the tiny target, serve SGLang."""

from __future__ import annotations

import argparse
import os
import sys


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="eaglescale run", description="Run the data-scaling DAG.")
    parser.add_argument("--params", required=True, help="params YAML (deployments/params/*.yaml)")
    parser.add_argument("--run-root", help="override run_root (local path or s3://bucket/prefix)")
    parser.add_argument("--stages", help="comma-separated subset, e.g. discover,generate,extract,train")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    from tasks.config import ConfigError, check_input_paths, load_config

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
        return 2
    if not os.environ.get("PREFECT_API_URL"):
        print("eaglescale: PREFECT_API_URL is not set; using Prefect's ephemeral API", file=sys.stderr)
    from flows.data_scaling import data_scaling
    from tasks.engines.factory import close_engines

    try:
        data_scaling(config)
    except Exception as e:  # the flow run's state and logs hold the details
        print(f"eaglescale: run failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        close_engines()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "run": "run the data-scaling DAG (ephemeral Prefect API unless PREFECT_API_URL is set)",
        "status": "show a run folder's progress (reads only the run folder)",
        "tiny-target": "build the tiny local target model",
        "export": "export a draft checkpoint (SGLang EAGLE3 or vLLM speculators format)",
        "serve-sglang": "serve a model or a simulator over SGLang's HTTP endpoints",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: eaglescale COMMAND [ARGS]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:<13} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        return _run(rest)
    if command == "status":
        from tasks.status import status_main

        return status_main(rest)
    if command == "export":
        from tasks.draft.export import export_main

        return export_main(rest)
    if command == "tiny-target":
        from tasks.tiny_target import tiny_target_main

        return tiny_target_main(rest)
    from tasks.engines.sglang_server import serve_main

    return serve_main(rest)


if __name__ == "__main__":
    sys.exit(main())
