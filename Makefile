# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
# The CPU build of torch that lies on this machine's disk; on a GPU box set TORCH_SPEC=torch to get CUDA.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint typecheck bench bench-quick clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m trainyard.cli.demo examples/demo.yaml

# mypy runs beside the tests (it needs one core for some 15 s; the tests wait on processes much of the time); its
# verdict, like theirs, decides the target's.
test: $(STAMP)
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory typecheck & typecheck=$$!; \
	$(BIN)/python -m pytest --durations=25; tests=$$?; \
	wait $$typecheck && exit $$tests

# The minutes-long tests `make test` leaves out (elasticity on a two-node cluster, README's fine-tuning walk-through).
test-slow: $(STAMP)
	TRAINYARD_SLOW_TESTS=1 $(BIN)/python -m pytest -m slow

lint: $(STAMP)
	$(BIN)/ruff check .

# mypy over the product (configured in pyproject.toml). mypy names a module by its path, and `parallel/` is
# `trainyard.parallel` only through trainyard/__init__.py: links under build/typecheck/trainyard give mypy the
# installed layout (the folders are setup.py's FOLDERS). About 15 s from a cold cache on 2 cores.
TYPECHECK_TREE := build/typecheck/trainyard
typecheck: $(STAMP)
	mkdir -p $(TYPECHECK_TREE)
	ln -sfn ../../../trainyard/__init__.py $(TYPECHECK_TREE)/__init__.py
	for folder in api service actors parallel cli; do ln -sfn ../../../$$folder $(TYPECHECK_TREE)/$$folder; done
	$(BIN)/mypy

# The whole benchmark (over 15 minutes); `make bench QUICK=1` or `make bench-quick`: a pass under 5 minutes.
bench: $(STAMP)
	$(BIN)/python -m bench.run $(if $(QUICK),--quick)

bench-quick: $(STAMP)
	$(BIN)/python -m bench.run --quick

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache build/typecheck
