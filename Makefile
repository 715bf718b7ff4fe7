# The two commands of the README, and their helpers. Everything runs inside .venv.
SHELL  := /bin/bash
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo test bench proto clean check-python check-java

# Python may write its bytecode caches (__pycache__, ignored by git): with
# PYTHONDONTWRITEBYTECODE set, every process the suite, the demo and the benchmarks start
# (cache servers, copy daemons, consumers, Spark's Python workers) compiled the package from
# source again, about 0.25 CPU-seconds each.
unexport PYTHONDONTWRITEBYTECODE

setup: $(STAMP)

check-python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), sys.version' 2>/dev/null || \
	  { echo "pyspark_acs needs Python >= 3.10 with venv: apt-get install -y python3 python3-venv"; exit 1; }

check-java:
	@java -version >/dev/null 2>&1 || \
	  { echo "Spark needs Java 17: apt-get update && apt-get install -y openjdk-17-jre-headless"; exit 1; }

$(STAMP): setup.py | check-python
	@echo "setting up $(VENV): pip installs pyspark (about 400 MB) and the test tools; one line per package follows"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	set -o pipefail; $(BIN)/pip install --progress-bar off --config-settings editable_mode=compat -e '.[test]' \
	  | { grep --line-buffered -E '^(Collecting|Successfully installed)' || true; }
	@touch $(STAMP)
	@echo "$(VENV) is ready: the commands (acs, acs-cache-server, ...) are in $(BIN); '. $(BIN)/activate' puts them on PATH"

# 1. Set up and run the main job: the end-to-end demo on an embedded local deployment.
demo: setup check-java
	$(BIN)/python examples/demo.py

# 2. Set up and run the tests: the whole suite, on TEST_WORKERS processes (pytest-xdist). The
# tests mostly wait on servers and Spark, so five workers keep 2 cores busy (four left them idle
# at times); tests tied together (a module's servers, each of the two Spark sessions, the serial
# group) share a worker (tests/conftest.py). TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 5
test: setup check-java
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# Benchmarks print figures and ratios against peers run in the same process (redis-server for
# the cache: apt-get install -y redis-server; without it that comparison is skipped with a note).
bench: setup check-java
	$(BIN)/pip install --quiet --progress-bar off "redis[hiredis]" matplotlib  # the bench extra, without reinstalling the package
	$(BIN)/python benchmarks/produce_consume.py
	$(BIN)/python benchmarks/cache_throughput.py
	$(BIN)/python benchmarks/fanout.py
	$(BIN)/python benchmarks/copy_hops.py
	$(BIN)/python benchmarks/spark_source.py

# Regenerate the gRPC/protobuf code beside each .proto (never edit it by hand).
proto: setup
	PYTHON=$(BIN)/python scripts/gen_proto.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
