# megafp8: set-up, demo, tests, lint and benchmarks.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
# A CPU-only torch comes without Triton; this one lets the tests compile every Triton kernel for
# sm_90 without a GPU (tests/unit/test_kernels_compile.py). A CUDA torch keeps its own.
TRITON_SPEC ?= triton==3.5.0
PYTEST_ARGS ?=
DEMO_DIR ?= demo
STAMP := .setup.stamp

.PHONY: setup demo test test-gpu lint bench bench-preprocess clean

# Install torch only where none is present (a GPU cluster keeps its own build), then the package.
$(STAMP): pyproject.toml
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	@if $(PYTHON) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(PYTHON) -c "import triton" 2>/dev/null || $(PYTHON) -m pip install -q "$(TRITON_SPEC)"; fi
	$(PYTHON) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PYTHON) data_tools/demo.py --out $(DEMO_DIR)

# pytest exits 5 when it collected no test: that is a failure here, like any other non-zero code.
test: $(STAMP)
	DS_ACCELERATOR=cpu $(PYTHON) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: no tests were collected"; exit 1; fi; exit $$rc

test-gpu: $(STAMP)
	$(PYTHON) -m pytest -q -m gpu tests/gpu

# Lint and formatting over every Python file; CI runs this before the tests.
lint: $(STAMP)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

bench: $(STAMP)
	$(PYTHON) bench/gpu_step.py

bench-preprocess: $(STAMP)
	$(PYTHON) bench/preprocess.py

clean:
	rm -rf $(DEMO_DIR) runs $(STAMP) .pytest_cache
