# Template tooling. Both targets build their own virtual environment in .venv.
#   make demo   render a demo project and train it on 2 processes (GPUs if present, else CPU)
#   make test   run every test of the template (CI runs this through .ci/run)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := build/demo

.PHONY: demo test clean

# The two environments install at once (46 s instead of 74 on 2 cores): pip spends much of its
# time waiting on downloads and the disk.
$(BIN)/.installed: requirements-test.txt requirements-checkov.txt
	$(PYTHON) -m venv $(VENV)
	$(PYTHON) -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/python -m pip install --quiet -r requirements-checkov.txt & checkov=$$!; \
	  $(BIN)/python -m pip install --quiet --upgrade pip \
	  && $(BIN)/python -m pip install --quiet -r requirements-test.txt; main=$$?; \
	  wait $$checkov && exit $$main
	touch $@

demo: $(BIN)/.installed
	@if [ -d $(DEMO) ]; then echo "make demo: removing the previous demo, $(DEMO)/"; fi
	rm -rf $(DEMO)
	$(BIN)/python new-project --no-input --output-dir $(DEMO)
	$(BIN)/python -m pip install --quiet --no-build-isolation $(DEMO)/ddp-project
	cd $(DEMO) && ../../$(BIN)/ddp-project train --nproc-per-node 2

test: $(BIN)/.installed
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build
