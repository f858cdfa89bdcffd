# Developer entry points. `make run` and `make test` set up .venv on a fresh machine first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DISTRIBUTIONS := -e '.[test,docs]' -e ./miles_plugins_megatron -e ./miles_plugins_sglang -e ./miles_plugins_rdt \
	-e ./plugins/miles_example_transfer -e ./plugins/miles_example_hooks -e ./plugins/miles_example_estimator
PYPROJECTS := pyproject.toml constraints.txt $(wildcard miles_plugins_*/pyproject.toml plugins/*/pyproject.toml)

.PHONY: setup sglang browser install run test wheels lint docs bench clean

setup: $(STAMP)

# Every distribution of the repository, editable, in one environment; torch pinned to the CPU build on disk.
$(STAMP): $(PYPROJECTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt $(DISTRIBUTIONS)
	touch $(STAMP)

# A real SGLang server for CPU in an environment of its own (sglang pins its own torch and transformers), from the
# registries and the recipe in tools/sglang-cpu (install script, the CPU kernel's source). A prebuilt kernel wheel in
# ../shared/sglang-cpu (or $SGLANG_KERNEL_CACHE) is used as a cache; without one the kernel is built from its source.
# The sglang plugin finds the environment (sglang.python: auto) as .venv-sglang of the checkout, or from anywhere
# else through the interpreter recorded in ~/.config/miles/sglang-python ($XDG_CONFIG_HOME).
SGLANG_VENV := .venv-sglang
SGLANG_RECORD = $${XDG_CONFIG_HOME:-$$HOME/.config}/miles/sglang-python
SGLANG_RECIPE := tools/sglang-cpu
SGLANG_STAMP := $(SGLANG_VENV)/.installed
sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(SGLANG_RECIPE)/install.sh $(SGLANG_RECIPE)/sglang-deps-cpu.txt
	rm -rf $(SGLANG_VENV)
	bash $(SGLANG_RECIPE)/install.sh $(SGLANG_VENV)
	mkdir -p "$$(dirname "$(SGLANG_RECORD)")" && echo "$(abspath $(SGLANG_VENV))/bin/python" > "$(SGLANG_RECORD)"
	touch $(SGLANG_STAMP)

# Debian's Chromium for the dashboard's browser test (Playwright drives it; it downloads no browser).
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser: $(CHROMIUM)

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium

# Every environment the tests use; `make -j3 install` builds them at once (CI does).
install: setup browser sglang

run: setup
	$(BIN)/miles train

# Three passes (tests/conftest.py marks them by path): the tests that overlap freely, on TEST_WORKERS workers; then the
# serial tests marked paired (whole learning runs, runs across hosts: no short deadline) two at a time, a file to a
# worker; then the other serial tests (RPC and heartbeat deadlines, kill-and-count, real SGLang) one at a time.
# Files go out in collection order (--no-loadscope-reorder; pytest-xdist would otherwise hand out the files with the
# most tests first, and a file of three long learning runs last): tests/conftest.py puts the longest first.
# Every pass runs; any failing fails.
TEST_WORKERS ?= 2
test: setup browser sglang
	$(BIN)/python -m pytest -m "not serial" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; parallel=$$?; \
	$(BIN)/python -m pytest -m "serial and paired" -n 2 --dist loadgroup --no-loadscope-reorder; paired=$$?; \
	$(BIN)/python -m pytest -m "serial and not paired"; serial=$$?; \
	test $$parallel -eq 0 -a $$paired -eq 0 -a $$serial -eq 0

# Installed as users install it: every distribution's wheel in a fresh environment, run from outside the checkout.
wheels: setup
	.ci/wheels

lint: setup
	$(BIN)/ruff check .

# The documentation site (mkdocs.yml) into site/; --strict: a broken link, anchor or API reference fails the build.
# The CLI flags page is generated from the config models while it builds (tools/docs/gen_cli_reference.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict

bench: setup
	$(BIN)/python benchmarks/cli_startup.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) site
