# The two README commands: `make serve` (the local Serve app, default model) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench-sched clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first and pinned, so nothing below pulls a different build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Local Ray + the disaggregated app on the built-in default model: gRPC :9000, HTTP :8000.
# Extra flags: make serve ARGS="--transport grpc --decode-replicas 2".
serve: $(STAMP)
	$(VENV)/bin/pdserve serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Two workers (pytest-xdist): the tests that start Ray keep to one of them, in order
# (tests/conftest.py); unit, model and process tests share the other.
test: $(STAMP) lint
	$(PY) -m pytest -q -n 2

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
