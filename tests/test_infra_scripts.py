"""infra/: every script's --help and argument handling, and what can be checked of the image
recipes and the compose file without docker (pins, extras, entrypoints, settings names)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tasks.sglang.command import LaunchSpec, build_launch_command, resolve_spec
from tasks.sglang.server_settings import ServerSettings
from tasks.sglang.versions import PINNED_VERSIONS, SETTING_FLAGS
from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parents[1]
SGLANG = ROOT / "infra/sglang"
LAUNCH = SGLANG / "launch_target.sh"
SPECULATIVE = SGLANG / "launch_speculative.sh"
DOCKER = ROOT / "infra/docker"
COMPOSE = ROOT / "infra/compose/docker-compose.yaml"
SEED_NCCL = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS"}


def _run(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env["EAGLESCALE_PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, timeout=60, env=env
    )


def _dry(out: subprocess.CompletedProcess) -> tuple[dict[str, str], list[str]]:
    """(NCCL environment, command) from a --dry-run's output."""
    assert out.returncode == 0, out.stderr
    *env_lines, cmd = out.stdout.strip().splitlines()
    return dict(line.split("=", 1) for line in env_lines), shlex.split(cmd)


# --- launch_target.sh -------------------------------------------------------------------------


def test_help_and_bad_arguments():
    out = _run(LAUNCH, "--help")
    assert out.returncode == 0 and "--model PATH" in out.stdout and "--nccl-seed-tuning" in out.stdout
    # Every server setting the builder takes is in the script's help.
    for flag in SETTING_FLAGS.values():
        assert flag in out.stdout, flag
    bad = _run(LAUNCH, "--modle", "x")
    assert bad.returncode == 2 and "unrecognized arguments: --modle x" in bad.stderr
    missing = _run(LAUNCH, "--tp", "8")
    assert missing.returncode == 2 and "--model is required" in missing.stderr
    no_value = _run(LAUNCH, "--model", "/m", "--nccl-proto")
    assert no_value.returncode == 2 and "--nccl-proto needs a value" in no_value.stderr
    spec = _run(LAUNCH, "--model", "/m", "--draft", "/d", "--dry-run")
    assert spec.returncode == 2 and "--draft is not an option of the generation server" in spec.stderr


def test_dry_run_builds_the_launch_command():
    out = _run(LAUNCH, "--model", "/models/Kimi-K2.5", "--nccl-ib-disable", "--dry-run", "--", "--log-level", "info")
    env, cmd = _dry(out)
    assert env == {"NCCL_IB_DISABLE": "1"}
    assert cmd == build_launch_command(
        LaunchSpec("/models/Kimi-K2.5", 30000, host="0.0.0.0", tp_size=8, cuda_graph_max_bs=None,
                   mem_fraction_static=0.88, extra_args=("--trust-remote-code", "--log-level", "info")),
        PINNED_VERSIONS[-1], python=sys.executable,
    )  # fmt: skip
    assert not [a for a in cmd if "cuda-graph" in a]  # a generation server keeps SGLang's graph sizes


def test_target_takes_the_server_settings_of_its_version():
    """The H200's 0.5.14 settings, through the builder: each setting once, every flag in 0.5.14's
    recorded --help; a setting the version lacks is refused naming it."""
    out = _run(LAUNCH, "--model", "/m", "--sglang-version", "0.5.14", "--attention-backend", "triton",
               "--sampling-backend", "pytorch", "--grammar-backend", "none", "--dtype", "bfloat16",
               "--disable-prefill-cuda-graph", "--disable-radix-cache", "--context-length", "4096", "--dry-run")  # fmt: skip
    _, cmd = _dry(out)
    settings = ServerSettings(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                              dtype="bfloat16", disable_prefill_cuda_graph=True, disable_radix_cache=True)  # fmt: skip
    assert cmd == build_launch_command(
        LaunchSpec("/m", 30000, host="0.0.0.0", tp_size=8, cuda_graph_max_bs=None, mem_fraction_static=0.88,
                   server=settings, extra_args=("--trust-remote-code", "--context-length", "4096")),
        "0.5.14", python=sys.executable,
    )  # fmt: skip
    assert cmd[cmd.index("--attention-backend") + 1] == "triton"
    old = _run(LAUNCH, "--model", "/m", "--sglang-version", "0.5.4", "--disable-prefill-cuda-graph", "--dry-run")
    assert old.returncode == 2 and "SGLang 0.5.4 has no --disable-prefill-cuda-graph" in old.stderr
    bad = _run(LAUNCH, "--model", "/m", "--sglang-version", "0.5.14", "--dry-run", "--", "--cuda-graph-max-bs", "64")
    assert bad.returncode == 2 and "use --cuda-graph-max-bs-decode instead" in bad.stderr


