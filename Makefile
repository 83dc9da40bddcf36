# Two commands: `make demo` (main job) and `make test` (whole test suite).
# Both create .venv with the project installed when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The stamp changes with pyproject.toml, constraints.txt and the checkout's path (the install
# is editable). constraints.txt pins the versions tested; pyproject.toml states ranges.
STAMP := $(VENV)/.installed-$(shell (cat pyproject.toml constraints.txt; pwd) | sha256sum | cut -c1-16)

.PHONY: demo test lint format venv clean gpu-check gpu-bundle

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fromp_bench demo

# the tests spread over the machine's cores (pytest-xdist): contiguous runs of tests per worker,
# an idle worker takes over the rest of a busy one's (the Ray sweep tests are long); bytecode
# is cached even where PYTHONDONTWRITEBYTECODE is set (pytest's rewritten test modules, the
# processes the tests start), so a second run or process does not compile it again
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n auto --dist worksteal

# On a machine with a CUDA GPU (studies/gpu_step.sh): the CUDA tests and the runner's training
# times of Naive, FROMP and EWC (split MNIST at 2 and 15 epochs per task, split CIFAR's network
# at one on synthetic files) -> benchmarks/results/gpu/<date>-<device>.json and .md, then a
# profile of their training step -> <date>-cuda-step-profile.json and .md.
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python bash studies/gpu_step.sh benchmarks/results/gpu

# For a GPU machine without a package index: wheels, MNIST and a wandb stand-in into
# .gpu-bundle/ (ignored by git), and the one command to run there (docs/gpu.md).
gpu-bundle: $(STAMP)
	$(BIN)/python -m studies.gpu_bundle

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
