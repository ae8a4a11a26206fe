"""Stand-ins for SGLang: servers with its HTTP surface, for CI, dry runs and benchmarks where
no real SGLang runs. Nothing in the product's real paths imports them (tests/test_layering.py).

server.py       the SGLang-compatible server (`eaglescale serve-sglang`), on a thread or in a child process
app.py          its aiohttp handlers, fault application and counters
server_format.py  /generate requests as SGLang validates them, answers with its exact keys
backends.py     what it generates with: the shared types and the model backend (a local HF model)
sim.py          the simulator: one continuous-batching timing model, plain or speculative, with
                SGLang's scheduler log lines (the simulated backend)
faults.py       fault injection: what a flaky deployment does to a client
router.py       the HTTP surface of SGLang's model gateway over stand-in workers
spec_launch.py  `python -m tasks.standins.spec_launch SGLANG_ARGS`: the launch emulator (the
                simulator behind SGLang's CLI and start-up) the gate's emulated engine starts
                exactly as it would start SGLang
"""