def test_nccl_options_export_the_seed_settings():
    env, _ = _dry(_run(LAUNCH, "--model", "/m", "--nccl-seed-tuning", "--nccl-p2p-disable", "--dry-run"))
    assert env == {**SEED_NCCL, "NCCL_P2P_DISABLE": "1"}
    env, _ = _dry(_run(LAUNCH, "--model", "/m", "--nccl-proto", "Simple", "--nccl-algo", "Tree", "--dry-run"))
    assert env == {"NCCL_PROTO": "Simple", "NCCL_ALGO": "Tree"}


# --- launch_speculative.sh: the gate's builder through `python -m tasks.sglang.command` ------------


def test_speculative_help_lists_script_nccl_and_builder_options():
    out = _run(SPECULATIVE, "--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--draft PATH", "--baseline", "--num-steps", "--sglang-version", "--nccl-seed-tuning", "--dry-run",
                 *SETTING_FLAGS.values()):  # fmt: skip
        assert flag in out.stdout, flag


@pytest.mark.parametrize("version", PINNED_VERSIONS)
def test_speculative_dry_run_is_exactly_the_gates_command(version):
    out = _run(
        SPECULATIVE, "--model", "/models/Kimi-K2.5", "--draft", "/drafts/final", "--num-steps", "2",
        "--sglang-version", version, "--nccl-seed-tuning", "--dry-run", "--", "--trust-remote-code",
    )  # fmt: skip
    env, cmd = _dry(out)
    spec, _ = resolve_spec("/drafts/final", 2, 1)
    launch = LaunchSpec(
        "/models/Kimi-K2.5", 30000, host="0.0.0.0", tp_size=8, spec=spec,
        mem_fraction_static=0.88, extra_args=("--trust-remote-code",),
    )  # fmt: skip
    assert cmd == build_launch_command(launch, version, python=sys.executable)
    assert env == SEED_NCCL
    graph_flag = "--cuda-graph-max-bs" if version == "0.5.4" else "--cuda-graph-max-bs-decode"
    assert cmd[cmd.index(graph_flag) + 1] == "8"
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "3"
    assert "num_draft_tokens set to num_steps + 1 = 3" in out.stderr


def test_speculative_baseline_has_no_speculative_flags():
    _, cmd = _dry(_run(SPECULATIVE, "--model", "/m", "--baseline", "--tp", "4", "--dry-run"))
    assert not [a for a in cmd if a.startswith("--speculative")]
    assert cmd[cmd.index("--tp-size") + 1] == "4"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/m", "--draft", "/d"], "--num-steps is required with --draft"),
        (["--model", "/m"], "give exactly one of --draft PATH and --baseline"),
        (["--model", "/m", "--draft", "/d", "--num-steps", "3", "--num-draft-tokens", "6"],
         "needs --speculative-num-draft-tokens = num_steps + 1 = 4, got 6"),
        (["--model", "/m", "--draft", "/d", "--num-steps", "3", "--topk", "4"],
         "--speculative-num-draft-tokens must be set with --speculative-eagle-topk 4"),
        (["--model", "/m", "--baseline", "--", "--cuda-graph-max-bs", "4"],
         "--cuda-graph-max-bs is not an SGLang 0.5.23 flag"),
        (["--model", "/m", "--baseline", "--", "--speculative-algorithm", "EAGLE"],
         "--speculative-algorithm is set by the gate itself"),
        (["--model", "/m", "--baseline", "--sglang-version", "0.4.9"], "'0.4.9' is not pinned"),
        (["--model", "/m", "--baseline", "--sglang-version", "0.5.14", "--", "--disable-cuda-graph"],
         "--disable-cuda-graph is a deprecated alias in SGLang 0.5.14"),
        (["--model", "/m", "--baseline", "--sglang-version", "0.5.14", "--", "--foo"],
         "--foo is not an SGLang 0.5.14 flag"),
        (["--model", "/m", "--baseline", "--sglang-version", "0.5.14", "--attention-backend", "fa9"],
         "--attention-backend 'fa9' is not one of SGLang 0.5.14's choices"),
        (["--model", "/m", "--baseline", "--nccl-algo"], "--nccl-algo needs a value"),
        (["--model", "/m", "--baseline", "--python"], "--python needs a value"),
    ],
)  # fmt: skip
def test_speculative_refusals_name_the_flag(args, message):
    # --dry-run goes last: an option missing its value must not swallow it (and launch).
    out = _run(SPECULATIVE, *args, "--dry-run")
    assert out.returncode == 2, out.stdout
    assert message in out.stderr and not out.stdout


def test_speculative_corrects_draft_tokens_only_when_asked():
    out = _run(SPECULATIVE, "--model", "/m", "--draft", "/d", "--num-steps", "3", "--num-draft-tokens", "6",
               "--correct-draft-tokens", "--dry-run")  # fmt: skip
    _, cmd = _dry(out)
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "4"
    assert "num_draft_tokens corrected from 6 to num_steps + 1 = 4" in out.stderr


