# Developer entry points. `make run` and `make test` set up .venv on a fresh machine first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DISTRIBUTIONS := -e '.[test]' -e ./miles_plugins_megatron -e ./miles_plugins_sglang -e ./miles_plugins_rdt \
	-e ./plugins/miles_example_transfer -e ./plugins/miles_example_hooks
PYPROJECTS := pyproject.toml constraints.txt $(wildcard miles_plugins_*/pyproject.toml plugins/*/pyproject.toml)

.PHONY: setup sglang browser install run test lint bench clean

setup: $(STAMP)

# Every distribution of the repository, editable, in one environment; torch pinned to the CPU build on disk.
$(STAMP): $(PYPROJECTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt $(DISTRIBUTIONS)
	touch $(STAMP)

# A real SGLang server for CPU in an environment of its own (sglang pins its own torch and transformers), from the
# registries and the CPU kernel in ../shared/sglang-cpu. The sglang plugin finds it as .venv-sglang (sglang.python).
SGLANG_VENV := .venv-sglang
SGLANG_CPU ?= $(firstword $(wildcard ../shared/sglang-cpu /work/shared/sglang-cpu))
SGLANG_STAMP := $(SGLANG_VENV)/.installed
sglang: $(SGLANG_STAMP)

ifeq ($(SGLANG_CPU),)
$(SGLANG_STAMP):
	@echo "make sglang: no sglang-cpu folder (../shared/sglang-cpu: install.sh and the CPU kernel wheel);" \
		"set SGLANG_CPU=DIR to one" >&2; exit 1
# Without the folder the tests still run; the real-SGLang ones skip, saying that the environment is missing.
TEST_SGLANG :=
else
TEST_SGLANG := sglang
$(SGLANG_STAMP): $(SGLANG_CPU)/install.sh $(SGLANG_CPU)/sglang-deps-cpu.txt
	rm -rf $(SGLANG_VENV)
	bash $(SGLANG_CPU)/install.sh $(SGLANG_VENV)
	touch $(SGLANG_STAMP)
endif

# Debian's Chromium for the dashboard's browser test (Playwright drives it; it downloads no browser).
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser: $(CHROMIUM)

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium

# Every environment the tests use; `make -j3 install` builds them at once (CI does).
install: setup browser $(TEST_SGLANG)

run: setup
	$(BIN)/miles train

# Two passes: the tests marked serial (tests/conftest.py: CPU-heavy, or with deadlines a loaded machine could miss)
# run one at a time after the others, which run on TEST_WORKERS workers. Both passes run; either failing fails.
TEST_WORKERS ?= 2
test: setup browser $(TEST_SGLANG)
	$(BIN)/python -m pytest -m "not serial" -n $(TEST_WORKERS) --dist loadfile; parallel=$$?; \
	$(BIN)/python -m pytest -m serial; serial=$$?; \
	test $$parallel -eq 0 -a $$serial -eq 0

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/cli_startup.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV)
