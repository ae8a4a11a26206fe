"""The benchmark gate: does the trained draft make the SGLang server faster? (docs/DESIGN.md §3)

stage.py       the gate stage, in order: preflight, offline replay, benchmark, prediction,
               decision, report, promotion, the data-scaling curve (`run_gate_stage`)
preflight.py   checks each draft folder against its launches before any GPU time is spent
replay.py      offline acceptance of a draft over extracted held-out sequences
plan.py        held-out prompt set, the sweep's points (`sweep_points`), configs, launch order,
               the records kept
benchmark.py   the benchmark on servers: fresh launches in waves, warm-up, cost probes, flush,
               repetitions, acceptance floor (servers start through tasks/sglang/: the
               command builder and server_process)
local_benchmark.py  the same benchmark on the in-process speculative engine (CPU boxes, the demo)
progress.py    gate/progress.json and a log line per phase and launch while it runs
cost_model.py  step costs and the tok/s a replayed accept length predicts
decision.py    bootstrap CI and the promote/reject rules
report.py      gate/report.json, gate/report.md, gate/plots/*.png
promote.py     registry publish + promoted.json
scaling.py     accept length against training samples, measured and replayed

The gate's section of the run's configuration (GateConfig: every threshold) is
tasks/config/gate_section.py.
"""
