# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install ssh-server tmux test test-fast demo bench bench-net scale gpu-check soak lint clean

install: $(STAMP) ssh-server tmux

# tests/test_remote.py runs a throwaway sshd on loopback. Install it when it is
# missing and we are root on Debian/Ubuntu; otherwise those tests skip.
ssh-server:
	@if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing openssh-server for the ssh tests"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq openssh-server openssh-client >/dev/null) \
	      || echo "warning: could not install openssh-server; the ssh tests will skip"; \
	  else \
	    echo "note: sshd not found; the ssh tests will skip"; \
	  fi; \
	fi

# tests/test_ctl.py runs `elasticctl top` in a real terminal (tmux). Installed like sshd;
# without it that part skips, saying so.
tmux:
	@if ! command -v tmux >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing tmux for the elasticctl top test"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux \
	      >/dev/null) || echo "warning: could not install tmux; the elasticctl top test will skip"; \
	  else \
	    echo "note: tmux not found; the elasticctl top test will skip"; \
	  fi; \
	fi

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned exactly: a looser spec pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0 numpy cloudpickle filelock xxhash pytest matplotlib
	# The cluster tests: PyYAML parses the Kubernetes examples; ray runs elastic.ray on a local cluster.
	$(PY) -m pip install -q pyyaml "ray>=2.9"
	# --metrics-port and --tensorboard (tests/test_metrics.py).
	$(PY) -m pip install -q "prometheus_client>=0.20" tensorboard
	# HF Accelerate: tests/test_accelerate.py runs it inside @elastic.run (docs/torchrun.md).
	$(PY) -m pip install -q accelerate==1.15.0
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests -m "not slow"

demo: install
	OMP_NUM_THREADS=1 $(PY) examples/demo.py

bench: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/run.py

# Sync and DDP between hosts of their own (network namespaces, links shaped with tc tbf;
# needs root, else it prints one line and exits 0): docs/benchmarks.md.
bench-net: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/net_bench.py

# The real driver against 256, 1,024 and 4,096 simulated workers (not part of `make test`,
# which runs a 12-worker version: tests/test_scale.py), then the driver's decisions alone.
scale: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/scale.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/decide_bench.py

# The GPU path on a lent GPU machine: one prepared run of at most 5 minutes.
gpu-check: install
	OMP_NUM_THREADS=1 timeout 300 $(PY) benchmarks/gpu_check.py

# One job through 200+ membership changes of every kind (not part of `make test`,
# which runs a short seeded version: tests/test_soak.py).
soak: install
	OMP_NUM_THREADS=1 $(PY) tests/support/soak.py --changes 200 --seed 1

# Needs only a Python with pip: the venv, ruff and mypy are installed here if missing.
# mypy is pinned exactly (a new release brings new errors); its settings are in setup.cfg.
MYPY_VERSION := 1.18.2
LINT_STAMP := $(VENV)/.lint-$(MYPY_VERSION)

$(LINT_STAMP): $(STAMP)
	$(PY) -m pip install -q ruff mypy==$(MYPY_VERSION)
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(PY) -m ruff check elastic tests examples benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info
