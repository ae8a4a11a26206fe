"""The H200 runner's parts (benchmarks/h200_run.py is the one entry point, and its docstring the
runbook): node_env (paths, the environment's switches), plans (what `node start --plan` runs),
payload (built here), travel (what one session hands the next), lifecycle (the node's calls),
node_pipeline (the pipeline daemon), node_steps (the steps it runs as their own processes)."""
