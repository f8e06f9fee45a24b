# kvmesh — the one entry point: deps, build, test, demo, bench, fmt, lint, clean.
#
# Plain GNU make, no generator: every component directory is a static library, every
# tests/unit/test_*.c a Criterion binary. SIMD files are named *_avx2.c / *_avx512.c and get
# their own -m flags; which one runs is decided at run time (kernels/kernels.h).
# `make SAN=1` builds everything with AddressSanitizer + UBSan under build/san/, `make TSAN=1`
# with ThreadSanitizer under build/tsan/. assert() is on in every build (nothing defines NDEBUG):
# the invariants it checks are O(1) and never depend on outside input.

SHELL := /bin/bash
CC ?= cc
ifeq ($(CC),cc)
CC := gcc
endif

SAN ?= 0
TSAN ?= 0
ifeq ($(SAN),1)
BUILD ?= build/san
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
OPT ?= -O1 -g
else ifeq ($(TSAN),1)
BUILD ?= build/tsan
SANFLAGS := -fsanitize=thread -fno-omit-frame-pointer
OPT ?= -O1 -g
# Criterion's runner cannot start under ThreadSanitizer: tests build against tests/tsan's
# stand-in header and runner instead (tests/tsan/criterion/criterion.h says why).
SANINC := -Itests/tsan
else
BUILD ?= build
SANFLAGS :=
OPT ?= -O2 -g
endif

WARN := -Wall -Wextra -Wno-unused-parameter -Wshadow -Wvla -Werror=implicit-function-declaration
CFLAGS_BASE := -std=gnu11 $(OPT) $(WARN) -I. $(SANINC) -pthread -fPIC -MMD -MP $(SANFLAGS) $(EXTRA_CFLAGS)
AVX2_FLAGS := -mavx2 -mfma -mf16c
AVX512_FLAGS := -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16
LDLIBS := -lczmq -lzmq -lsodium -lmsgpackc -luv -lh2o -ljansson -lxxhash -lssl -lcrypto -lm -pthread
LDFLAGS := $(SANFLAGS)

OBJ := $(BUILD)/obj
BIN := build/bin
ifneq ($(SAN)$(TSAN),00)
BIN := $(BUILD)/bin
endif
TESTBIN := $(BUILD)/tests

