# Set-up, tests, lint and benchmarks. Everything runs inside .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU machines get the CPU build of torch first; the package itself only asks for torch>=2.6.
TORCH_CPU ?= torch==2.13.0

.PHONY: install test test-all lint format bench demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard kernels/*.cpp kernels/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q "torch>=2.6"; \
	else \
		$(PIP) install -q $(TORCH_CPU); \
	fi
	$(PIP) install -q -e ".[test,dev]"
	touch $@

test: install
	$(PY) -m pytest -m "not gpu" -q

test-all: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check rlflow tests recipes benchmarks
	$(VENV)/bin/ruff format --check rlflow tests recipes benchmarks

format: install
	$(VENV)/bin/ruff format rlflow tests recipes benchmarks
	$(VENV)/bin/ruff check --fix rlflow tests recipes benchmarks

bench: install
	$(PY) -m benchmarks.run $(BENCH)

demo: install
	$(PY) recipes/grpo_arithmetic.py

clean:
	rm -rf build *.egg-info rlflow/_C_*.so
