"""What eaglescale knows of each pinned SGLang version's launch interface (docs/DESIGN.md §7): the
flag table, the flag of each server setting, and the checks a config can run before anything
starts. Below the command builder (tasks/sglang/command.py), the configuration (whose gate
section runs the checks when it is loaded) and the emulator, which all read it; it imports
nothing of theirs.

Flag facts, read from SGLang's server_args.py and EAGLE worker, and for 0.5.14 from its recorded
`--help` (tests/fixtures/sglang-0.5.14/help.txt, shipped as tasks/data/sglang/flags-0.5.14.json):
- CUDA graphs: 0.5.4 has `--cuda-graph-max-bs` and `--disable-cuda-graph`; 0.5.14 has
  `--cuda-graph-max-bs-decode`, `--disable-decode-cuda-graph` and `--disable-prefill-cuda-graph`
  (its `--cuda-graph-max-bs` and `--disable-cuda-graph` are deprecated aliases, never emitted and
  refused in extra args); 0.5.23 has `--cuda-graph-max-bs-decode` and
  `--disable-decode-cuda-graph` and rejects the old max-bs flag.
- server settings (`ServerSettings`, tasks/sglang/server_settings.py, the `gate.server` section): each
  is emitted only for a version known to have its flag.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from tasks.errors import ExpectedFailure
from tasks.sglang.recorded_flags import RecordedFlags, recorded_flags


class LaunchError(ValueError, ExpectedFailure):
    """A launch that SGLang would refuse or silently change; the message names the flag."""


# Each server setting's SGLang flag (the flag is the setting's name, dashed; kept explicit so a rename of
# either side is a visible change).
SETTING_FLAGS: dict[str, str] = {
    "attention_backend": "--attention-backend",
    "sampling_backend": "--sampling-backend",
    "grammar_backend": "--grammar-backend",
    "skip_tokenizer_init": "--skip-tokenizer-init",
    "dtype": "--dtype",
    "disable_prefill_cuda_graph": "--disable-prefill-cuda-graph",
    "sleep_on_idle": "--sleep-on-idle",
    "disable_radix_cache": "--disable-radix-cache",
    "max_total_tokens": "--max-total-tokens",
    "max_running_requests": "--max-running-requests",
    "random_seed": "--random-seed",
}

# What the builder itself emits, on every version.
_BUILDER_FLAGS = frozenset(
    {
        "--model-path", "--host", "--port", "--nccl-port", "--tp-size", "--mem-fraction-static",
        "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
        "--speculative-eagle-topk", "--speculative-num-draft-tokens",
    }
)  # fmt: skip
# Server-setting flags SGLang has had since well before 0.5.4 (server_args.py; --sleep-on-idle
# since mid-2025) and that 0.5.14's recorded --help still lists.
_LONG_STANDING_SETTINGS = frozenset(
    {
        "--attention-backend", "--sampling-backend", "--grammar-backend", "--skip-tokenizer-init",
        "--dtype", "--sleep-on-idle", "--disable-radix-cache", "--max-total-tokens", "--max-running-requests",
        "--random-seed",
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
        # --speculative-adaptive(-config): 0.5.14's adaptive speculation, kept in later releases.
        known=_BUILDER_FLAGS | _LONG_STANDING_SETTINGS
        | {"--cuda-graph-max-bs-decode", "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph",
           "--speculative-adaptive", "--speculative-adaptive-config"},
        max_port=65535 - GRPC_PORT_OFFSET,  # assumed from 0.5.14: the gRPC port came with it
    ),
}
PINNED_VERSIONS = tuple(FLAG_SETS)

# Flags the builder owns: repeating one in extra args would silently override the gate's choice.
MANAGED_FLAGS = frozenset(
    {
        "--model-path", "--model", "--host", "--port", "--nccl-port", "--tp-size", "--tp", "--tensor-parallel-size",
        "--mem-fraction-static",
        "--speculative-algorithm", "--speculative-algo", "--speculative-draft-model-path",
        "--speculative-draft-model", "--speculative-num-steps", "--speculative-eagle-topk",
        "--speculative-num-draft-tokens", "--speculative-adaptive", "--speculative-adaptive-config",
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


# The server settings reach this module as a mapping of setting name (a SETTING_FLAGS key) to
# value, e.g. `ServerSettings.model_dump()` (tasks/sglang/server_settings.py): the flag table
# stays free of pydantic, and the emulator passes the values it parsed from a command line.
SettingValues = Mapping[str, object]


def settings_args(settings: SettingValues, flags: FlagSet) -> list[str]:
    """The flags of the set server settings, in SETTING_FLAGS order; refuses a setting whose flag
    this version does not have, and (where the --help is recorded) a value outside its choices."""
    unknown = sorted(set(settings) - set(SETTING_FLAGS))
    if unknown:
        raise LaunchError(f"server settings {unknown} have no SGLang flag here (SETTING_FLAGS)")
    args: list[str] = []
    for name, flag in SETTING_FLAGS.items():
        value = settings.get(name)
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
                f"(gate.server.{setting}, or {name} of python -m tasks.sglang.command), not in extra_server_args"
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


def check_server_config(settings: SettingValues, extra_args: tuple[str, ...] | list[str], version: str) -> FlagSet:
    """Everything about a run's launches that can be checked before one starts (the gate config
    calls this when it is loaded)."""
    flags = flag_set(version)
    settings_args(settings, flags)
    check_extra_args(extra_args, flags)
    return flags