# ------------------------------------------------------------------ sources
COMMON_SRC  := $(wildcard common/*.c)
MODEL_SRC   := $(wildcard model/*.c)
KERNELS_SRC := $(wildcard kernels/*.c kernels/cpu/*.c)
KVSHARD_SRC := $(wildcard kvshard/*.c)
PEER_SRC    := $(wildcard peer/*.c)
ENGINE_SRC  := $(wildcard engine/*.c)
WORKER_SRC  := $(filter-out worker/main.c,$(wildcard worker/*.c))
CLIENT_SRC  := $(wildcard client/*.c)
CLI_SRC     := $(wildcard cli/*.c)
ROUTER_SRC  := $(filter-out router/main.c,$(wildcard router/*.c))
CONTROLLER_SRC := $(filter-out controller/main.c,$(wildcard controller/*.c))

LIB_COMMON  := $(BUILD)/lib/libkmcommon.a
LIB_MODEL   := $(BUILD)/lib/libkmmodel.a
LIB_KERNELS := $(BUILD)/lib/libkmkernels.a
LIB_KVSHARD := $(BUILD)/lib/libkvshard.a
LIB_PEER    := $(BUILD)/lib/libkmpeer.a
LIB_ENGINE  := $(BUILD)/lib/libkmengine.a
LIB_WORKER  := $(BUILD)/lib/libkmworker.a
LIB_CLIENT  := $(BUILD)/lib/libkvmesh.a
LIB_ROUTER  := $(BUILD)/lib/libkmrouter.a
LIB_CONTROLLER := $(BUILD)/lib/libkmcontroller.a
# Link order: dependents first. Tests and benchmarks link everything; each daemon links only what
# DESIGN.md's arrows allow (common <- model <- kernels <- kvshard <- peer, engine <- worker;
# common, model <- router; common <- controller, client <- cli), so a call against the arrows
# fails its link (and `make check-links` below).
ALL_LIBS := $(LIB_CLIENT) $(LIB_CONTROLLER) $(LIB_ROUTER) $(LIB_WORKER) $(LIB_ENGINE) $(LIB_PEER) $(LIB_KVSHARD) $(LIB_KERNELS) $(LIB_MODEL) $(LIB_COMMON)
ENGINE_LIBS     := $(LIB_ENGINE) $(LIB_KVSHARD) $(LIB_KERNELS) $(LIB_MODEL) $(LIB_COMMON)
WORKER_LIBS     := $(LIB_WORKER) $(LIB_ENGINE) $(LIB_PEER) $(LIB_KVSHARD) $(LIB_KERNELS) $(LIB_MODEL) $(LIB_COMMON)
ROUTER_LIBS     := $(LIB_ROUTER) $(LIB_MODEL) $(LIB_COMMON)
CONTROLLER_LIBS := $(LIB_CONTROLLER) $(LIB_COMMON)
# peer/ (KV page transfer) is the only user of UCX: only what links it gets -lucp -lucs. UCX_HOME:
# the UCX it builds against, by default the pinned 1.22.0 that `make deps` unpacks (deploy/ucx.sh),
# else the system's (Debian 12's 1.13.1 crashes in its connection manager: docs/transfer.md, "Which
# UCX"); UCX_HOME=/opt/ucx for a site build with verbs. The rpath names the checkout and, for an
# install next to /usr/local/bin, ../lib/kvmesh/ucx.
UCX_HOME ?= $(if $(wildcard third_party/ucx/lib/libucp.so),$(CURDIR)/third_party/ucx)
ifneq ($(UCX_HOME),)
CFLAGS_BASE += -isystem $(UCX_HOME)/include
UCX_LIBS := -L$(UCX_HOME)/lib -Wl,-rpath,$(UCX_HOME)/lib -Wl,-rpath,'$$ORIGIN/../lib/kvmesh/ucx' -lucp -lucs
UCX_DESC := $(UCX_HOME)
UCX_RUN_ENV := PATH=$(UCX_HOME)/bin:$$PATH LD_LIBRARY_PATH=$(UCX_HOME)/lib
else
UCX_LIBS := -lucp -lucs
UCX_DESC := the system's (libucx-dev); run make deps for the pinned UCX, see docs/transfer.md
UCX_RUN_ENV :=
endif
# What includes UCX's headers is rebuilt when the UCX changes (a stamp per UCX_HOME).
UCX_STAMP := $(BUILD)/ucx-$(if $(UCX_HOME),$(subst /,_,$(UCX_HOME)),system).stamp
$(UCX_STAMP):
	@mkdir -p $(dir $@) && rm -f $(BUILD)/ucx-*.stamp && touch $@
	@echo "UCX: $(UCX_DESC)"

objs = $(patsubst %.c,$(OBJ)/%.o,$(1))

UNIT_SRC := $(wildcard tests/unit/test_*.c)
UNIT_BIN := $(patsubst tests/unit/%.c,$(TESTBIN)/%,$(UNIT_SRC))

PROGRAMS := $(BIN)/kvmesh $(BIN)/kvmesh-gguf-gen
ifneq ($(wildcard worker/main.c),)
PROGRAMS += $(BIN)/kvmesh-worker
endif
ifneq ($(wildcard router/main.c),)
PROGRAMS += $(BIN)/kvmesh-router
endif
ifneq ($(wildcard controller/main.c),)
PROGRAMS += $(BIN)/kvmesh-controller
endif
# kvmesh-netdelay (tests/chaos/netdelay.c): the packet delayer of `kvmesh chaos netfault`, built
# where libnetfilter-queue-dev is installed (`make deps`); without it netfault runs without
# delay and reordering and says so.
NFQ_LIBS := $(shell pkg-config --libs libnetfilter_queue 2>/dev/null)
ifneq ($(NFQ_LIBS),)
PROGRAMS += $(BIN)/kvmesh-netdelay
endif

.PHONY: all build deps moe-model test unit-tests unit-tests-san unit-tests-tsan integration fuzz fuzz-run \
        demo bench bench-engine fixtures fmt lint help-check clean help

all: build ## = build
build: $(PROGRAMS) check-links ## the kvmesh command and the daemons into build/bin, every library's link checked

# Every target carries a `## ` note on its rule line: `make help` prints them, and `make lint`
# fails when a .PHONY target has none.
help: ## this list
	@awk '/^[a-zA-Z0-9_.-]+:[^=]*## / { t = $$1; sub(/:.*/, "", t); n = $$0; sub(/^[^#]*## /, "", n); \
	  printf "make %-16s %s\n", t, n }' $(firstword $(MAKEFILE_LIST))

# ------------------------------------------------------------------ compile rules
$(OBJ)/%_avx2.o: %_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(AVX2_FLAGS) -c $< -o $@

$(OBJ)/%_avx512.o: %_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(AVX512_FLAGS) -c $< -o $@

$(OBJ)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -c $< -o $@

# Under SAN=1 the SIMD arithmetic (matmul, quantization, attention: KERNELS_HOT_SRC) is built at
# -O2 with UBSan and without ASan into the library everything links, and a second time with
# both into libkmkernels_asan.a, which the suites that hold those kernels to their references
# (KERNEL_SUITES) link instead. Instrumented, their vector loads made the model-running suites
# spend most of their time in ASan's shadow checks (tests/README.md, "The ASan build").
KERNELS_HOT_SRC := $(wildcard $(addprefix kernels/cpu/,quant_avx*.c ops_avx*.c attn_kv_avx*.c))
KERNEL_SUITES := test_kernels_quant test_kernels_ops test_kvshard_format test_sparse
ifeq ($(SAN),1)
KERNELS_HOT_FLAGS := $(filter-out -fsanitize=% $(OPT),$(CFLAGS_BASE)) -O2 -g -fsanitize=undefined
$(call objs,$(KERNELS_HOT_SRC)): CFLAGS_BASE := $(KERNELS_HOT_FLAGS)
LIB_KERNELS_ASAN := $(BUILD)/lib/libkmkernels_asan.a
$(OBJ)/asan/%_avx2.o: %_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(AVX2_FLAGS) -c $< -o $@
$(OBJ)/asan/%_avx512.o: %_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(AVX512_FLAGS) -c $< -o $@
$(LIB_KERNELS_ASAN): $(call objs,$(filter-out $(KERNELS_HOT_SRC),$(KERNELS_SRC))) \
  $(patsubst %.c,$(OBJ)/asan/%.o,$(KERNELS_HOT_SRC))
# Every link wraps the SIMD tables' entry points in tests/san/kernel_bounds.c's checks of the
# caller's buffers (its opening comment says why).
KERNELS_WRAP := $(foreach isa,avx2 avx512,$(foreach f,quantize_row dequantize_row matmul \
  matmul_packed rmsnorm rope silu_mul add f32_to_f16 f16_to_f32 attention attention_multi, \
  -Wl,--wrap=kn_$(f)_$(isa)))
LDFLAGS += $(KERNELS_WRAP)
$(LIB_KERNELS) $(LIB_KERNELS_ASAN): $(OBJ)/tests/san/kernel_bounds.o
endif

$(LIB_COMMON): $(call objs,$(COMMON_SRC))
$(LIB_MODEL): $(call objs,$(MODEL_SRC))
$(LIB_KERNELS): $(call objs,$(KERNELS_SRC))
$(LIB_KVSHARD): $(call objs,$(KVSHARD_SRC))
$(LIB_PEER): $(call objs,$(PEER_SRC))
$(call objs,$(PEER_SRC)) $(OBJ)/bench/bench_transfer.o $(OBJ)/tests/unit/test_xfer_proc.o: $(UCX_STAMP)
$(LIB_ENGINE): $(call objs,$(ENGINE_SRC))
$(LIB_WORKER): $(call objs,$(WORKER_SRC))
$(LIB_CLIENT): $(call objs,$(CLIENT_SRC))
$(LIB_ROUTER): $(call objs,$(ROUTER_SRC))
$(LIB_CONTROLLER): $(call objs,$(CONTROLLER_SRC))
$(BUILD)/lib/%.a:
	@mkdir -p $(dir $@)
	@rm -f $@
	ar rcs $@ $^

# The kvmesh command: libkvmesh, and the engine (with kvshard, kernels and model) for its local
# commands run, perplexity, bench and tokenize (cli/local.c); no daemon's library.
$(BIN)/kvmesh: $(call objs,$(CLI_SRC)) $(LIB_CLIENT) $(ENGINE_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BIN)/kvmesh-worker: $(OBJ)/worker/main.o $(WORKER_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(UCX_LIBS)

$(BIN)/kvmesh-router: $(OBJ)/router/main.o $(ROUTER_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BIN)/kvmesh-controller: $(OBJ)/controller/main.o $(CONTROLLER_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

# kvmesh-gguf-gen (tools/gguf_gen.c): random-weight GGUFs of a given shape (docs/gpu.md). Only
# model/ and common/'s error code and libm, so it links wherever a C compiler does.
GGUF_GEN_OBJS := $(call objs,tools/gguf_gen.c model/gguf_gen.c model/types.c common/err.c)
$(BIN)/kvmesh-gguf-gen: $(GGUF_GEN_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -lm

# ------------------------------------------------------------------ CUDA (docs/gpu.md)
# Where nvcc exists (on the PATH or in /usr/local/cuda), kernels/cuda/*.cu build into
# libkmcuda.a and tests/gpu/test_*.c into $(BUILD)/gpu/, as part of `make build`; elsewhere
# nothing of it is built and nothing else needs it. CUDA=0 turns it off. Machine code for
# Hopper's sm_90a (wgmma, setmaxnreg: what later matrix kernels need) plus compute_80 PTX that
# the driver compiles for any newer GPU (docs/gpu.md, "Targets"). The GPU programs link only
# these objects, the scalar references and the CUDA runtime (static): nothing that needs ZeroMQ,
# UCX or a Debian -dev package, so the same targets build on the GPU machine.
NVCC ?= $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc))
CUDA ?= $(if $(NVCC),1,0)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_GENCODE ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=compute_80
NVCCFLAGS := -O3 -std=c++17 -I. $(CUDA_GENCODE) -Xcompiler -fPIC -MMD -MP $(EXTRA_NVCCFLAGS)
CUDA_SRC := $(wildcard kernels/cuda/*.cu)
LIB_CUDA := $(BUILD)/lib/libkmcuda.a
CUDA_LDLIBS := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lpthread -lstdc++ -lm
GPU_TESTS := $(patsubst tests/gpu/%.c,$(BUILD)/gpu/%,$(wildcard tests/gpu/test_*.c))
GPU_REF_OBJS := $(call objs,kernels/cpu/ops_ref.c kernels/cpu/quant_ref.c kernels/cpu/attn_kv_ref.c model/types.c)
$(OBJ)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@
$(LIB_CUDA): $(patsubst %.cu,$(OBJ)/%.o,$(CUDA_SRC))
$(OBJ)/tests/gpu/%.o: CFLAGS_BASE += -isystem $(CUDA_HOME)/include
$(BUILD)/gpu/%: $(OBJ)/tests/gpu/%.o $(LIB_CUDA) $(GPU_REF_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(CUDA_LDLIBS)
ifeq ($(CUDA),1)
build: $(GPU_TESTS)
endif
.PHONY: gpu-programs gpu-check cuda-report
gpu-programs: $(GPU_TESTS) $(BIN)/kvmesh-gguf-gen ## what gpu-check runs: the GPU tests and kvmesh-gguf-gen (needs nvcc)
gpu-check: ## on a GPU machine: builds and runs every GPU test, the speed table last; says so and exits 0 without a GPU
	@bash scripts/gpu_check.sh
cuda-report: ## nvcc -Xptxas -v of every kernel: registers, shared memory, stack, spills
	@for f in $(CUDA_SRC); do echo "== $$f"; $(NVCC) $(NVCCFLAGS) -Xptxas -v -c $$f -o /dev/null 2>&1 | \
	  grep -E 'Compiling|Used|spill' | sed -E 's/ptxas info *: //'; done

$(BIN)/kvmesh-netdelay: $(OBJ)/tests/chaos/netdelay.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(NFQ_LIBS)

# ------------------------------------------------------------------ component layering
# Each library is linked alone into a shared object, with only the libraries DESIGN.md's arrows
# put below it and --no-undefined: a call from a library into one above it (a back-edge) fails
# here even where no daemon's link would notice. Part of `make build`. (check-layers, below, is
# the file layering inside kvshard, worker and router.)
LINKS := $(BUILD)/links
# The engine is also linked without ZeroMQ, CZMQ, libuv, h2o or UCX (ENGINE_LDLIBS): an engine
# file that reached for a socket library fails here.
ENGINE_LDLIBS := -lsodium -lmsgpackc -lxxhash -lssl -lcrypto -lm -pthread
define link_rule
$(LINKS)/$(1).ok: $(BUILD)/lib/lib$(1).a $(2)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(LDFLAGS) -shared -o $$(@:.ok=.so) -Wl,--whole-archive $$< -Wl,--no-whole-archive \
	  $(2) $(if $(4),$(4),$$(LDLIBS)) $(3) -Wl,--no-undefined
	@rm -f $$(@:.ok=.so) && touch $$@
endef
$(eval $(call link_rule,kmcommon,))
$(eval $(call link_rule,kmmodel,$(LIB_COMMON)))
$(eval $(call link_rule,kmkernels,$(LIB_MODEL) $(LIB_COMMON)))
$(eval $(call link_rule,kvshard,$(LIB_KERNELS) $(LIB_MODEL) $(LIB_COMMON)))
$(eval $(call link_rule,kmpeer,$(LIB_KVSHARD) $(LIB_KERNELS) $(LIB_MODEL) $(LIB_COMMON),$$(UCX_LIBS)))
$(eval $(call link_rule,kmengine,$(LIB_KVSHARD) $(LIB_KERNELS) $(LIB_MODEL) $(LIB_COMMON),,$(ENGINE_LDLIBS)))
$(eval $(call link_rule,kmworker,$(LIB_ENGINE) $(LIB_PEER) $(LIB_KVSHARD) $(LIB_KERNELS) $(LIB_MODEL) $(LIB_COMMON),$$(UCX_LIBS)))
$(eval $(call link_rule,kmrouter,$(LIB_MODEL) $(LIB_COMMON)))
$(eval $(call link_rule,kmcontroller,$(LIB_COMMON)))
$(eval $(call link_rule,kvmesh,$(LIB_COMMON)))
.PHONY: check-links
check-links: $(patsubst %,$(LINKS)/%.ok,kmcommon kmmodel kmkernels kvshard kmpeer kmengine kmworker kmrouter kmcontroller kvmesh) ## each library links alone with only those DESIGN.md puts below it

# The kernel tests also run the AVX-512 matmul and attention drivers emulated on AVX2
# (tests/unit/emu512_avx2.c; its 64-byte vectors are never passed across a call, so GCC's ABI
# note does not apply).
$(TESTBIN)/test_kernels_quant $(TESTBIN)/test_kernels_ops: $(OBJ)/tests/unit/emu512_avx2.o
$(OBJ)/tests/unit/emu512_avx2.o: CFLAGS_BASE += -Wno-psabi

# Under TSAN=1 only the libraries of the threaded parts are built and linked (TSAN_TESTS below).
ifeq ($(TSAN),1)
TEST_RUNNER := $(OBJ)/tests/tsan/runner.o
TEST_LIBS :=
TEST_ARCHIVES := $(LIB_PEER) $(LIB_KVSHARD) $(LIB_KERNELS) $(LIB_MODEL) $(LIB_COMMON)
else
TEST_RUNNER :=
TEST_LIBS := -lcriterion
TEST_ARCHIVES := $(ALL_LIBS)
endif
$(TESTBIN)/%: $(OBJ)/tests/unit/%.o $(TEST_RUNNER) $(TEST_ARCHIVES)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(TEST_LIBS) $(LDLIBS)
ifeq ($(SAN),1)
$(addprefix $(TESTBIN)/,$(KERNEL_SUITES)): $(TESTBIN)/%: $(OBJ)/tests/unit/%.o \
  $(subst $(LIB_KERNELS),$(LIB_KERNELS_ASAN),$(TEST_ARCHIVES))
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(TEST_LIBS) $(LDLIBS)
endif

$(TESTBIN)/test_xfer_peer $(TESTBIN)/test_xfer_proc: $(OBJ)/tests/xfer_harness.o
$(TESTBIN)/test_xfer_peer $(TESTBIN)/test_xfer_proc: LDLIBS += $(UCX_LIBS)

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

# ------------------------------------------------------------------ set-up
deps: ## Debian packages, the default model and the MoE test models made from it (idempotent)
	@bash deploy/deps.sh
	@bash scripts/moe_model.sh

moe-model: ## the MoE test models (models/*MoE*.gguf: llama, qwen2moe, granitemoe, olmoe; docs/moe.md) from the default one (idempotent)
	@bash scripts/moe_model.sh

# ------------------------------------------------------------------ tests
# $(call run_logged,TITLE,COMMAND,LOG): COMMAND with its output into LOG, then TITLE, the log and
# the seconds it took, printed at once; fails as COMMAND did. The suites of a phase are jobs of
# their own that run it, so that under -j (make test's) their outputs do not interleave.
run_logged = s=$$(date +%s); $(2) >$(3) 2>&1 && rc=0 || rc=$$?; \
  echo "== $(1)"; cat $(3); echo "   $(1): $$(( $$(date +%s) - s )) s"; exit $$rc

# Unit tests run from the repository root (fixtures are found by relative path). Each suite is a
# job of its own (unit-run-NAME) whose output is printed whole when it ends, so `make -j2
# unit-tests` (as make test runs it) runs two suites at a time.
GPU_RUN := $(if $(filter 1,$(CUDA)),$(if $(filter 00,$(SAN)$(TSAN)),$(GPU_TESTS)))
unit-tests: $(patsubst $(TESTBIN)/%,unit-run-%,$(UNIT_BIN)) $(GPU_RUN) ## every Criterion unit test (tests/unit), and the GPU tests where nvcc built them (they skip, saying why, without a GPU)
	@echo "== UCX: $(UCX_DESC)"
	@set -e; for t in $(GPU_RUN); do echo "== $$t"; $$t; done
# The transfer tests (test_xfer_peer, test_xfer_proc) and test_engine_blend run one test at a
# time: with two at once (forks, UCX or engine pool threads, long tests) Criterion's own runner
# leaks 48 bytes that LeakSanitizer reports under SAN=1 (the tests themselves are clean).
UNIT_ONE_AT_A_TIME := test_xfer_pe% test_xfer_pr% test_engine_blend
unit-run-%: $(TESTBIN)/%
	@$(call run_logged,$<,$< --jobs $(if $(filter $(UNIT_ONE_AT_A_TIME),$*),1,2),$<.log)

unit-tests-san: ## the unit tests under AddressSanitizer and UBSan (build/san)
	@$(MAKE) --no-print-directory SAN=1 unit-tests

# The threaded parts under ThreadSanitizer: the kernel thread pool (test_pool), kvshard's promoter
# thread (test_kvshard: host tier, asynchronous promotion, views waiting for their layer), the
# admin HTTP server's thread (test_admin_http), the transfer node's threads (test_xfer_peer: UCX's
# progress thread, the arena prefault) and the worker's heartbeat thread (the plain integration
# test below, against a ThreadSanitizer kvmesh-worker, which exits 66 at its first race). A data
# race fails the run (halt_on_error). test_xfer_proc cannot run under it: it forks a process
# that has threads, and the child starts threads of its own (TSan: die_after_fork).
# UCX_MEM_MMAP_HOOK_MODE=none: UCX's memory hooks (libucm) patch madvise, which glibc calls on a
# thread's stack as the thread exits, after TSan has let go of the thread: the process would
# crash. tests/tsan/suppressions.txt names races inside libraries that are not instrumented.
TSAN_TESTS := $(patsubst tests/unit/%.c,%,$(wildcard $(addprefix tests/unit/,test_pool.c test_kvshard.c test_admin_http.c test_xfer_peer.c)))
TSAN_ENV = UCX_MEM_MMAP_HOOK_MODE=none TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 \
  exitcode=66 suppressions=$(CURDIR)/tests/tsan/suppressions.txt $(TSAN_OPTIONS)"
TSAN_HB_TEST := worker/heartbeats_reach_the_controller_and_serving_survives_its_absence
unit-tests-tsan: ## the threaded parts' unit tests under ThreadSanitizer (build/tsan)
	@$(MAKE) --no-print-directory build/tests/integration/test_worker
	@$(MAKE) --no-print-directory TSAN=1 tsan-run
.PHONY: tsan-run
tsan-run: $(addprefix $(TESTBIN)/,$(TSAN_TESTS)) $(BIN)/kvmesh-worker ## (with TSAN=1) builds and runs TSAN_TESTS
	@set -e; for t in $(addprefix $(TESTBIN)/,$(TSAN_TESTS)); do \
	  echo "== $$t (ThreadSanitizer)"; $(TSAN_ENV) $$t --jobs 2; done
	@echo "== $(TSAN_HB_TEST) against $(BIN)/kvmesh-worker (ThreadSanitizer)"
	@KVMESH_IT_WORKER=$(BIN)/kvmesh-worker $(TSAN_ENV) \
	  build/tests/integration/test_worker --jobs 1 --filter '$(TSAN_HB_TEST)'

# Each phase says how long it took, so that the 25-minute budget of `make test` can be kept.
# Phases run with TEST_JOBS jobs (the CPU's cores) unless make test was given -j itself.
TEST_JOBS ?= $(shell nproc)
timed = s=$$(date +%s); $(MAKE) --no-print-directory $(if $(filter -j%,$(MAKEFLAGS)),,-j$(TEST_JOBS)) $(1) && echo "== make test: $(1) took $$(( $$(date +%s) - s )) s"
test: deps ## the gate (`bash .ci/run`): lint, check-rules, build, layers, unit tests plain/ASan/TSan, fuzz, integration (plain, and test_security on ASan daemons), chaos-short
	@$(call timed,lint)
	@$(call timed,check-rules)
	@$(call timed,build)
	@$(call timed,check-layers)
	@$(call timed,check-prefetch)
	@$(call timed,unit-tests)
	@$(call timed,unit-tests-san)
	@$(call timed,unit-tests-tsan)
	@$(call timed,fuzz-run)
	@$(call timed,integration)
	@$(call timed,integration-san)
	@$(call timed,chaos-short)
	@echo "make test: all suites passed"

# kvshard's files are layers whose calls go one way (docs/kvshard.md, "Layers"): read from the
# built library, so a call back up fails here.
.PHONY: check-layers
check-layers: $(LIB_KVSHARD) $(LIB_WORKER) $(LIB_ROUTER) ## kvshard's, worker's, router's calls go one way down their layers
	@bash tests/check_layers.sh kvshard $(LIB_KVSHARD)
	@bash tests/check_layers.sh worker $(LIB_WORKER)
	@bash tests/check_layers.sh router $(LIB_ROUTER)

# A prefetch changes no result, so no test sees one go missing: read from the built objects.
.PHONY: check-prefetch
check-prefetch: $(LIB_KERNELS) ## every kernel object whose sources prefetch carries prefetch instructions
	@bash tests/check_prefetch.sh $(OBJ)/kernels/cpu

# Multi-process tests: real kvmesh-worker processes on 127.0.0.1 (tests/integration/), sharing
# tests/integration/harness.c (spawn, ports, stop, sockets, metrics).
IT_SRC := $(wildcard tests/integration/test_*.c)
IT_BIN := $(patsubst tests/integration/%.c,$(TESTBIN)/integration/%,$(IT_SRC))
IT_HARNESS := $(OBJ)/tests/integration/harness.o
$(TESTBIN)/integration/%: $(OBJ)/tests/integration/%.o $(IT_HARNESS) $(ALL_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -lcriterion $(LDLIBS)
# test_pageplane attacks a worker's UCX port with a libucp client of its own.
$(TESTBIN)/integration/test_pageplane: LDLIBS += $(UCX_LIBS)
# Suites run as jobs of their own (it-run-NAME), printed whole when each ends: every daemon takes
# ephemeral ports and its own temporary directory, so `make -j2 integration` runs two at a time.
integration: $(patsubst $(TESTBIN)/integration/%,it-run-%,$(IT_BIN)) ## multi-process suites: real daemons on 127.0.0.1
it-run-%: $(TESTBIN)/integration/% build
	@$(call run_logged,$<,$< --jobs 1,$<.log)

# The official OpenAI Python SDK for tests/openai_sdk.py, which the integration suite test_openai
# runs (unchanged SDK against a real router) when this venv or a python3 with the package exists.
.PHONY: openai-sdk-venv
openai-sdk-venv: ## build/venv-openai: a python3 venv with the official `openai` package (PyPI)
	python3 -m venv build/venv-openai && build/venv-openai/bin/pip install -q openai

# The same suites against AddressSanitizer/UBSan builds of the daemons (build/san/bin, found by
# the harness through KVMESH_IT_BIN): a memory error or undefined behaviour in any daemon aborts
# it and leaves a report in build/san/it-reports, which fails the run even when the suite did not
# notice the daemon dying. Leak reports are off: daemons stopped by SIGKILL in a test cannot
# free what they hold.
SAN_IT_SUITES ?= test_security test_pageplane
SAN_IT_ENV := KVMESH_IT_BIN=build/san/bin \
  ASAN_OPTIONS=detect_leaks=0:log_path=$(CURDIR)/build/san/it-reports/asan \
  UBSAN_OPTIONS=print_stacktrace=1:log_path=$(CURDIR)/build/san/it-reports/ubsan
.PHONY: integration-san
integration-san: $(addprefix $(TESTBIN)/integration/,$(SAN_IT_SUITES)) ## SAN_IT_SUITES (test_security, test_pageplane) against ASan/UBSan daemons
	@$(MAKE) --no-print-directory SAN=1 build/san/bin/kvmesh-worker build/san/bin/kvmesh-router build/san/bin/kvmesh-controller
	@rm -rf build/san/it-reports; mkdir -p build/san/it-reports
	@$(MAKE) --no-print-directory $(addprefix it-san-run-,$(SAN_IT_SUITES))
	@if [ -n "$$(ls -A build/san/it-reports)" ]; then cat build/san/it-reports/*; \
	  echo "integration-san: sanitizer reports above (build/san/it-reports)" >&2; exit 1; fi
it-san-run-%: $(TESTBIN)/integration/%
	@$(call run_logged,$* (ASan/UBSan daemons),$(SAN_IT_ENV) $< --jobs 1,$<.san.log)

# Fault injection against whole local clusters (docs/chaos.md): every scenario starts its own
# `kvmesh up` on free ports. chaos-short (a few seconds of load each) is part of `make test`.
.PHONY: chaos chaos-short
chaos: build ## fault-injection scenarios against local clusters (docs/chaos.md)
	@build/bin/kvmesh chaos all

chaos-short: build ## the same, a few seconds of load each
	@build/bin/kvmesh chaos all --short

# ------------------------------------------------------------------ fuzzing (clang libFuzzer)
# Every source is compiled once into build/fuzz/obj (coverage, ASan, UBSan) and each target links
# the objects it needs, so common/ and model/ are not compiled again per target.
FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_BIN := $(patsubst tests/fuzz/%.c,build/fuzz/%,$(FUZZ_SRC))
FUZZ_OBJ := build/fuzz/obj
FUZZ_SANFLAGS := -fsanitize=address,undefined
fuzz_objs = $(patsubst %.c,$(FUZZ_OBJ)/%.o,$(1))
$(FUZZ_OBJ)/%.o: %.c
	@mkdir -p $(dir $@)
	clang -std=gnu11 -g -O1 -I. -MMD -MP -fsanitize=fuzzer-no-link $(FUZZ_SANFLAGS) -c $< -o $@
-include $(shell find $(FUZZ_OBJ) -name '*.d' 2>/dev/null)
.PRECIOUS: $(FUZZ_OBJ)/%.o

build/fuzz/fuzz_%: $(FUZZ_OBJ)/tests/fuzz/fuzz_%.o $(call fuzz_objs,$(COMMON_SRC) $(MODEL_SRC))
	clang -fsanitize=fuzzer $(FUZZ_SANFLAGS) $^ -o $@ $(LDLIBS)

# kvshard's disk page reader (fuzz_kvpage) also needs kvshard/diskfmt.c.
build/fuzz/fuzz_kvpage: $(call fuzz_objs,kvshard/diskfmt.c)
# The router's OpenAI request parser (fuzz_oai) also needs router/openai*.c.
build/fuzz/fuzz_oai: $(call fuzz_objs,router/openai.c router/openai_tools.c router/openai_chunks.c)
# The grammar engine's readers and compilers (fuzz_grammar: schemas; fuzz_gbnf: GBNF grammars and
# regexes) need engine/grammar*.c.
build/fuzz/fuzz_grammar build/fuzz/fuzz_gbnf: $(call fuzz_objs,$(wildcard engine/grammar*.c))
# The peer node address (fuzz_peeraddr) needs peer/addr.c.
build/fuzz/fuzz_peeraddr: $(call fuzz_objs,peer/addr.c)
# The sparse budget-shares reader (fuzz_sparse_shares) needs engine/sparse_shares.c.
build/fuzz/fuzz_sparse_shares: $(call fuzz_objs,engine/sparse_shares.c)
# A router's whole request path (fuzz_router_dispatch): every router source but main.c.
build/fuzz/fuzz_router_dispatch: $(call fuzz_objs,$(ROUTER_SRC))

fuzz: $(FUZZ_BIN) ## builds the libFuzzer targets (tests/fuzz)

# Replays the committed corpus, then fuzzes each target briefly. A target without its seed corpus
# fails the run: fuzzing from nothing would pass while testing little. Each target is a job of its
# own (fuzz-run-NAME) whose output is printed whole when it ends, so `make -j2 fuzz-run` (as make
# test runs it) fuzzes two at a time: a libFuzzer process is single-threaded.
FUZZ_SECONDS ?= 20
fuzz-run: $(addprefix fuzz-run-,$(notdir $(FUZZ_BIN))) ## replays the corpus, then fuzzes each target for FUZZ_SECONDS
fuzz-run-%: build/fuzz/%
	@n=$*; \
	  if [ -z "$$(ls -A tests/fuzz/corpus/$$n 2>/dev/null)" ]; then \
	    echo "fuzz-run: tests/fuzz/corpus/$$n is missing or empty" >&2; exit 1; fi; \
	  mkdir -p build/fuzz/corpus/$$n; cp -n tests/fuzz/corpus/$$n/* build/fuzz/corpus/$$n/ 2>/dev/null || true; \
	  build/fuzz/$$n -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -print_final_stats=0 \
	    -artifact_prefix=build/fuzz/$$n- build/fuzz/corpus/$$n >build/fuzz/$$n.log 2>&1; rc=$$?; \
	  echo "== $$n ($(FUZZ_SECONDS)s)"; tail -4 build/fuzz/$$n.log; exit $$rc

# The binaries the suites' and fuzzers' jobs (unit-run-, it-run-, it-san-run-, fuzz-run-NAME)
# run are reached through patterns only: kept, not deleted as intermediate files after a run.
.SECONDARY: $(UNIT_BIN) $(IT_BIN) $(FUZZ_BIN)

# ------------------------------------------------------------------ demo and benchmarks
demo: deps build ## the default model answering prompts
	@bash deploy/demo.sh

# A benchmark is bench/NAME.c linked with every library; bench_transfer and bench_pull, below,
# say what they link instead.
$(BUILD)/bench/%: $(OBJ)/bench/%.o $(ALL_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)
.SECONDARY: $(patsubst %.c,$(OBJ)/%.o,$(wildcard bench/*.c))

bench: bench-engine ## = bench-engine

# Kernel figures (docs/kernels.md, docs/kernels_ops.md): matmul GFLOP/s per instruction set,
# attention GB/s, pool barrier latency; also the memory bandwidth bench-engine reports.
BENCH_KERNELS := $(BUILD)/bench/bench_kernels
.PHONY: bench-kernels
bench-kernels: $(BENCH_KERNELS) ## matmul, attention and thread-pool figures (docs/kernels*.md)
	@$(BENCH_KERNELS)
	@$(BENCH_KERNELS) -a
	@$(BENCH_KERNELS) -p

bench-engine: build $(BENCH_KERNELS) ## prefill/decode speed next to llama.cpp (docs/benchmarks.md)
	@BENCH_KERNELS=$(BENCH_KERNELS) bash bench/bench_engine.sh

# Perplexity per KV format vs f16 and llama.cpp (docs/benchmarks.md, docs/engine.md).
.PHONY: bench-quality
bench-quality: build ## perplexity per KV format vs f16 and llama.cpp
	@bash bench/bench_quality.sh

# Long contexts, dense vs sparse attention (docs/sparse.md): perplexity at 2k/4k/8k and budgets
# 256/512/1024, decode step time at depth 8k.
BENCH_LONG_MEM := $(BUILD)/bench/bench_long_mem
BENCH_LONG_DEC := $(BUILD)/bench/bench_long_dec
.PHONY: bench-long
bench-long: build $(BENCH_LONG_MEM) $(BENCH_LONG_DEC) ## long-context perplexity, decode step, memory budget: dense vs sparse
	@BENCH_LONG_MEM=$(BENCH_LONG_MEM) BENCH_LONG_DEC=$(BENCH_LONG_DEC) sh bench/bench_long.sh

# Worker serving figures side by side with llama-server (docs/benchmarks.md): tok/s, TTFT and
# ITL at 1/8/32 concurrent clients, and TTFT with a 90%-cached prompt vs cold.
BENCH_WORKER := $(BUILD)/bench/bench_worker
.PHONY: bench-worker
bench-worker: build $(BENCH_WORKER) ## serving tok/s, TTFT, ITL at 1/8/32 clients next to llama-server
	@BENCH_WORKER=$(BENCH_WORKER) bash bench/bench_worker.sh

# Speculative decoding off vs auto on one worker (docs/speculative.md): tokens/s, drafts
# accepted, and outputs identical in both modes, on a repetitive and an open-ended workload.
BENCH_SPEC := $(BUILD)/bench/bench_spec
.PHONY: bench-spec
bench-spec: build $(BENCH_SPEC) ## speculative decoding off vs auto on one worker, outputs compared
	@BENCH_SPEC=$(BENCH_SPEC) bash bench/bench_spec.sh

# Constrained decoding's cost (docs/structured.md): decode tok/s of a batch of 32 requests held
# to a schema, and to json_object, against the same batch free; the time of one mask, cold and warm.
BENCH_STRUCTURED := $(BUILD)/bench/bench_structured
.PHONY: bench-structured
bench-structured: $(BENCH_STRUCTURED) ## constrained vs free decode tok/s at batch 32, mask times
	@grep -m1 'model name' /proc/cpuinfo; nproc
	@$(BENCH_STRUCTURED) --threads $${THREADS:-2} --batch $${BATCH:-32}

# Chunk reuse (docs/blend.md): full recompute, prefix caching and blend at several recompute
# fractions on a RAG-style set from /usr/share/common-licenses and /usr/share/doc: TTFT,
# perplexity, agreement. QUICK=1: a smoke run (2 prompts of at most 4 documents, two fractions);
# INTERLEAVE=0 runs the modes one after another; VERBOSE=1 prints each prompt's figures.
BENCH_BLEND := $(BUILD)/bench/bench_blend
.PHONY: bench-blend
bench-blend: $(BENCH_BLEND) ## chunk reuse vs full and prefix caching: TTFT, perplexity, agreement
	@grep -m1 'model name' /proc/cpuinfo; nproc
	@$(BENCH_BLEND) --threads $${THREADS:-2} --prompts $${PROMPTS:-8} --docs $${DOCS:-16} \
		--quick $${QUICK:-0} $${FRACTIONS:+--fractions $$FRACTIONS} \
		--interleave $${INTERLEAVE:-1} --verbose $${VERBOSE:-0}
.PHONY: bench-blend-route
bench-blend-route: build ## 4 workers: chunk tokens reused with and without chunk-aware routing
	@bash bench/bench_blend_route.sh
# What a prompt with reused chunks costs a sequence already decoding (docs/blend.md "Serving"):
# its longest wait and the steps' CPU time, per prefill chunk (CHUNKS, REPEAT, THREADS).
BENCH_BLEND_STEP := $(BUILD)/bench/bench_blend_step
.PHONY: bench-blend-step
bench-blend-step: $(BENCH_BLEND_STEP) ## a decoder's longest wait while a blended prompt prefills
	@grep -m1 'model name' /proc/cpuinfo; nproc
	@$(BENCH_BLEND_STEP) --threads $${THREADS:-1} --chunks $${CHUNKS:-256,64,32} \
		--repeat $${REPEAT:-2}

# KV store figures (docs/kvshard.md): lookup/insert ops/s, tier bandwidth, attention per format.
BENCH_KV := $(BUILD)/bench/bench_kv
.PHONY: bench-kv
bench-kv: $(BENCH_KV) ## KV store: lookup/insert, tier bandwidth, attention per format
	@$(BENCH_KV)

# Router figures (docs/router.md): decisions/s, latency the router adds, and kv-aware vs
# round-robin vs random on a shared-prefix workload over `kvmesh up` clusters.
BENCH_ROUTER := $(BUILD)/bench/bench_router
.PHONY: bench-router
bench-router: build $(BENCH_ROUTER) ## routing decisions/s, added latency, kv-aware vs round-robin
	@bash bench/bench_router.sh

# Prefill/decode disaggregation (docs/disaggregation.md): streams' ITL, TTFT and tokens/s under
# arriving long prompts, colocated workers against 1 prefill + 1 decode, clusters interleaved.
BENCH_PD := $(BUILD)/bench/bench_pd
.PHONY: bench-pd
bench-pd: build $(BENCH_PD) ## streams' ITL p99 under long prompts: colocated vs prefill+decode
	@bash bench/bench_pd.sh

.PHONY: bench-fair
bench-fair: build ## one API key floods, another's TTFT p50/p90 idle vs under the flood
	@bash bench/bench_fair.sh

# Page transfer between two processes next to ucx_perftest (docs/transfer.md, docs/benchmarks.md):
# GB/s and pages/s for 1, 16 and 256 pages, UCX_TLS=tcp and the default transports, in one run.
BENCH_TRANSFER := $(BUILD)/bench/bench_transfer
$(BENCH_TRANSFER): $(OBJ)/bench/bench_transfer.o $(OBJ)/tests/xfer_harness.o $(ALL_LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(UCX_LIBS)
.PHONY: bench-transfer
bench-transfer: $(BENCH_TRANSFER) ## KV page transfer between two processes next to ucx_perftest
	@$(UCX_RUN_ENV) $(BENCH_TRANSFER) $(BENCH_ARGS)

# TTFT of a long prompt whose prefix sits on a peer, pulled vs computed (docs/transfer.md):
# two kvmesh-worker processes with transfer nodes, interleaved rounds.
BENCH_PULL := $(BUILD)/bench/bench_pull
$(BENCH_PULL): $(OBJ)/bench/bench_pull.o $(LIB_COMMON)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)
.PHONY: bench-pull
bench-pull: build $(BENCH_PULL) ## TTFT of a long prompt pulled from a peer vs computed
	@$(BENCH_PULL) $(BENCH_ARGS)

# What page transfer buys a whole cluster (docs/transfer.md): hit ratio and TTFT with transfer off
# and on, a restart with and without the drain handoff, scale-out with and without warm-up.
.PHONY: bench-cluster
bench-cluster: build $(BENCH_ROUTER) ## cluster hit ratio with page transfer, handoff, warm-up
	@bash bench/bench_cluster.sh

# The MoE test model (docs/moe.md): prefill/decode next to llama.cpp with the dense model beside
# it, and hit ratio and shard balance of hash vs expert KV shards under memory pressure.
.PHONY: bench-moe
bench-moe: build moe-model ## MoE speed next to llama.cpp; hash vs expert KV shards (docs/moe.md)
	@bash bench/bench_moe.sh

fixtures: build ## regenerates tests/fixtures from llama.cpp (needs its build)
	@bash tests/fixtures/gen_fixtures.sh

# ------------------------------------------------------------------ deployment
# The OCI image and its tests (docs/operations.md, "The container image"). Their packages
# (mmdebstrap, podman, buildah, runc, prometheus) come from deploy/image-deps.sh, never from
# `make deps`: `make test` neither needs nor installs a container runtime.
.PHONY: image-deps image image-test k8s-test systemd-test check-rules monitoring-test
image-deps: ## Debian packages for image, image-test (mmdebstrap, podman, buildah), check-rules, monitoring-test (prometheus)
	@bash deploy/image-deps.sh all

image: build ## OCI image localhost/kvmesh:REV (+ REV-model) from Debian packages, saved as build/kvmesh-image.tar
	@bash deploy/image-deps.sh image
	@bash deploy/image/build.sh

image-test: image ## loads build/kvmesh-image.tar, runs kvmesh up in a container, a completion from the host
	@bash deploy/image/test.sh

k8s-test: image ## deploy/k8s rendered and run with podman kube play: completions, a drain handoff, scaling 2 to 3
	@bash deploy/k8s/test.sh

systemd-test: image ## deploy/systemd's units under systemd as PID 1 in a podman container: order, completions, level 3 and SIGKILL restarts
	@bash deploy/systemd/test.sh

check-rules: ## promtool check rules and the rules' unit tests, deploy/prometheus (skipped without promtool)
	@bash deploy/prometheus/check.sh

monitoring-test: build ## a real Prometheus scrapes a kvmesh up cluster and answers each rule's query (skipped without prometheus)
	@bash deploy/prometheus/scrape_test.sh

# ------------------------------------------------------------------ hygiene
SRC_ALL = $(shell git ls-files '*.c' '*.h' 2>/dev/null)
fmt: ## clang-format every tracked C file
	clang-format -i $(SRC_ALL)

# Comments say why in a few lines; figures go to docs/benchmarks.md (CONTRIBUTING.md, "Comments").
.PHONY: check-comments
check-comments: ## no comment block over 12 lines but a file's opening one, no measurement in a comment
	@python3 tests/check_comments.py --self-test
	@python3 tests/check_comments.py

# emu512_avx2.c fills GCC vector locals lane by lane, which cppcheck takes for uninitialised reads.
lint: help-check check-comments ## clang-format check, cppcheck, comments, and a help note for every target (first step of make test)
	@echo "lint: clang-format --dry-run, cppcheck (about a minute)"
	@clang-format --dry-run --Werror $(SRC_ALL)
	@cppcheck --quiet --error-exitcode=1 --enable=warning,performance,portability \
	  --inline-suppr --suppress=missingIncludeSystem --suppress=unknownMacro \
	  --suppress=uninitvar:tests/unit/emu512_avx2.c -I. $(SRC_ALL) 2>&1

# Every .PHONY target has a `## ` note on its rule line (so `make help` lists it).
help-check: ## every .PHONY target has a help note
	@missing=$$(awk '/^\.PHONY:/ { l = $$0; while (l ~ /\\$$/ && (getline n) > 0) l = substr(l, 1, length(l) - 1) n; \
	  sub(/^\.PHONY:/, "", l); print l }' $(firstword $(MAKEFILE_LIST)) | tr ' ' '\n' | sort -u | \
	  while read -r t; do [ -z "$$t" ] || grep -qE "^$$t:[^=]*## " $(firstword $(MAKEFILE_LIST)) || echo "$$t"; done); \
	  if [ -n "$$missing" ]; then echo "make help: no '## ' note for: "$$missing >&2; exit 1; fi

clean: ## removes build/
	rm -rf build
