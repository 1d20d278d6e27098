"""Tunable constants, one place, a sentence each: sizes that trade memory for speed or set the
granularity of reuse. None changes a result (every value gives the same tokens); they change
what is allocated, copied or batched. Settings a user picks per engine or server are config
fields (``EngineConfig``, ``ServingConfig``), not these; where one defaults to a value here, the
field names it.
"""

# -- reuse granularity ----------------------------------------------------------------------------
# Tokens per reusable block: KV pool blocks and automatic prefix reuse (the server's and the
# terminal chat's); a prompt's first len // BLOCK_SIZE blocks can be shared. Smaller blocks share
# more of a partly equal prompt and cost more keys and lookups; vLLM's default is 16 too.
BLOCK_SIZE = 16

# -- assembly buffers (cache.py, engine/facade.py, engine/batch.py) -------------------------------
# Splice buffer capacities are rounded up to a multiple of this many slots, so prompts of nearby
# lengths reuse one buffer instead of each allocating its own.
CAPACITY_GRANULE = 256
# Slots past a schema's end that the buffer prewarmed at registration holds: room for a prompt's
# own text and the first generated tokens before the buffer grows.
PREWARM_SLACK = 64
# Slots added to every (re)allocation of a batched decode's cache beyond the rows' remaining
# generation, so a joining row rarely forces a reallocation.
DECODE_SLACK = 64
# Overlapped host -> device copies go in this many groups of layers: one copy per span and group
# (launching a copy costs CPU time; fewer groups mean larger copies and a later first layer).
COPY_GROUPS = 4

# -- serving (engine/serving_core/scheduler.py, engine/serving_core/paged.py) -------------------------------------------------
# Prefill tokens a scheduler step runs even when decode rows use up the token budget, so a queue
# of new prompts always moves.
MIN_CHUNK = 16
# Decode rows whose own part is at most this many tokens are gathered into one padded batch; a
# longer one (a request that computed its whole prompt) is read in place on its own: padding every
# row to it made the gather of many rows behind a long prompt cost more than the step's attention
# (eval/results/design_figures.md).
GATHER_MAX = 256
# With the native gather op, a decode row reads the shared segments it holds in the pool in the same
# call as its own tokens (their slots prepended to its own): no partial result per segment and no
# merge, where cascade attention's per-segment calls and merges cost more than reading a short
# shared prefix once per row (a RAG batch: one or two small shared runs per row; eval/results/batch.md).
# Segments read in place from a store tensor are runs of their own (the gather op over runs); prefill
# rows: FOLD_PREFILL.
FOLD_SHARED = True
# Prefill rows (chunks, selective recompute's rows) that read documents read them (pool slots or a
# store's tensors, at any shift) and their own tokens with the native kernel as runs of one slot
# list, each query seeing its prefix of each (``attend_prefill_runs``): every such row of a step in
# one call a layer (a RAG batch's admission 1.6-1.8x faster: eval/results/batch.md). A row reading
# no document keeps the causal call (a plain 2K prompt's prefill was 6-15% slower over runs).
FOLD_PREFILL = True
# Without the native CPU kernel (kernels/attention.py; it reads decode rows' own keys by slot
# itself), decode rows' own tokens are attended with plain matrix products (one batched product,
# softmax, one product) from this many rows on, with torch's fused CPU attention below it. The fused kernel
# pays per (row, head) item, so matrix products win from 8 rows on and the fused kernel is as fast
# or faster below (SmolLM2's heads; eval/results/design_figures.md).
DECODE_MATMUL_ROWS = 8
# A set of queries reading more than this many separate shared segments (a prompt whose blocks were
# allocated in pieces from a fragmented pool) reads them concatenated, one attention call a layer:
# 256 one-block segments of a 4K prompt were 256 calls and merges a layer, several times the step
# of the same prompt in one run (eval/results/design_figures.md).
SEGMENTS_MAX = 4
# Without the native CPU kernel (the path a GPU takes), a step's rows are attended in one call a layer
# over their keys gathered from the pool by slot (engine/serving_core/dense.py): queries padded to the
# step's longest row, keys to its longest key list. A step whose padded scores would hold more than
# this many elements for one query head a KV head (KV heads x rows x queries x keys; the float32 scores
# and the bias are that times the query heads a KV head: 64 MB each at 4) is attended in groups of rows
# that each fit, a call a group (decode rows apart from prefill rows: dense.dense_steps); only a row
# alone past it keeps the per-part calls and their merges (logged).
DENSE_MAX = 1 << 22
# On that path, stored states a request could read in place from a store tier's tensor (a document,
# a module) are copied into the pool once instead, as a shared read-only entry every request reads
# (the whole stored segment: the runs selective recompute leaves of it read as slots of that entry):
# they then join the one call a layer. Read in place, each (document, shift) group was an attention
# call and a merge of its own (~1,150 aten calls a layer for 48 RAG questions; eval/results/host_overhead.md).
POOL_DOCUMENTS = True
# Compiled steps (RunnerConfig.compile) of at most the last size's tokens are compiled; with CUDA
# graphs a step's tokens and logits rows are padded up to one of these sizes, each pair one graph,
# compiled once (lazily: only the pairs that occur). Steps larger than the last run eagerly: they
# are bound by their matrix products and compiling gains nothing there; 128 holds the new tokens
# of a 99%-cached 8K prompt (engine/serving_core/graphs.py).
COMPILE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Decode steps over persistent buffers (RunnerConfig.cuda_graphs, engine/serving_core/graphs.py):
# a step's rows are padded up to one of these batch sizes and its keys a row up to a multiple of
# GRAPH_WIDTH, each (batch, width, rotation) one bucket, on a GPU one CUDA graph captured at its
# first step. Larger steps run as before. Finer sizes pad less and capture more graphs (a capture
# takes a fraction of a second; the graphs share one memory pool, about the largest one's memory).
GRAPH_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
GRAPH_WIDTH = 128
# Buckets kept at once (least recently used dropped first, with their graph and buffers).
GRAPHS_KEPT = 32
# Overlapped decode (engine/serving_core/scheduler.py, ``ServingScheduler.overlap``): a steady greedy
# decode batch launches its next step (input ids: this step's argmax, on the device) before the host
# reads this step's tokens, so the device computes step N+1 while the host checks stops, detokenizes
# and streams step N. "auto": on a GPU only (on a CPU the forward and the host share the cores: the
# outputs would come one forward later for nothing); True / False: everywhere / nowhere.
OVERLAP_STEPS = "auto"

# -- window-aware storage (engine/prefill/window_reads.py) ----------------------------------------
# Bytes of whole states encoded again for readers a trimming tier (disk, Redis) kept too little for,
# held in memory per engine and per DocumentStore (least recently used dropped first), so a prompt
# that reads a trimmed span before its end encodes it once, not on every call.
WHOLE_STATES_BYTES = 256 << 20
