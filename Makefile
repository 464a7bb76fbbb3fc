# sparknet: `make demo` runs the main job locally, `make test` runs the tests.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch first, pinned: these builds install from local files here; any other would be a download.
TORCH  := torch==2.14.1 torchvision==0.29.1

.PHONY: install demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v java >/dev/null || { echo "error: Spark needs Java 17+ (apt-get install -y openjdk-17-jre-headless)"; exit 2; }
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: install
	$(VENV)/bin/sparknet train --data digits --workers 2

test: install
	$(VENV)/bin/pytest -q

lint: install
	$(VENV)/bin/ruff check sparknet tests benchmarks
	$(VENV)/bin/ruff format --check sparknet tests benchmarks

bench: install
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
