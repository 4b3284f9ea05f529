# Two commands on a fresh machine: `make test` and `make example`.
PYTHON ?= python3.11
VENV ?= .venv
# The CPU wheel that lies on these machines; GPU users: make TORCH_SPEC='torch>=2.2' ...
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH_SPEC)' | tr -c 'a-zA-Z0-9.' '_')
# Executors run the virtualenv's Python; everything binds to loopback; settings from conf/.
RUN := PYSPARK_PYTHON=$(abspath $(BIN))/python PYSPARK_DRIVER_PYTHON=$(abspath $(BIN))/python \
       SPARK_LOCAL_IP=127.0.0.1 SPARK_CONF_DIR=$(abspath conf)

.PHONY: test test-slow test-compat test-all example examples example-submit bench bench-scale bench-launch bench-precision bench-ingest params clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

test: $(STAMP)  ## lints (ruff) and type-checks the package and the examples (mypy), then the suite without the slow tests (about 14 minutes on 2 cores from nothing, 12 of them tests)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy
	$(RUN) $(BIN)/python -m pytest -m "not slow" --durations=15 tests

test-slow: $(STAMP)  ## only the slow tests: local-cluster, standalone + spark-submit, Connect, examples, the benchmarks' smoke runs, a few long end-to-end runs, the tests that start a process or a session of their own (about 29 minutes on 2 idle cores)
	$(RUN) $(BIN)/python -m pytest -m slow tests

test-compat:  ## the support matrix: a virtualenv per Databricks ML runtime (cached in ~/.cache/spark-torch-est/compat, about 5 GB each), the package installed as a user would, and the unit tests and the compat tests in each; ROWS="15.4 newest" for some rows, MARKS=compat for the compat tests alone
	$(PYTHON) scripts/compat.py $(ROWS) $(if $(MARKS),--marks "$(MARKS)")

test-all: $(STAMP)
	$(RUN) $(BIN)/python -m pytest tests

example: $(STAMP)  ## the main example on local[*]
	$(RUN) $(BIN)/python examples/train_regression.py

examples: $(STAMP)  ## all examples: regression, classifier, recommender, text, images, custom loop, notebook, tuning, Optuna, large model, LightningModule
	for script in train_regression train_classifier recommender text_classifier image_classifier custom_training \
	        notebook tune optuna_tune large_model lightning_module; do $(RUN) $(BIN)/python examples/$$script.py || exit 1; done

example-submit: $(STAMP)  ## the same example through spark-submit
	$(RUN) $(BIN)/spark-submit examples/train_regression.py

# make bench BASELINE=<checkout>: the suite and the launch table also run on that checkout's package, side by side
AGAINST = $(if $(BASELINE),--baseline $(BASELINE))

bench: $(STAMP)  ## side by side: the suite (plain torch, bare DDP, TorchDistributor, typed inputs, 4M-row ingest), the growth table, the launch table, the hook overhead, tuning, fit many ingest once, a fit's fixed cost on small data (about 20 minutes on 2 idle cores, estimated from its parts, plus the launch table: 14 minutes with BASELINE at load 2-20)
	$(RUN) $(BIN)/python -m benchmarks $(AGAINST)
	$(RUN) $(BIN)/python -m benchmarks.scale
	$(RUN) $(BIN)/python -m benchmarks.launch $(AGAINST)
	$(RUN) $(BIN)/python -m benchmarks.hook_overhead
	$(RUN) $(BIN)/python -m benchmarks.tuning
	$(RUN) $(BIN)/python -m benchmarks.ingest_once
	$(RUN) $(BIN)/python -m benchmarks.fixed_cost

bench-ingest: $(STAMP)  ## only fit many, ingest once: first, second and third fits with and without kept rows, and a CrossValidator, at 4M rows (about 6 minutes on 2 idle cores)
	$(RUN) $(BIN)/python -m benchmarks.ingest_once

bench-scale: $(STAMP)  ## only the growth table: call to first step against pyarrow's read, 0.5M to 8M rows (about 2 minutes on 2 idle cores)
	$(RUN) $(BIN)/python -m benchmarks.scale

bench-launch: $(STAMP)  ## only the launch table (issue 43): first fit through Spark against Spark's scan, the peak RSS while rows are laid out (2M and 4M rows, 2 and 3 ranks), 16 ranks cold; BASELINE=<checkout> runs it side by side with another checkout
	$(RUN) $(BIN)/python -m benchmarks.launch $(AGAINST)

bench-precision: $(STAMP)  ## the loop under precision 32 and bf16-mixed, compiled or not, against plain torch (CPU, about 15 minutes on 2 cores, estimated)
	$(RUN) $(BIN)/python -m benchmarks.precision

params: $(STAMP)  ## regenerates spark_torch_est/params/{columns,training,runtime}.py and tuning/halving_params.py from the Param table (spark_torch_est/params/table.py, docs/params.md)
	$(BIN)/python -m spark_torch_est.params.codegen

clean:
	rm -rf $(VENV) .pytest_cache spark-warehouse
