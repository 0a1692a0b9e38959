# Two commands do all the set-up on a fresh Debian 12 machine (as root):
#   make demo   - virtual environment, hpcdist, then smoke, train (~3 min) and generate on the local site
#   make test   - the above plus Debian packages, the local Slurm cluster (and its three variants) and its container image, then the suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hpcdist-installed
# Two pytest processes: the tests that use the Slurm cluster one at a time in one xdist group
# (tests/support/fixtures.py), the rest beside them. PYTEST=-q runs everything in one process.
PYTEST ?= -q --durations=15 -n 2 --dist loadgroup

.PHONY: demo test install system-deps cluster-up cluster-down image lint clean gpu-check

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

# pip's editable install leaves hpcdist's own modules uncompiled; where PYTHONDONTWRITEBYTECODE is set
# (as on this machine), every command then compiled them from source: `hpcdist render` took about 1.4x
# the import of its libraries instead of 1.3x (docs/performance.md). Quick when nothing changed.
install: system-deps $(STAMP)
	$(PY) -m compileall -q hpcdist

# The demo: smoke job, a token file from this repo's README and docs and Python's own documentation
# (pydoc_data, on every install: nothing downloaded), ~3 minutes of training on 2 local ranks with
# its progress line, generation from the checkpoint it wrote, then both reports and the loss curve
# as a PNG. Its specs are jobs/demo_train.yaml and jobs/demo_infer.yaml; it starts afresh each time.
DEMO := hpcdist-out/demo
demo: install
	$(VENV)/bin/hpcdist submit jobs/smoke.yaml --site local --wait
	mkdir -p hpcdist-out/data $(DEMO)
	$(PY) -c 'from pydoc_data.topics import topics; print("\n\n".join(topics.values()))' > hpcdist-out/data/python-docs.txt
	$(VENV)/bin/hpcdist data prepare README.md docs/*.md hpcdist-out/data/python-docs.txt -o hpcdist-out/data/demo_tokens.h5
	rm -rf hpcdist-out/checkpoints/demo_gpt
	$(VENV)/bin/hpcdist submit jobs/demo_train.yaml --site local --wait
	$(VENV)/bin/hpcdist submit jobs/demo_infer.yaml --site local --wait
	$(VENV)/bin/hpcdist report $$(ls -t hpcdist-out/results/demo_gpt/*.h5 | head -n 1) --plot $(DEMO)
	$(VENV)/bin/hpcdist report $$(ls -t hpcdist-out/results/demo_infer/*.h5 | head -n 1)

# The main cluster, then the three variant clusters beside it (cluster/README.md, "Variants"), which
# use its munged, slurmdbd and the accounts users.sh makes, then Slurm 24.11 ("Releases": its root
# debootstrapped once, about a minute; its own slurmdbd on the main cluster's MariaDB and munged);
# then the login node's sshd on loopback that a "laptop" submits through (cluster/sshd.sh, docs/laptop.md).
cluster-up: system-deps
	bash cluster/up.sh
	bash cluster/variants.sh up
	bash cluster/releases.sh up
	bash cluster/sshd.sh up

cluster-down:
	bash cluster/sshd.sh down
	bash cluster/releases.sh down
	bash cluster/variants.sh down
	bash cluster/down.sh

# The Charliecloud image the container tests run ranks in (cluster/README.md): built once, then
# only hpcdist's layer again when the checkout's hpcdist changed (about a second when nothing did).
IMAGE ?= /var/tmp/hpcdist-images/bookworm
image: system-deps | $(PY)
	PYTHON=$(PY) bash cluster/image.sh $(IMAGE)

test: install cluster-up image lint
	HPCDIST_REQUIRE_SLURM=1 $(PY) -m pytest $(PYTEST) tests

# The benchmarks are type-checked too: no test runs them, and a changed call inside hpcdist would
# otherwise stop the command a figure in docs/performance.md is reproduced with.
lint: $(STAMP)
	$(VENV)/bin/ruff check hpcdist hydra_plugins tests benchmarks
	$(VENV)/bin/mypy hpcdist
	$(VENV)/bin/mypy --explicit-package-bases hydra_plugins
	$(VENV)/bin/mypy --explicit-package-bases benchmarks

# Every GPU path on a machine with one GPU and no network (< 10 min); "no GPU" and exit 2 elsewhere.
# The first python whose torch sees a GPU: the machine's own (GPU machines carry their own torch)
# before .venv, whose torch is the CPU wheel; wheels for what lacks: .whl/
GPU_PY ?= $(shell for p in python3 $(PY); do $$p -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
	>/dev/null 2>&1 && { echo $$p; exit 0; }; done; echo python3)
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py

clean:
	rm -rf hpcdist-out
