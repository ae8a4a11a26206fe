"""`python -m sglang.launch_server` command lines for the pinned SGLang versions (DESIGN §5).

Flag facts, read from SGLang's server_args.py and EAGLE worker, and for 0.5.14 from its recorded
`--help` (tests/fixtures/sglang-0.5.14/help.txt, shipped as tasks/data/sglang/flags-0.5.14.json):
- speculative decoding: `--speculative-algorithm EAGLE3` (an EAGLE-3 draft under `EAGLE` skips
  its fc layer and accepts ~1 token, with no error), `--speculative-draft-model-path`,
  `--speculative-num-steps`, `--speculative-eagle-topk`, `--speculative-num-draft-tokens`: all
  three numbers or none. With topk=1 SGLang silently forces draft tokens = steps + 1; the
  builder refuses the mismatch (or, asked to, corrects it and says so) instead.
- CUDA graphs: 0.5.4 has `--cuda-graph-max-bs` and `--disable-cuda-graph`; 0.5.14 has
  `--cuda-graph-max-bs-decode`, `--disable-decode-cuda-graph` and `--disable-prefill-cuda-graph`
  (its `--cuda-graph-max-bs` and `--disable-cuda-graph` are deprecated aliases, never emitted and
  refused in extra args); 0.5.23 has `--cuda-graph-max-bs-decode` and
  `--disable-decode-cuda-graph` and rejects the old max-bs flag.
- server settings (`ServerSettings`): each is emitted only for a version known to have its flag.

Every flag the builder emits is checked against the version's known flags before a command is
returned; for a version with a recorded `--help` the extra server args are checked against it too.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from tasks.engines.sglang_flags import RecordedFlags, recorded_flags

SGLANG_MODULE = "sglang.launch_server"


class LaunchError(ValueError):
    """A launch that SGLang would refuse or silently change; the message names the flag."""


class ServerSettings(BaseModel):
    """Server-wide SGLang settings, applied alike to every launch built from them: the gate's
    baseline and speculative launches (`gate.server`), an operator's launch through
    `python -m tasks.gate.launch` / infra/sglang/launch_speculative.sh, and the generation server
    of infra/sglang/launch_target.sh. Unset (None / false) means SGLang's own default: nothing is
    emitted. A set field is emitted only for SGLang versions known to have its flag, and refused
    (naming the flag and the version) for the others.

    What the H200 node's SGLang 0.5.14 bundle needs (/work/shared/h200/README.md):
    attention_backend triton (no FA3 kernels; FA3 is Hopper's default), sampling_backend pytorch,
    grammar_backend none, skip_tokenizer_init, dtype bfloat16, disable_prefill_cuda_graph.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention_backend: str | None = Field(
        None, description="--attention-backend, e.g. triton (the H200 bundle has no FA3 kernels)."
    )
    sampling_backend: str | None = Field(
        None, description="--sampling-backend, e.g. pytorch (flashinfer's kernels are not needed)."
    )
    grammar_backend: str | None = Field(
        None, description="--grammar-backend, e.g. none (no constrained decoding is used)."
    )
    skip_tokenizer_init: bool = Field(
        False,
        description="--skip-tokenizer-init: the server loads no tokenizer; requests must send "
        "input_ids (ours do) and answers carry no \"text\".",
    )
    dtype: str | None = Field(None, description="--dtype, e.g. bfloat16.")
    disable_prefill_cuda_graph: bool = Field(
        False,
        description="--disable-prefill-cuda-graph: no prefill graph capture (36 s of a server's "
        "start-up on the H200); decode speed, what the gate measures, does not depend on it.",
    )
    sleep_on_idle: bool = Field(False, description="--sleep-on-idle: no busy polling while idle.")
    max_total_tokens: int | None = Field(None, ge=1, description="--max-total-tokens (KV pool size).")
    max_running_requests: int | None = Field(None, ge=1, description="--max-running-requests.")
    random_seed: int | None = Field(None, ge=0, description="--random-seed.")


# Each setting's SGLang flag (the flag is its field name, dashed; kept explicit so a rename of
# either side is a visible change).
SETTING_FLAGS: dict[str, str] = {
    "attention_backend": "--attention-backend",
    "sampling_backend": "--sampling-backend",
    "grammar_backend": "--grammar-backend",
    "skip_tokenizer_init": "--skip-tokenizer-init",
    "dtype": "--dtype",
    "disable_prefill_cuda_graph": "--disable-prefill-cuda-graph",
    "sleep_on_idle": "--sleep-on-idle",
    "max_total_tokens": "--max-total-tokens",
    "max_running_requests": "--max-running-requests",
    "random_seed": "--random-seed",
}

# What the builder itself emits, on every version.
_BUILDER_FLAGS = frozenset(
    {
        "--model-path", "--host", "--port", "--tp-size", "--mem-fraction-static",
        "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
        "--speculative-eagle-topk", "--speculative-num-draft-tokens",
    }
)  # fmt: skip
# Server-setting flags SGLang has had since well before 0.5.4 (server_args.py; --sleep-on-idle
# since mid-2025) and that 0.5.14's recorded --help still lists.
_LONG_STANDING_SETTINGS = frozenset(
    {
        "--attention-backend", "--sampling-backend", "--grammar-backend", "--skip-tokenizer-init",
        "--dtype", "--sleep-on-idle", "--max-total-tokens", "--max-running-requests", "--random-seed",
    }
)  # fmt: skip


@dataclass(frozen=True)
class FlagSet:
    version: str
    cuda_graph_max_bs: str
    # A launch without CUDA graphs (the graphs-off comparison): all of these.
    disable_cuda_graph: tuple[str, ...]
    # Flags this version does not take (argparse refuses them, or they belong to the other era).
    foreign: tuple[str, ...]
    # /server_info is the newer name; /get_server_info the older one. Tried in this order.
    server_info_paths: tuple[str, ...]
    # Every flag the builder may emit for this version: the recorded --help where there is one,
    # else the builder's own flags that the version's source has.
    known: frozenset[str]
    # The version's whole recorded --help (extra server args are checked against it), or None.
    recorded: RecordedFlags | None = None
    # Why a flag the builder could emit is missing from this version (said when it is refused).
    missing_notes: dict[str, str] = field(default_factory=dict)
    # The highest HTTP port the version starts on: 0.5.14 also opens a gRPC port at port + 10000
    # and refuses to start when that passes 65535 (seen on the H200: "SGLANG_GRPC_PORT (66049)
    # must be between 1 and 65535").
    max_port: int = 65535


def _recorded(version: str) -> RecordedFlags:
    found = recorded_flags(version)
    if found is None:  # the data file ships with the package; its absence is a broken install
        raise RuntimeError(f"tasks/data/sglang/flags-{version}.json is missing from the installed package")
    return found


_R0514 = _recorded("0.5.14")
GRPC_PORT_OFFSET = 10000  # 0.5.14's gRPC port: the HTTP port + this

FLAG_SETS: dict[str, FlagSet] = {
    "0.5.4": FlagSet(
        version="0.5.4",
        cuda_graph_max_bs="--cuda-graph-max-bs",
        disable_cuda_graph=("--disable-cuda-graph",),
        foreign=("--cuda-graph-max-bs-decode", "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph"),
        server_info_paths=("/get_server_info", "/server_info"),
        known=_BUILDER_FLAGS | _LONG_STANDING_SETTINGS | {"--cuda-graph-max-bs", "--disable-cuda-graph"},
        missing_notes={
            "--disable-prefill-cuda-graph": "0.5.4 captures prefill graphs only with "
            "--enable-piecewise-cuda-graph, which is off by default; leave the setting false",
        },
    ),
    "0.5.14": FlagSet(
        version="0.5.14",
        cuda_graph_max_bs="--cuda-graph-max-bs-decode",
        # --disable-cuda-graph is a deprecated alias here: the two per-phase flags replace it.
        disable_cuda_graph=("--disable-decode-cuda-graph", "--disable-prefill-cuda-graph"),
        foreign=(),  # the recorded --help decides (deprecated aliases are refused separately)
        server_info_paths=("/server_info", "/get_server_info"),
        known=_R0514.flags,
        recorded=_R0514,
        max_port=65535 - GRPC_PORT_OFFSET,
    ),
    "0.5.23": FlagSet(
        version="0.5.23",
        cuda_graph_max_bs="--cuda-graph-max-bs-decode",
        disable_cuda_graph=("--disable-decode-cuda-graph",),
        foreign=("--cuda-graph-max-bs",),
        server_info_paths=("/server_info", "/get_server_info"),
        # --disable-prefill-cuda-graph: the per-phase CUDA-graph flags 0.5.14 introduced (of which
        # 0.5.23's --disable-decode-cuda-graph is one); public 0.5.19+ launch recipes use it.
        known=_BUILDER_FLAGS | _LONG_STANDING_SETTINGS
        | {"--cuda-graph-max-bs-decode", "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph"},
        max_port=65535 - GRPC_PORT_OFFSET,  # assumed from 0.5.14: the gRPC port came with it
    ),
}
PINNED_VERSIONS = tuple(FLAG_SETS)

# Flags the builder owns: repeating one in extra args would silently override the gate's choice.
MANAGED_FLAGS = frozenset(
    {
        "--model-path", "--model", "--host", "--port", "--tp-size", "--tp", "--tensor-parallel-size",
        "--mem-fraction-static",
        "--speculative-algorithm", "--speculative-algo", "--speculative-draft-model-path",
        "--speculative-draft-model", "--speculative-num-steps", "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", "--disable-cuda-graph",
        "--disable-decode-cuda-graph",
        # 0.5.14's other ways of switching CUDA graphs on and off
        "--cuda-graph-config", "--cuda-graph-backend-decode", "--cuda-graph-backend-prefill",
        *SETTING_FLAGS.values(),
    }
)  # fmt: skip
_SETTING_OF_FLAG = {flag: name for name, flag in SETTING_FLAGS.items()}
# What the builder sets instead of a deprecated CUDA-graph alias.
_BUILDER_INSTEAD = {
    "--cuda-graph-max-bs": "the gate sets it from cuda_graph_max_bs",
    "--disable-cuda-graph": "the gate's graphs-off launch emits --disable-decode-cuda-graph "
    "--disable-prefill-cuda-graph",
}


def flag_set(version: str) -> FlagSet:
    """The flag set of a pinned version; "v0.5.4", "0.5.4.post1" and "0.5.4rc2" pin to 0.5.4."""
    m = re.fullmatch(r"v?(\d+\.\d+\.\d+)(?:(?:\.post|rc|\.dev)\d+)?", version.strip())
    found = FLAG_SETS.get(m.group(1)) if m else None
    if found is None:
        raise LaunchError(
            f"SGLang version {version!r} is not pinned; the launch builder knows {list(PINNED_VERSIONS)} "
            f"(CUDA-graph flags differ between versions, so an unknown one is not guessed)"
        )
    return found


def _check_choice(flag: str, value: str, flags: FlagSet, where: str) -> None:
    allowed = flags.recorded.choices.get(flag) if flags.recorded else None
    if allowed is not None and value not in allowed:
        raise LaunchError(f"{where}: {flag} {value!r} is not one of SGLang {flags.version}'s choices {list(allowed)}")


def settings_args(settings: ServerSettings, flags: FlagSet) -> list[str]:
    """The flags of the set server settings, in declaration order; refuses a setting whose flag
    this version does not have, and (where the --help is recorded) a value outside its choices."""
    args: list[str] = []
    for name, flag in SETTING_FLAGS.items():
        value = getattr(settings, name)
        if value is None or value is False:
            continue
        if flag not in flags.known:
            note = flags.missing_notes.get(flag)
            raise LaunchError(
                f"server setting {name}: SGLang {flags.version} has no {flag}"
                + (f" ({note})" if note else " (not a flag of that version as far as the repo knows)")
            )
        if value is True:
            args.append(flag)
        else:
            _check_choice(flag, str(value), flags, f"server setting {name}")
            args += [flag, str(value)]
    return args
@dataclass(frozen=True)
class SpecParams:
    draft_model_path: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    algorithm: str = "EAGLE3"

    @property
    def label(self) -> str:
        return f"{self.algorithm.lower()}-s{self.num_steps}-k{self.topk}-n{self.num_draft_tokens}"


def resolve_spec(
    draft_model_path: str,
    num_steps: int,
    topk: int,
    num_draft_tokens: int | None = None,
    *,
    algorithm: str = "EAGLE3",
    correct: bool = False,
) -> tuple[SpecParams, list[str]]:
    """Checked speculative parameters and notes on what was filled in or corrected.

    topk=1 with num_draft_tokens != num_steps + 1 is refused (SGLang would silently use
    steps + 1) unless `correct`, which corrects it and returns a note saying so.
    """
    if algorithm != "EAGLE3":
        raise LaunchError(
            f"--speculative-algorithm {algorithm!r}: the gate benchmarks EAGLE-3 drafts, which need "
            f"EAGLE3 (under EAGLE the draft's fc layer is skipped and acceptance stays at ~1.0)"
        )
    if not draft_model_path:
        raise LaunchError("--speculative-draft-model-path is empty")
    if num_steps < 1:
        raise LaunchError(f"--speculative-num-steps must be >= 1, got {num_steps}")
    if topk < 1:
        raise LaunchError(f"--speculative-eagle-topk must be >= 1, got {topk}")
    notes: list[str] = []
    chain = num_steps + 1
    if num_draft_tokens is None:
        if topk > 1:
            raise LaunchError(
                f"--speculative-num-draft-tokens must be set with --speculative-eagle-topk {topk} "
                f"(SGLang takes all three speculative numbers or none)"
            )
        num_draft_tokens = chain
        notes.append(f"num_draft_tokens set to num_steps + 1 = {chain} (topk=1 chain)")
    elif topk == 1 and num_draft_tokens != chain:
        if not correct:
            raise LaunchError(
                f"--speculative-eagle-topk 1 needs --speculative-num-draft-tokens = num_steps + 1 = "
                f"{chain}, got {num_draft_tokens}; SGLang would silently use {chain}"
            )
        notes.append(
            f"num_draft_tokens corrected from {num_draft_tokens} to num_steps + 1 = {chain}: with "
            f"topk=1 SGLang would have forced it silently"
        )
        num_draft_tokens = chain
    elif num_draft_tokens < 2:
        raise LaunchError(f"--speculative-num-draft-tokens must be >= 2, got {num_draft_tokens}")
    return SpecParams(draft_model_path, num_steps, topk, num_draft_tokens, algorithm), notes


@dataclass(frozen=True)
class LaunchSpec:
    """One server launch. `env` is applied on top of the launching process's environment.
    `disable_cuda_graph` is the graphs-off comparison (every CUDA graph the version can switch
    off); `server` holds the settings that every launch of a run shares."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp_size: int = 1
    spec: SpecParams | None = None
    cuda_graph_max_bs: int | None = 8
    disable_cuda_graph: bool = False
    mem_fraction_static: float | None = None
    server: ServerSettings = field(default_factory=ServerSettings)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def _flag_name(arg: str) -> str | None:
    return arg.split("=", 1)[0] if arg.startswith("--") else None


def check_extra_args(extra_args: tuple[str, ...] | list[str], flags: FlagSet) -> None:
    """Refuse extra server args that SGLang would refuse or that override the builder: flags of
    another version, deprecated aliases and (with a recorded --help) anything it does not list,
    values outside a flag's recorded choices, and flags the builder or a server setting owns."""
    args = list(extra_args)
    for i, arg in enumerate(args):
        name = _flag_name(arg)
        if name is None:
            continue
        recorded = flags.recorded
        if name in flags.foreign or (recorded is not None and name not in recorded.flags):
            where = " (not in its recorded --help)" if recorded is not None else ""
            raise LaunchError(f"extra server arg {name} is not an SGLang {flags.version} flag{where}")
        if recorded is not None and name in recorded.deprecated:
            instead = _BUILDER_INSTEAD.get(name)
            raise LaunchError(
                f"extra server arg {name} is a deprecated alias in SGLang {flags.version}: "
                f"{recorded.replacement(name)}" + (f" ({instead})" if instead else "")
            )
        if name in _SETTING_OF_FLAG:
            setting = _SETTING_OF_FLAG[name]
            raise LaunchError(
                f"extra server arg {name} is the server setting {setting}: set it there "
                f"(gate.server.{setting}, or {name} of python -m tasks.gate.launch), not in extra_server_args"
            )
        if name in MANAGED_FLAGS:
            raise LaunchError(
                f"extra server arg {name} is set by the gate itself (from the gate config); "
                f"remove it from extra_server_args"
            )
        value = arg.split("=", 1)[1] if "=" in arg else None
        if value is None and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        if value is not None:
            _check_choice(name, value, flags, "extra server arg")


def check_server_config(settings: ServerSettings, extra_args: tuple[str, ...] | list[str], version: str) -> FlagSet:
    """Everything about a run's launches that can be checked before one starts (the gate config
    calls this when it is loaded)."""
    flags = flag_set(version)
    settings_args(settings, flags)
    check_extra_args(extra_args, flags)
    return flags


def build_server_args(spec: LaunchSpec, version: str) -> list[str]:
    """The arguments after `python -m sglang.launch_server`."""
    flags = flag_set(version)
    if not spec.model_path:
        raise LaunchError("--model-path is empty")
    if not 0 < spec.port <= flags.max_port:
        why = "" if flags.max_port == 65535 else f" (SGLang {flags.version} also opens port + {GRPC_PORT_OFFSET} for gRPC)"
        raise LaunchError(f"--port must be 1..{flags.max_port}, got {spec.port}{why}")
    if spec.tp_size < 1:
        raise LaunchError(f"--tp-size must be >= 1, got {spec.tp_size}")
    check_extra_args(spec.extra_args, flags)
    args = ["--model-path", spec.model_path, "--host", spec.host, "--port", str(spec.port)]
    args += ["--tp-size", str(spec.tp_size)]
    if spec.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    args += settings_args(spec.server, flags)
    if spec.disable_cuda_graph:
        args += [f for f in flags.disable_cuda_graph if f not in args]
    elif spec.cuda_graph_max_bs is not None:
        args += [flags.cuda_graph_max_bs, str(spec.cuda_graph_max_bs)]
    if spec.spec is not None:
        s = spec.spec
        # Re-check: a SpecParams built by hand must obey the same rules as resolve_spec's.
        resolve_spec(s.draft_model_path, s.num_steps, s.topk, s.num_draft_tokens, algorithm=s.algorithm)
        args += [
            "--speculative-algorithm", s.algorithm,
            "--speculative-draft-model-path", s.draft_model_path,
            "--speculative-num-steps", str(s.num_steps),
            "--speculative-eagle-topk", str(s.topk),
            "--speculative-num-draft-tokens", str(s.num_draft_tokens),
        ]  # fmt: skip
    # The builder's own flags must be ones this version has (a wrong table entry fails here, in
    # a test, rather than in SGLang's argparse on a GPU node).
    unknown = [a for a in args if a.startswith("--") and a not in flags.known]
    if unknown:
        raise LaunchError(f"built flags {unknown} are not SGLang {flags.version} flags")
    aliases = [a for a in args if flags.recorded is not None and a in flags.recorded.deprecated]
    if aliases:
        raise LaunchError(f"built flags {aliases} are deprecated aliases in SGLang {flags.version}")
    return args + list(spec.extra_args)


def build_launch_command(spec: LaunchSpec, version: str, python: str = "python") -> list[str]:
    return [python, "-m", SGLANG_MODULE, *build_server_args(spec, version)]


# The command-line entry: what infra/sglang/launch_speculative.sh and launch_target.sh run, so an
# operator's launches and the gate's come from this one builder.
def _max_bs(value: str) -> int | None:
    if value == "default":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'default', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'default', got {value!r}")
    return n


def add_settings_arguments(p: argparse.ArgumentParser) -> None:
    """One option per ServerSettings field, named like its SGLang flag."""
    group = p.add_argument_group("server settings (gate.server in the params; unset: SGLang's default)")
    for name, info in ServerSettings.model_fields.items():
        flag = SETTING_FLAGS[name]
        if info.annotation is bool:
            group.add_argument(flag, dest=name, action="store_true", help=info.description)
        else:
            kind = int if name in ("max_total_tokens", "max_running_requests", "random_seed") else str
            group.add_argument(flag, dest=name, type=kind, default=None, help=info.description)


def _cli_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tasks.gate.launch",
        description="Print the `sglang.launch_server` command the gate builds, for an operator's "
        "launch (infra/sglang/launch_speculative.sh and launch_target.sh run it). Arguments after "
        "`--` are passed to SGLang unchanged (flags the builder owns are refused).",
    )
    p.add_argument("--model", help="HF model folder of the target (required)")
    p.add_argument("--draft", help="exported EAGLE3 draft folder (train/final or the promoted copy)")
    p.add_argument("--baseline", action="store_true", help="no speculation: the gate's baseline launch")
    p.add_argument("--sglang-version", default=PINNED_VERSIONS[-1], help=f"one of {list(PINNED_VERSIONS)} (default %(default)s)")
    p.add_argument("--num-steps", type=int, help="--speculative-num-steps (the gate's best; required with --draft)")
    p.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk (default 1)")
    p.add_argument("--num-draft-tokens", type=int, help="default num_steps + 1 when topk=1; required when topk > 1")
    p.add_argument("--correct-draft-tokens", action="store_true", help="with topk=1, correct a wrong --num-draft-tokens instead of refusing it")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--mem-fraction", type=float, default=0.88, help="--mem-fraction-static (default 0.88)")
    p.add_argument("--cuda-graph-max-bs", type=_max_bs, default=8,
                   help="decode CUDA-graph batch sizes up to N (default 8, the gate's); 'default': SGLang's own")  # fmt: skip
    p.add_argument("--disable-cuda-graph", action="store_true", help="no CUDA graphs (the graphs-off comparison)")
    p.add_argument("--python", default="python", help="interpreter that has sglang (default python)")
    p.add_argument("--lines", action="store_true", help="one argument per line (for scripts) instead of a shell-quoted line")
    add_settings_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = _cli_parser()
    # Unknown options first: a misspelt --model should be named as such, not as a missing one.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (SGLang flags go after --)")
    if not args.model:
        parser.error("--model is required")
    if args.baseline == bool(args.draft):
        parser.error("give exactly one of --draft PATH and --baseline")
    try:
        spec = None
        if args.draft:
            if args.num_steps is None:
                parser.error("--num-steps is required with --draft (use the gate's best config)")
            spec, notes = resolve_spec(
                args.draft, args.num_steps, args.topk, args.num_draft_tokens, correct=args.correct_draft_tokens
            )
            for note in notes:
                print(f"launch: {note}", file=sys.stderr)
        settings = ServerSettings(**{name: getattr(args, name) for name in ServerSettings.model_fields})
        launch = LaunchSpec(
            model_path=args.model, port=args.port, host=args.host, tp_size=args.tp, spec=spec,
            cuda_graph_max_bs=args.cuda_graph_max_bs, disable_cuda_graph=args.disable_cuda_graph,
            mem_fraction_static=args.mem_fraction, server=settings, extra_args=tuple(extra),
        )  # fmt: skip
        cmd = build_launch_command(launch, args.sglang_version, python=args.python)
    except LaunchError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # pydantic's ValidationError: a setting out of range
        print(f"launch: {e}", file=sys.stderr)
        return 2
    if args.lines:
        if any("\n" in a for a in cmd):
            print("launch: an argument contains a newline; use the shell-quoted form", file=sys.stderr)
            return 2
        print("\n".join(cmd))
    else:
        print(shlex.join(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
