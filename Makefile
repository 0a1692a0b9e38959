# Two commands do all the set-up on a fresh Debian 12 machine (as root):
#   make demo   - virtual environment, hpcdist, then smoke, train and generate on the local site
#   make test   - the above plus Debian packages and the local Slurm cluster, then the suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hpcdist-installed
PYTEST ?= -q --durations=15

.PHONY: demo test install system-deps cluster-up cluster-down lint clean gpu-check

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is pinned here (the CPU wheel on disk); the package itself asks for a range.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[mpi,dev]'
	touch $@

system-deps:
	bash cluster/install-deps.sh

install: system-deps $(STAMP)

# The demo: smoke job, a token file from this repo's own text, a short training, then
# generation from the checkpoint that training wrote (all on the local site, 2 ranks).
demo: install
	$(VENV)/bin/hpcdist submit jobs/smoke.yaml --site local --wait
	$(VENV)/bin/hpcdist data prepare README.md $(wildcard hpcdist/*.py hpcdist/*/*.py) -o hpcdist-out/data/tokens.h5
	$(VENV)/bin/hpcdist submit jobs/train_gpt.yaml --site local --wait
	$(VENV)/bin/hpcdist submit jobs/infer_gpt.yaml --site local --wait
	$(VENV)/bin/hpcdist report $$(ls -t hpcdist-out/results/infer_gpt/*.h5 | head -n 1)

cluster-up: system-deps
	bash cluster/up.sh

cluster-down:
	bash cluster/down.sh

test: install cluster-up lint
	HPCDIST_REQUIRE_SLURM=1 $(PY) -m pytest $(PYTEST) tests

lint: $(STAMP)
	$(VENV)/bin/ruff check hpcdist tests
	$(VENV)/bin/mypy hpcdist

# Every GPU path on a machine with one GPU and no network (< 10 min); "no GPU" and exit 2 elsewhere.
# Uses the python that is there (GPU machines carry their own torch); wheels for what lacks: .whl/
GPU_PY ?= $(shell test -x $(PY) && echo $(PY) || echo python3)
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py

clean:
	rm -rf hpcdist-out
