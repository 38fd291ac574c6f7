# Template tooling. Each target builds the virtual environment it needs in .venv.
#   make demo        render a demo project and train it on 2 processes (GPUs if present, else CPU)
#   make test        the fast tier: the template's tests and the default project's make test
#   make test-full   every test: the default project's make test-full too (CI: .ci/run)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := build/demo

.PHONY: demo test test-full clean

# Python writes the bytecode of each module the first time one is imported, as it does by
# default: pip installs none (--no-compile), since compiling all of torch, most of which no test
# imports, took a third of the install's time (123 s -> 78 s for both environments, 2 cores).
# Where PYTHONDONTWRITEBYTECODE is set, every process would compile torch again (9 s, not 3).
unexport PYTHONDONTWRITEBYTECODE
# What the tests import in many processes at once is compiled here, once (about 30 s of CPU),
# rather than by each of the processes that start together (torch._dynamo alone takes 8 s).
WARM := torch._dynamo, torch.distributed.run, torch.utils.tensorboard, hydra, matplotlib.pyplot, \
	cookiecutter.main, pytest, xdist, wandb, mlflow

# The two environments install at once: pip spends much of its time waiting on downloads and the
# disk.
# A line every 20 s while they install: pip's quiet unpacking of torch ran silent for 54 s on 2
# loaded cores, and CI counts a minute of silence as a hang.
$(BIN)/.installed: requirements-test.txt requirements-checkov.txt
	$(PYTHON) -m venv $(VENV)
	$(PYTHON) -m venv $(VENV)/checkov
	(while sleep 20; do echo "make: still installing the test environments"; done) & beat=$$!; \
	  $(VENV)/checkov/bin/python -m pip install --quiet --no-compile -r requirements-checkov.txt & checkov=$$!; \
	  $(BIN)/python -m pip install --quiet --upgrade pip \
	  && $(BIN)/python -m pip install --quiet --no-compile -r requirements-test.txt \
	  && $(BIN)/python -c "import $(WARM)"; main=$$?; \
	  wait $$checkov; checkov=$$?; kill $$beat; [ $$main = 0 ] && exit $$checkov; exit $$main
	touch $@

demo: $(BIN)/.installed
	@if [ -d $(DEMO) ]; then echo "make demo: removing the previous demo, $(DEMO)/"; fi
	rm -rf $(DEMO)
	$(BIN)/python new-project --no-input --output-dir $(DEMO)
	$(BIN)/python -m pip install --quiet --no-build-isolation $(DEMO)/ddp-project
	cd $(DEMO) && ../../$(BIN)/ddp-project train --nproc-per-node 2

test: $(BIN)/.installed
	$(BIN)/python -m pytest -m "not slow"

# The API server tests (tests/test_cluster.py) need DDP_TEMPLATE_K8S: .ci/run sets it.
test-full: $(BIN)/.installed
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build