def test_launch_scripts_are_shellcheck_clean():
    shellcheck = require_tool("shellcheck", install="`make test-tools` installs Debian's shellcheck")
    out = subprocess.run(
        [shellcheck, "-x", "launch_target.sh", "launch_speculative.sh", "nccl.sh"],
        cwd=SGLANG, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout


# --- Dockerfiles (docker is not here: what can be checked statically) ---------------------------


def _dockerfile(name: str) -> dict:
    text = (DOCKER / name).read_text()
    lines = re.sub(r"\\\n", " ", text).splitlines()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))
    return {
        "text": text,
        "from": [ln.split()[1] for ln in lines if ln.startswith("FROM ")],
        "args": args,
        "copy": [ln.split()[1] for ln in lines if ln.startswith("COPY ")],
        "runs": [ln for ln in lines if ln.startswith("RUN ")],
        "cmd": json.loads(next(ln[4:] for ln in lines if ln.startswith("CMD "))),
    }


def _pools() -> set[str]:
    doc = yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())
    return {d["work_pool"]["name"] for d in doc["deployments"]}


def _assert_worker_cmd_parses(cmd: list[str]) -> dict:
    # `prefect worker start ... --help` exits 0 even with a misspelled option; the CLI's own
    # parser (cyclopts, what `prefect` runs) refuses one without starting anything.
    from prefect.cli._app import _app

    assert cmd[:3] == ["prefect", "worker", "start"] and "ENTRYPOINT" not in cmd
    _, bound, *_ = _app.parse_args(cmd[1:], exit_on_error=False, print_error=False)
    return bound.arguments


@pytest.mark.parametrize("name", ["Dockerfile.gpu-worker", "Dockerfile.orchestrator"])
def test_dockerfile_pins_copies_and_entrypoint(name):
    df = _dockerfile(name)
    assert len(df["from"]) == 1
    image, _, tag = df["from"][0].partition(":")
    assert tag and tag != "latest" and re.match(r"\d+\.\d+\.\d+", tag), df["from"]
    for src in df["copy"]:
        assert (ROOT / src).exists(), f"{name}: COPY {src} names nothing in the repository"
    # On Kubernetes the job's args replace CMD; an ENTRYPOINT would be prepended to them.
    assert "\nENTRYPOINT" not in df["text"]
    bound = _assert_worker_cmd_parses(df["cmd"])
    assert bound["worker_type"] == "process"
    assert "EAGLESCALE_ROOT=/opt/eaglescale" in df["text"]  # deployments' pull step reads it


def test_gpu_worker_installs_a_pinned_sglang_through_the_extra():
    df = _dockerfile("Dockerfile.gpu-worker")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = next(r for r in df["runs"] if "pip install -e" in r)
    named = re.findall(r'"\.\[([\w,-]+)\]"', install)
    assert named == ["sglang"] and set(named[0].split(",")) <= set(extras)
    assert "sglang==${SGLANG_VERSION}" in install
    # The image's SGLang must be a version the gate's launch builder has a flag set for.
    assert df["args"]["SGLANG_VERSION"] in PINNED_VERSIONS


def test_orchestrator_pins_cpu_torch_like_the_makefile_and_polls_a_deployed_pool():
    df = _dockerfile("Dockerfile.orchestrator")
    makefile_torch = re.search(r"^TORCH_CPU := torch==(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert makefile_torch and df["args"]["TORCH_VERSION"] == makefile_torch.group(1)
    assert any("download.pytorch.org/whl/cpu" in r and "torch==${TORCH_VERSION}" in r for r in df["runs"])
    bound = _assert_worker_cmd_parses(df["cmd"])
    assert bound["work_pool_name"] in _pools()


# --- compose: Prefect server on PostgreSQL -------------------------------------------------------


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg or ""

    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", sub, value)


def test_compose_file_has_postgres_and_a_matching_prefect_server(monkeypatch, tmp_path):
    import prefect

    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert set(services) == {"postgres", "prefect-server"}
    for svc in services.values():
        image, _, tag = svc["image"].partition(":")
        assert re.match(r"\d+\.\d+", tag), svc["image"]
        assert svc["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    server, pg = services["prefect-server"], services["postgres"]
    assert server["image"] == f"prefecthq/prefect:{prefect.__version__}-python3.11"
    assert server["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert server["command"][:3] == ["prefect", "server", "start"]
    volume = pg["volumes"][0].split(":")[0]
    assert volume in doc["volumes"]
    with pytest.raises(KeyError, match="PREFECT_DB_PASSWORD"):
        _interpolate(pg["environment"]["POSTGRES_PASSWORD"], {})
    # The environment's names are ones the installed Prefect reads, with the values meant.
    env = {k: _interpolate(str(v), {"PREFECT_DB_PASSWORD": "pw"}) for k, v in server["environment"].items()}
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = prefect.settings.Settings()
    url = settings.server.database.connection_url.get_secret_value()
    assert url == "postgresql+asyncpg://prefect:pw@postgres:5432/prefect"
    assert settings.server.analytics_enabled is False
    assert settings.server.ui.api_url == "http://localhost:4200/api"
    assert pg["environment"]["POSTGRES_USER"] in url and pg["environment"]["POSTGRES_DB"] in url
