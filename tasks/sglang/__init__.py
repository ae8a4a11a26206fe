"""SGLang as eaglescale knows it without importing it:

recorded_flags.py  each pinned version's recorded `launch_server --help`
versions.py        each version's flag table and the launch checks
server_settings.py `ServerSettings`: the server-wide settings every launch of a run shares
                   (`gate.server`)
command.py         `python -m sglang.launch_server` command lines (and `python -m
                   tasks.sglang.command`, the operator's builder the infra/sglang scripts run)
server_process.py  a launched server's life: start (SGLang or the emulator), ports, health
                   wait, server-info check, log parsing (CUDA graphs, decode lines), stop
simulated_acceptance.py  SGLANG_SIMULATE_ACC_LEN: SGLang's forced-acceptance draw, for the
                   break-even launches and the emulator

The gate launches its servers through these, and infra/sglang/launch_target.sh starts
generation's server with them; nothing here imports the rest of eaglescale.
"""
