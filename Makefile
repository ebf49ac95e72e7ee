# megatron-async: `make test` and `make demo` work on a fresh machine.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# A Python 3.12 that really runs: python3.12 on PATH, else pyenv's newest 3.12.
PYTHON312 ?= $(shell \
	if python3.12 -c '' >/dev/null 2>&1; then command -v python3.12; \
	else ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n 1; fi)
PYTEST_ARGS ?=
# Python writes each module's bytecode the first time it is imported: a setup that compiled
# all 18,000 files of the venv would write far more than the suite reads (pip installs with
# --no-compile), and an environment with PYTHONDONTWRITEBYTECODE set would compile torch and
# Megatron again in every process the suite starts (7 s against 21 s of CPU an import).
unexport PYTHONDONTWRITEBYTECODE
# Two pytest workers (CI has 2 cores); a module's tests stay on one worker, so its
# module-scoped fixtures run once. PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
# The GPU acceptance suite runs in the Python that has CUDA, Transformer Engine and the
# plugin (on a GPU node: the NVIDIA PyTorch container's, see docker/install.sh); it
# never builds the CPU venv. Its report goes to $(GPU_REPORT)/report.json.
GPU_PYTHON ?= python3
GPU_REPORT ?= out/gpu

.PHONY: setup test test-gpu test-gpu-ranks test-gpu-ranks-dry test-cluster image image-smoke demo bench clean

setup: $(STAMP)

$(STAMP): setup.py constraints.txt
	@test -n "$(PYTHON312)" || { echo "error: no Python 3.12 found (install python3.12 or pyenv install 3.12)"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[test,export]'
	@touch $(STAMP)

# The quick tests run first and stop at the first failure, so a broken install shows in
# under a minute (the layout, the wheel, schedules, a Megatron-Core model on the CPU).
QUICK_TESTS := tests/test_layout.py tests/test_packaging.py tests/test_schedule_validator.py tests/test_simulator.py \
	tests/test_tied_timing.py tests/test_cpu_emulation.py tests/test_megatron_on_cpu.py

# Each pytest run fails if a process it started is still running once it has exited
# (a forkserver, a rank, a checkpoint writer), naming and ending it: tests/support/no_process_left.py.
NO_PROCESS_LEFT := $(PY) tests/support/no_process_left.py

test: setup
	$(NO_PROCESS_LEFT) $(PY) -m pytest -q -x $(QUICK_TESTS) $(PYTEST_ARGS)
	$(NO_PROCESS_LEFT) $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope tests --ignore=tests/gpu \
		--ignore=tests/cluster --ignore=tests/gpu_ranks $(addprefix --ignore=,$(QUICK_TESTS)) $(PYTEST_ARGS)

# A real two-node Slurm on this machine (root; Debian's slurm-wlm, munge, iproute2) and the image
# built and run with podman (Debian's podman, runc, debootstrap): fails, saying why, without them.
test-cluster: setup
	$(PY) -m pytest -q -s tests/cluster $(PYTEST_ARGS)

# The Dockerfile built with podman on a stand-in base from Debian's packages (docker/image.sh);
# MEGATRON_LM_MIRROR=<a git mirror of NVIDIA/Megatron-LM> adds the patched checkout.
image:
	bash docker/image.sh build

# The CI smoke inside the image: a small GPT, 2bw, PP=2 on 2 processes; its loss must fall.
image-smoke:
	bash docker/image.sh smoke

# Skips every test, saying so, where there is no CUDA GPU (tests/gpu/conftest.py).
test-gpu:
	MEGATRON_ASYNC_GPU_REPORT=$(GPU_REPORT) $(GPU_PYTHON) -m pytest -q tests/gpu $(PYTEST_ARGS)

# 2bw's multi-rank paths on real NCCL, 2 and 4 ranks sharing one GPU (a distinct NCCL_HOSTID
# each): tests/gpu_ranks. Skips without CUDA; the -dry target runs the same jobs on the CPU.
# GPU_RANKS_WORKERS cases run at once (pytest-xdist, where GPU_PYTHON has it): the jobs are
# small, and one at a time they outlast a device lease.
GPU_RANKS_WORKERS ?= 4
test-gpu-ranks:
	MEGATRON_ASYNC_GPU_REPORT=$(GPU_REPORT) $(GPU_PYTHON) -m pytest -q tests/gpu_ranks \
		$$($(GPU_PYTHON) -c 'import xdist' 2>/dev/null && printf -- '-n %s --dist load' $(GPU_RANKS_WORKERS)) $(PYTEST_ARGS)

test-gpu-ranks-dry: setup
	MEGATRON_ASYNC_GPU_RANKS_DRY_RUN=1 MEGATRON_ASYNC_GPU_REPORT=out/gpu-dry $(PY) -m pytest -q tests/gpu_ranks $(PYTEST_ARGS)

demo: setup
	bash examples/demo.sh

# Benchmarks (minutes to an hour on 2 cores; results and commands in docs/benchmarks.md)
bench: setup
	$(PY) -m bench.throughput.pipeline_throughput --json out/bench/pipeline_throughput.json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
