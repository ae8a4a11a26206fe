"""Stand-ins for SGLang: servers with its HTTP surface, for CI, dry runs and benchmarks where
no real SGLang runs. Nothing in the product's real paths imports them (tests/test_layering.py).

server.py       the SGLang-compatible server (`eaglescale serve-sglang`), on a thread or in a child process
app.py          its aiohttp handlers, fault application and counters
server_format.py  /generate requests as SGLang validates them, answers with its exact keys
backends.py     what it generates with: the shared types and the model backend (a local HF model)
sim.py          the simulator: one continuous-batching timing model, plain or speculative, whose
                steps grow with the batch (the simulated backend)
sim_spec.py     its speculative behaviour (verify cost, acceptance, spec_* fields) and SGLang's
                scheduler log lines
sim_adaptive.py SGLang's batch-size-aware adaptive speculation, as the simulator runs it
faults.py       fault injection: what a flaky deployment does to a client
router.py       the HTTP surface of SGLang's model gateway over stand-in workers
spec_launch.py  `python -m tasks.standins.spec_launch SGLANG_ARGS`: the launch emulator (the
                simulator behind SGLang's CLI and start-up) the gate's emulated engine starts
                exactly as it would start SGLang
spec_args.py    its CLI per SGLang version and SGLang's server-args rules for speculation
"""
