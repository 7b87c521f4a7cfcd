# The README's two commands are `make demo` and `make test`; both set up .venv from scratch on a
# machine with only Python 3.11, pip, gcc/g++ and cmake.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-installed
CXX_SOURCES := $(shell find csrc tests -name '*.cpp' -o -name '*.h' 2>/dev/null)

.PHONY: demo test test-lowest lint format sanitize header-check ext clean docs

$(STAMP): requirements-dev.txt
	@mkdir -p build
	@echo "creating $(VENV) with requirements-dev.txt (log: build/deps.log)"
	@{ $(PYTHON) -m venv $(VENV) && $(PY) -m pip install --quiet --upgrade pip \
	  && $(PY) -m pip install --quiet -r requirements-dev.txt; } >build/deps.log 2>&1 \
	  || { cat build/deps.log; echo "make: creating $(VENV) failed (log above)"; exit 1; }
	@touch $@

EDITABLE := $(VENV)/.editable-installed

# Register the package in the venv once (editable: the source tree is what runs). Its output goes
# to a log, printed only when the step fails.
$(EDITABLE): $(STAMP) setup.py pyproject.toml
	@mkdir -p build
	@echo "installing ascend_vlm in $(VENV) (editable; log: build/install.log)"
	@$(PY) -m pip install --quiet --no-build-isolation --no-deps -e . >build/install.log 2>&1 \
	  || { cat build/install.log; echo "make: installing ascend_vlm failed (log above)"; exit 1; }
	@touch $@

# (Re)build the C++ extension in place, only when a C++ source or the build files are newer than
# the last build (or no extension is there): a re-run with nothing to build prints nothing.
EXT_STAMP := build/.ext-built
EXT_SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' 2>/dev/null) CMakeLists.txt setup.py
ifeq ($(wildcard ascend_vlm/_C*.so),)
.PHONY: $(EXT_STAMP)
endif

ext: $(EXT_STAMP)

$(EXT_STAMP): $(EDITABLE) $(EXT_SOURCES)
	@mkdir -p build
	@echo "building the C++ extension (log: build/ext.log)"
	@$(PY) setup.py --quiet build_ext --inplace >build/ext.log 2>&1 \
	  || { cat build/ext.log; echo "make: building the C++ extension failed (log above)"; exit 1; }
	@touch $@

demo: ext
	$(PY) -m ascend_vlm demo

test: ext
	$(PY) -m pytest

# The documentation site (docs/, mkdocs.yml) into site/; warnings fail the build.
docs: $(EDITABLE)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The family and patching tests again on the lowest supported transformers (the venv has the newest
# tested one): requirements-lowest.txt goes into a folder beside the venv, first on PYTHONPATH.
LOWEST := $(VENV)/transformers-lowest

$(LOWEST)/.installed: requirements-lowest.txt $(STAMP)
	rm -rf $(LOWEST)
	$(PY) -m pip install --quiet --no-deps --target $(LOWEST) -r requirements-lowest.txt
	touch $@

test-lowest: ext $(LOWEST)/.installed
	PYTHONPATH=$(LOWEST) $(PY) -m pytest -q tests/models tests/patching tests/pruning tests/quantization tests/reuse tests/batching/test_batch_generator.py tests/observability tests/commands/test_explain_cli.py tests/adapters tests/test_compat.py

# Commit subjects are at most 72 characters from this commit on (older history is published
# as it is; rewriting it would break every clone).
SUBJECTS_SINCE := efe7261

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)
	@long=$$(git log --format=%s $(SUBJECTS_SINCE)..HEAD 2>/dev/null | awk 'length > 72'); \
	if [ -n "$$long" ]; then echo "commit subjects over 72 characters:"; echo "$$long"; exit 1; fi

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

clean:
	rm -rf build ascend_vlm/_C*.so *.egg-info

# ASan+UBSan build of the extension and the C++ driver (all checks), then a TSan build of the
# driver's stream stress. Separate build trees under build-sanitize/; any report fails the run.
SANITIZE_DIR := build-sanitize
SANITIZE_CMAKE := cmake -S . -DCMAKE_BUILD_TYPE=Debug -DASCEND_VLM_FORCE_SIM=ON \
	-DASCEND_VLM_BUILD_TESTS=ON

sanitize: $(STAMP)
	$(SANITIZE_CMAKE) -B $(SANITIZE_DIR)/asan -DASCEND_VLM_SANITIZE=address,undefined \
		-DPython_EXECUTABLE=$(abspath $(PY)) \
		-Dpybind11_DIR="$$($(PY) -c 'import pybind11; print(pybind11.get_cmake_dir())')"
	cmake --build $(SANITIZE_DIR)/asan --parallel 2 --target runtime_stress _C
	ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		$(SANITIZE_DIR)/asan/runtime_stress all
	$(SANITIZE_CMAKE) -B $(SANITIZE_DIR)/tsan -DASCEND_VLM_SANITIZE=thread \
		-DASCEND_VLM_BUILD_EXTENSION=OFF
	cmake --build $(SANITIZE_DIR)/tsan --parallel 2 --target runtime_stress
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $(SANITIZE_DIR)/tsan/runtime_stress stress

# Compiles csrc/runtime and the C++ driver against AscendCL declaration stubs of two CANN eras
# (tests/cpp/cann_headers: 8.0 without host registration, 8.1 with it), so one source keeps
# building on every supported CANN. Syntax only: nothing is linked.
HEADER_CHECK_SOURCES := $(wildcard csrc/runtime/*.cpp) tests/cpp/runtime_stress.cpp

header-check: $(STAMP)
	for era in 8.0 8.1; do \
		for source in $(HEADER_CHECK_SOURCES) csrc/bindings.cpp; do \
			$(CXX) -std=c++17 -Wall -Wextra -Werror -fsyntax-only -DASCEND_VLM_BACKEND_CANN \
				-DASCEND_VLM_VERSION='"header-check"' \
				-Itests/cpp/cann_headers/$$era -Itests/cpp/cann_headers/common -Icsrc \
				$$($(PY) -m pybind11 --includes) $$source || exit 1; \
		done; \
	done
