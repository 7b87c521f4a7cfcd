# The README's two commands are `make demo` and `make test`; both set up .venv from scratch on a
# machine with only Python 3.11, pip, gcc/g++ and cmake.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-installed
CXX_SOURCES := $(shell find csrc tests -name '*.cpp' -o -name '*.h' 2>/dev/null)

.PHONY: demo test lint format sanitize ext clean

$(STAMP): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# (Re)build the C++ extension in place and register the package in the venv (editable).
ext: $(STAMP)
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	$(PY) setup.py --quiet build_ext --inplace

demo: ext
	$(PY) -m ascend_vlm demo

test: ext
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

clean:
	rm -rf build ascend_vlm/_C*.so *.egg-info
