"""eaglescale on a GPU node with no network, one device call at a time: the harness of the real
runs behind BENCHMARKS.md (P8 on). Not part of the installed product: it runs the product's
stages (`eaglescale run --stages X`) and its compositions, and adds what is about a session: the
payload that carries the run and its wheels to the node, the plans, the device time each step
may take, and what travels from one session to the next. README.md is the runbook.

Here: cli (`python3 -m gpunode`), payload (`prepare`), model_parts (the target's wheels). On the
node: lifecycle (`node receive|start|wait`), collection (what `node wait` brings back), travel
(what one session hands the next), plans, pipeline (the daemon, a class of one module per job:
core, setup, generation, training, session_train, gate_session, packing, plan_runs, recipe),
steps (the helper processes), gate_plan (the gate's launch plan from the product),
specforge_anchor and logprob_probe (node-side measurements), import_profile, node_env (paths and
switches)."""
