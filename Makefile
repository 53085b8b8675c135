# The two README commands are `make serve` (once the Serve app lands) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint bench-sched clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first and pinned, so nothing below pulls a different build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: $(STAMP) lint
	$(PY) -m pytest -q

bench-sched: $(STAMP)
	$(VENV)/bin/pdserve bench sched

clean:
	rm -rf $(VENV) build *.egg-info

# Regenerate the gRPC/protobuf modules (committed to the tree). Run from the repository root so
# the generated code imports `from protos.pdserve.v1 import ...`. Generated files are outside
# ruff (extend-exclude) and mypy (overrides) by configuration.
.PHONY: protos
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/pdserve/v1/*.proto
