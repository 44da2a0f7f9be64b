# Two commands: `make demo` (start the stack on CPU and stream a generation) and `make test`.
# Both install everything into .venv first; only Python >= 3.11 and make are needed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(shell find protos -name '*.proto')
STUBS := protos/ddtree/v1/generation_pb2.py

.PHONY: demo test install protos kernels-check clean

install: $(STAMP) $(STUBS)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 required"'
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned, so the CPU wheel is taken where one is on disk (never a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Stubs are build outputs of the .proto files (git ignores them; tests/test_protos.py checks freshness).
$(STUBS): $(PROTOS) $(STAMP)
	$(PY) -m service_kit.protogen

protos: $(STAMP)
	$(PY) -m service_kit.protogen

demo: install
	$(PY) -m service_kit.demo

test: install
	$(PY) -m pytest -q -m 'not gpu'

kernels-check: install
	$(VENV)/bin/ddtree kernels check --arch sm_90 --arch sm_120

clean:
	rm -rf $(VENV) build *.egg-info
	find protos -name '*_pb2*.py*' -delete
