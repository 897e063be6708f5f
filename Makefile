# Two commands on a fresh machine:
#   make demo   set up .venv, generate a small synthetic dataset, train the tiny
#               sequence model on 2 local ranks (torchrun, gloo on CPU)
#   make test   set up .venv if needed, run the static checks (ruff, mypy) and the test suite
# FREESCALE_STACK=cpu|cuda overrides the stack choice (default: cuda when nvidia-smi sees a GPU).

VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
DEMO_DATA ?= data/demo
DEMO_RUN ?= runs/demo
PYTEST_ARGS ?=

.PHONY: setup demo test check bench-quick clean

setup:
	@scripts/setup_env.sh

# Each demo starts afresh: a run refuses a directory holding another run's checkpoints.
demo: setup
	$(VENV)/bin/freescale gen-data --out $(DEMO_DATA) --rows 40000 --eval-rows 8192 --max-len 64 --seed 0
	rm -rf $(DEMO_RUN)
	$(VENV)/bin/freescale launch --nproc-per-node $(NPROC) --config configs/tiny_hstu.toml \
		--data.path $(DEMO_DATA) --train.output_dir $(DEMO_RUN)

# ruff and mypy over the package (configured in pyproject.toml).
check: setup
	@PY=$(abspath $(PY)) scripts/static_checks.sh

# pytest exits 5 when it collected no test: treat that as the failure it is.
test: setup check
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

bench-quick: setup
	$(PY) benchmarks/bench_train.py --quick

clean:
	rm -rf $(VENV) data runs build dist *.egg-info .pytest_cache
