# infermesh entry points. `make help` lists them. Everything sets itself up:
# a fresh clone needs only python3 (3.11), make and the package registries.

SHELL := /bin/bash
# Python's default: keep compiled bytecode in __pycache__ (gitignored). Some machines, CI's among them, set
# PYTHONDONTWRITEBYTECODE=1, and then every one of the ~450 service processes the suite starts compiled our
# sources again (a gateway imported in 0.64 s of CPU instead of 0.31 s) and every test process recompiled
# the rewritten test modules (~6 s each).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GEN := gen/python
PROTOS := $(wildcard protos/infermesh/v1/*.proto protos/inference/*.proto)
MODEL_REPO ?= model_repo
MESH_PID := run/mesh.pid
MESH_HEALTH := 127.0.0.1:$${MESH_GATEWAY_PORT:-50051} 127.0.0.1:$${MESH_SCHEDULER_PORT:-50052} \
	127.0.0.1:$${MESH_SCHEDULER2_PORT:-50053} \
	127.0.0.1:$${MESH_CLASSIFIER_PORT:-50061} 127.0.0.1:$${MESH_GENERATOR_PORT:-50062}
MESH_STORE := 127.0.0.1:$${MESH_STORE_PORT:-6390}
MESH_GATEWAY := 127.0.0.1:$${MESH_GATEWAY_PORT:-50051}
# The gateway's OpenAI-compatible HTTP API (docs/clients.md).
MESH_GATEWAY_HTTP := 127.0.0.1:$${MESH_GATEWAY_HTTP_PORT:-8000}
export MESH_CLASSIFIER_MODEL ?= digits
export MESH_GENERATOR_MODEL ?= tinylm
# Running sequences per step for the generator worker (0: the model's manifest). tinylm's manifest says 16;
# at 32 one CPU core computes a token for ~86 us instead of ~117, and a light tenant's first token
# under a heavy one stays within 3x of alone, which 64 slots broke (docs/token_path.md, "Running slots").
export MESH_GENERATOR_MAX_NUM_SEQS ?= $(if $(filter tinylm,$(MESH_GENERATOR_MODEL)),32,0)
export MESH_MODEL_REPO ?= $(MODEL_REPO)
# The key make up checks readiness with (and make demo loads with): a tenant's key in MESH_TENANTS_FILE.
MESH_API_KEY ?= demo-key-alpha
# TLS: make up issues a throwaway dev CA and one certificate per service into MESH_TLS_DIR (tools.dev_ca,
# kept while valid for a day more) and starts every service with it: mTLS between gateway, schedulers and
# workers, server TLS on the gateway's public port (tenants bring API keys). The services read their
# files from INFERMESH_<SERVICE>_TLS_* (exported to honcho below); the readiness wait, the demo and the
# load test verify the gateway with the CA. MESH_PLAINTEXT=1 starts the old plaintext mesh (every service
# is given --plaintext through INFERMESH_<SERVICE>_PLAINTEXT and logs "TLS is OFF").
MESH_TLS_DIR ?= $(CURDIR)/run/tls
# $(call tls_env,SERVICE,service): the three variables that give one service its files.
tls_env = INFERMESH_$(1)_TLS_CERT_FILE=$(MESH_TLS_DIR)/$(2).pem INFERMESH_$(1)_TLS_KEY_FILE=$(MESH_TLS_DIR)/$(2)-key.pem \
	INFERMESH_$(1)_TLS_CA_FILE=$(MESH_TLS_DIR)/ca.pem
ifeq ($(filter 1 true yes,$(MESH_PLAINTEXT)),)
MESH_TLS_ENV := $(call tls_env,GATEWAY,gateway) $(call tls_env,SCHEDULER,scheduler) $(call tls_env,WORKER,worker)
# The readiness wait dials the schedulers and workers too: they want a client certificate.
MESH_WAIT_TLS := --ca-file $(MESH_TLS_DIR)/ca.pem --cert-file $(MESH_TLS_DIR)/gateway.pem \
	--key-file $(MESH_TLS_DIR)/gateway-key.pem
MESH_CLIENT_TLS := --ca-file $(MESH_TLS_DIR)/ca.pem
MESH_SCHEME := TLS, CA $(MESH_TLS_DIR)/ca.pem
MESH_HTTP_SCHEME := https
else
# Plaintext only when asked for by name: a service without certificates refuses to start otherwise.
MESH_TLS_ENV := INFERMESH_GATEWAY_PLAINTEXT=true INFERMESH_SCHEDULER_PLAINTEXT=true INFERMESH_WORKER_PLAINTEXT=true
MESH_WAIT_TLS :=
MESH_CLIENT_TLS :=
MESH_SCHEME := PLAINTEXT (MESH_PLAINTEXT=$(MESH_PLAINTEXT))
MESH_HTTP_SCHEME := http
endif

.PHONY: help setup protos models model-repo up down demo test test-all compile-suite warm-kernels lint typecheck chaos fuzz bench bench-gpu images clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-8s %s\n", $$1, $$2}'

setup: $(STAMP) $(GEN)/.stamp ## create .venv, install pinned dependencies and the project, generate stubs

$(STAMP): requirements.lock pyproject.toml
	python3 -m venv $(VENV)
	# --no-compile: byte-compiling every installed file (torch, scipy...) doubled the install (80 s -> 40 s
	# on the 2-core machine); Python compiles what is imported, when it is first imported.
	$(PY) -m pip install -q --no-compile -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	echo "$(CURDIR)/$(GEN)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/infermesh-stubs.pth"
	touch $@

protos: $(GEN)/.stamp ## generate gRPC stubs from protos/ into gen/python (never edited by hand)

$(GEN)/.stamp: $(PROTOS) $(STAMP)
	rm -rf $(GEN) && mkdir -p $(GEN)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$(GEN) --pyi_out=$(GEN) --grpc_python_out=$(GEN) $(PROTOS)
	touch $@

models: setup ## rebuild the demo models from their recipes; compare bit for bit on the recorded CPU, else within tolerances
	$(PY) -m tools.build_models --out $(MODEL_REPO) --verify

model-repo: setup ## check the demo models in model_repo/ (sha256, recipe); build only what is missing
	@$(PY) -m tools.build_models --out $(MODEL_REPO)

up: setup model-repo ## start two schedulers, the quota store, gateway and two workers on 127.0.0.1; wait until all are SERVING
	@mkdir -p run
	@$(PY) -m tools.mesh check-key --tenants-file "$${MESH_TENANTS_FILE-deploy/local/tenants.yaml}" --api-key $(MESH_API_KEY) \
		--allow-anonymous $${MESH_ALLOW_ANONYMOUS:-false}
	@if [ -f $(MESH_PID) ] && kill -0 $$(cat $(MESH_PID)) 2>/dev/null; then \
		echo "mesh already running (pid $$(cat $(MESH_PID))); make down stops it"; exit 0; fi; \
	$(if $(MESH_WAIT_TLS),$(PY) -m tools.dev_ca --out $(MESH_TLS_DIR) --services gateway scheduler worker operator --keep-valid-days 1 > /dev/null || exit 1;) \
	$(MESH_TLS_ENV) PATH="$(CURDIR)/$(VENV)/bin:$$PATH" setsid $(VENV)/bin/honcho -f deploy/local/Procfile -d . start \
		> run/mesh.log 2>&1 < /dev/null & echo $$! > $(MESH_PID); \
	if ! $(PY) -m tools.mesh wait --health $(MESH_HEALTH) --store $(MESH_STORE) --gateway $(MESH_GATEWAY) \
		--models $(MESH_CLASSIFIER_MODEL) $(MESH_GENERATOR_MODEL) --api-key $(MESH_API_KEY) --timeout-s 180 \
		$(MESH_WAIT_TLS); then \
		tail -n 40 run/mesh.log; $(MAKE) --no-print-directory down; exit 1; fi; \
	echo "infermesh is up: gateway at $(MESH_GATEWAY), $(MESH_SCHEME); OpenAI-compatible API at" \
		"$(MESH_HTTP_SCHEME)://$(MESH_GATEWAY_HTTP)/v1 (logs: run/mesh.log). Stop it with: make down"

down: ## stop the local mesh started by make up
	@if [ -f $(MESH_PID) ]; then \
		pid=$$(cat $(MESH_PID)); kill -TERM $$pid 2>/dev/null; \
		for i in $$(seq 1 200); do kill -0 $$pid 2>/dev/null || break; sleep 0.1; done; \
		if kill -0 $$pid 2>/dev/null; then kill -KILL -- -$$pid 2>/dev/null; fi; \
		rm -f $(MESH_PID); echo "mesh stopped"; \
	else echo "mesh is not running"; fi

demo: setup ## start the mesh, drive a 30 s mixed load, write a tail-latency report under reports/, stop
	@$(MAKE) --no-print-directory up
	@$(PY) -m tools.demo --gateway $(MESH_GATEWAY) --api-key $(MESH_API_KEY) $(MESH_CLIENT_TLS) \
		&& $(PY) -m loadtest run loadtest/scenarios/demo.yaml --target $(MESH_GATEWAY) --out reports --wait-ready-s 60 \
		$(MESH_CLIENT_TLS); \
		status=$$?; $(MAKE) --no-print-directory down; exit $$status

# The suite runs in TEST_WORKERS pytest processes (pytest-xdist), a test file per process at a time so a
# module's mesh starts once. Most of the suite waits on the service processes it starts. Fresh clones on
# the quiet 2-core machine: one process ran pytest in 927 s; three in 435-440 s (154-159% CPU); four in
# 461 s (164%). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Python compiles a module when it is first imported and keeps the bytecode (__pycache__; .venv is installed
# --no-compile). Each test process collects the whole suite, so on a fresh clone the three compiled the same
# ~3,700 modules (torch, transformers, scipy, our sources, the rewritten test modules) side by side: collecting
# cost 44 s of CPU instead of 19. One collection beside mypy (one core each, ~15 s of CPU apiece) compiles
# them first; its result is not used (collection errors fail the suite's own collection).
# The kernels' CPU twins compile once into Numba's cache (tools/warm_kernels.py) before the test processes
# and the meshes' workers would each compile them side by side on a fresh clone.
TEST_PREPARE := typecheck warm-kernels $(if $(XDIST),compile-suite)

test: setup lint ## lint, typecheck, then the whole suite (unit, contract, integration, reliability)
	@$(MAKE) --no-print-directory -j2 $(TEST_PREPARE)
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

warm-kernels: setup
	@$(PY) -m tools.warm_kernels

compile-suite: setup
	-@$(PY) -m pytest --collect-only -q -p no:cacheprovider $(PYTEST_ARGS) > /dev/null 2>&1

# Under CI=true make test takes the quick form of the slowest sweeps (tests/support/sweeps.py: the CUDA
# kernels on the simulator, one case per kernel variant); test-all runs them whole wherever it runs.
test-all: setup lint ## make test with every sweep whole, even under CI=true (CUDA simulator: every shape)
	@$(MAKE) --no-print-directory -j2 $(TEST_PREPARE)
	INFERMESH_TEST_ALL=1 $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

lint: setup ## ruff
	$(VENV)/bin/ruff check .

typecheck: setup ## mypy over services/, kernels/ and loadtest/ (pyproject.toml [tool.mypy]; cache in .mypy_cache)
	$(VENV)/bin/mypy

chaos: setup ## the chaos driver (tests/reliability/chaos.py): the faults close together, CHAOS_RUNS runs in a row (default 5), seeded (CHAOS_SEED)
	$(PY) -m tests.reliability.chaos --runs $${CHAOS_RUNS:-5} --seed $${CHAOS_SEED:-35}

fuzz: setup ## atheris on every parser of outside input, FUZZ_SECONDS each (default 180); findings under run/fuzz/
	$(PY) -m fuzz.run --seconds $${FUZZ_SECONDS:-180}

# Every entry point is bench/<group>/bench_*.py; bench_gpu_* need CUDA and run in bench-gpu instead.
BENCH_SCRIPTS := $(foreach script,$(sort $(wildcard bench/*/bench_*.py)),$(if $(findstring /bench_gpu_,$(script)),,$(script)))

bench: setup model-repo ## benchmarks: tables on stdout, JSON under bench/results/ (QUICK=1: a shorter run)
	@for script in $(BENCH_SCRIPTS); do \
		module=$$(echo $${script%.py} | tr / .); echo "== $$module"; \
		$(PY) -m $$module $(if $(QUICK),--quick) || exit 1; done

bench-gpu: setup model-repo ## on a CUDA machine: kernel checks vs float64, GPU kernel/worker benchmarks, the mesh on --device cuda (logs+JSON in bench/results/)
	PATH=$(VENV)/bin:$$PATH bash bench/gpu_session.sh

images: setup ## docker build each service image, tagged with the release --version prints (tools/images.py)
	$(PY) -m tools.images $(IMAGES_ARGS)

clean: ## remove generated stubs, run files and reports (keeps .venv)
	rm -rf $(GEN) run reports bench/results
