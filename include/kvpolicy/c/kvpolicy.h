/* kvpolicy C ABI: KV-cache compression policies for engines written in C, C++, Rust or Go,
 * without the C++ types. Library: kvpolicy::c (libkvpolicy_c).
 *
 * Conventions
 * - Every call that can fail returns a kvp_status; KVP_OK is 0. On failure, kvp_last_error()
 *   returns a message for the calling thread naming the argument or input at fault, and no
 *   caller buffer has been modified unless the function says otherwise.
 * - Handles (kvp_policy, kvp_session) are opaque and created from spec strings such as
 *   "snapkv(window=32) | adakv" (see README: policies and parameters). kvp_*_destroy(NULL) is a
 *   no-op.
 * - Threads: kvp_last_error() is per thread. A kvp_session is used by one thread at a time;
 *   sessions are independent of each other. A kvp_policy is only read by the calls that take it
 *   as const (kvp_compress, kvp_compress_batch, kvp_compress_paged, kvp_session_create,
 *   kvp_policy_clone, kvp_policy_get_info): threads may share one in those calls at the same
 *   time; kvp_policy_reset and kvp_policy_destroy need it to themselves. A plug-in scorer's state
 *   is shared by its policy, the sessions made from it and clones without a clone callback: its
 *   callbacks must be thread-safe if those run on several threads, or each thread takes a
 *   kvp_policy_clone of its own.
 * - All buffers are the caller's. Tensors are strided views (kvp_tensor, strides in elements)
 *   over host memory; the kvp_cuda_* functions take device pointers and a cudaStream_t passed
 *   as void*.
 * - Structs with a struct_size field must be initialized with their *_default_*() function (so
 *   that a newer library can tell which fields an older caller knows).
 * - Workspace queries follow the two-phase protocol of CUB: ask the size, allocate, call.
 *   The CPU reference path keeps its scratch (scores, candidate lists) on the heap and reports
 *   0 bytes; the CUDA functions use only the caller's workspace.
 */
#ifndef KVPOLICY_C_KVPOLICY_H
#define KVPOLICY_C_KVPOLICY_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#if defined(KVPOLICY_C_BUILDING)
#define KVP_API __declspec(dllexport)
#else
#define KVP_API __declspec(dllimport)
#endif
#elif defined(__GNUC__)
#define KVP_API __attribute__((visibility("default")))
#else
#define KVP_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Status and errors ------------------------------------------------------------------- */

/* 2: kvp_compress_params.shard and kvp_policy_info.spans_heads (tensor parallelism).
 * 3: kvp_cuda_compress_plan and kvp_cuda_compress (a whole policy on device tensors).
 * 4: kvp_compress_params.reconstruction, alloc_state, rope_inv_freq (kvzip, ams's credit and
 *    expected attention's frequencies per call, host or device).
 * 5: kvp_cuda_compress(_plan) take kvp_compress_params.shard (tensor parallelism on device).
 * 6: kvp_cuda_session_* (the decode loop of a sequence on the device). */
#define KVP_ABI_VERSION 6

typedef enum kvp_status {
  KVP_OK = 0,
  KVP_ERROR_INVALID_ARGUMENT = 1, /* null pointer, shape, stride, budget, NaN/Inf input */
  KVP_ERROR_BAD_SPEC = 2,         /* unknown policy or parameter, stages out of order */
  KVP_ERROR_BUFFER_TOO_SMALL = 3, /* an output or workspace below what the call needs */
  KVP_ERROR_SHARED_BLOCK = 4,     /* paged: a compaction would write a shared block */
  KVP_ERROR_UNSUPPORTED = 5,      /* not in this build (CUDA) or not for this policy */
  KVP_ERROR_PLUGIN = 6,           /* a plug-in scorer failed or returned non-finite scores */
  KVP_ERROR_CUDA = 7,             /* a CUDA runtime call or kernel launch failed */
  KVP_ERROR_OUT_OF_MEMORY = 8,
  KVP_ERROR_INTERNAL = 9
} kvp_status;

/* The message of the last failing call on this thread ("" if none); valid until the next
 * kvpolicy call on this thread. */
KVP_API const char* kvp_last_error(void);
/* The warning of the last call on this thread that succeeded but departed from the policy to
 * honour the budget ("" if none): a budget below the scorer's protected window keeps the newest
 * tokens (kvp_compress, kvp_session_compress_if_due). Valid until the next kvpolicy call on
 * this thread. */
KVP_API const char* kvp_last_warning(void);
/* A static name for a status ("KVP_OK", ...). */
KVP_API const char* kvp_status_string(kvp_status status);
/* Library version "major.minor.patch" and the ABI version it implements (KVP_ABI_VERSION). */
KVP_API const char* kvp_version(void);
KVP_API int kvp_abi_version(void);

/* ---- Tensors ----------------------------------------------------------------------------- */

typedef enum kvp_dtype { KVP_F32 = 0, KVP_F16 = 1, KVP_BF16 = 2 } kvp_dtype;

/* A strided 4-d view [layer][head][token][dim]; strides in elements, all >= 0, no two elements
 * aliased. data == NULL marks an absent optional tensor. */
typedef struct kvp_tensor {
  void* data;
  kvp_dtype dtype;
  int64_t layers, heads, tokens, dim;
  int64_t stride_layer, stride_head, stride_token, stride_dim;
} kvp_tensor;

/* Contiguous [layer][head][token][dim] (HND) and [layer][token][head][dim] (NHD) views. */
KVP_API kvp_tensor kvp_tensor_hnd(void* data, kvp_dtype dtype, int64_t layers, int64_t heads,
                                  int64_t tokens, int64_t dim);
KVP_API kvp_tensor kvp_tensor_nhd(void* data, kvp_dtype dtype, int64_t layers, int64_t heads,
                                  int64_t tokens, int64_t dim);

/* ---- Budgets and parameters -------------------------------------------------------------- */

typedef enum kvp_budget_kind {
  KVP_BUDGET_RATIO = 0,    /* keep round(value * tokens) per (layer, KV head); value in [0, 1] */
  KVP_BUDGET_PER_HEAD = 1, /* keep value tokens per (layer, KV head) */
  KVP_BUDGET_TOTAL = 2     /* keep value tokens over all (layer, KV head) rows */
} kvp_budget_kind;

typedef struct kvp_budget {
  kvp_budget_kind kind;
  double value;
} kvp_budget;

/* Tensor parallelism over KV heads: this call holds heads [first_head, first_head + heads of
 * keys) of the model's model_heads, and ranks 0..ranks-1 hold ascending, contiguous ranges. Every
 * rank calls kvp_compress with the same policy and budget; each keeps exactly what one call over
 * every head would keep for its heads. Policies whose stages combine heads (adakv, tova,
 * expected; kvp_policy_info.spans_heads) exchange a few numbers through all_gather, which the
 * engine implements with its communicator (NCCL, MPI): every rank calls it with the same
 * `bytes`; recv (ranks * bytes) receives rank r's `send` at offset r * bytes; it blocks until
 * recv is filled and returns 0, or nonzero on failure (the call then fails with
 * KVP_ERROR_INVALID_ARGUMENT). all_gather may be NULL for policies that combine no heads. An
 * error on one rank's arguments is reported by every rank (no rank is left waiting). What is
 * exchanged, in bytes per event: README, "Tensor parallelism". */
typedef struct kvp_head_shard {
  int64_t rank, ranks;
  int64_t first_head, model_heads;
  int (*all_gather)(void* user, const void* send, void* recv, size_t bytes);
  void* user;
} kvp_head_shard;

typedef struct kvp_compress_params {
  uint32_t struct_size;
  kvp_budget budget;     /* default: ratio 0.5 */
  int compact;           /* nonzero (default): compact keys/values in place; 0: select only */
  int threads;           /* OpenMP threads of the CPU path; <= 0 (default): OpenMP's default */
  /* NULL (default): the call holds every KV head. kvp_compress and kvp_cuda_compress(_plan)
   * (kvp_compress_batch and kvp_compress_paged refuse a shard with KVP_ERROR_UNSUPPORTED). */
  const kvp_head_shard* shard;
  /* Per-event inputs some stages read; NULL (default): not given. In host memory for
   * kvp_compress, in device memory for kvp_cuda_compress (rope_inv_freq: host memory for both);
   * kvp_compress_batch and kvp_compress_paged refuse them (KVP_ERROR_UNSUPPORTED). Row strides
   * in floats, 0 (default): the event's tokens.
   * reconstruction: kvzip's context-reconstruction scores, [L][Hkv] rows (a session computes
   *   them itself: kvp_session_reconstruct).
   * alloc_state: ams's credit, [L][Hkv] rows, read and updated in place: zero a new sequence's,
   *   and keep each row's kept entries with the cache (gather them by the selection's indices;
   *   on the device kvp_cuda_compact of an [L][Hkv][T][1] float32 tensor does it); NULL: a
   *   first event (credit 0).
   * rope_inv_freq: expected attention's inverse RoPE frequencies, rope_pairs = head_dim / 2
   *   floats; NULL: its spec needs theta=. */
  const float* reconstruction;
  int64_t reconstruction_stride;
  float* alloc_state;
  int64_t alloc_state_stride;
  const float* rope_inv_freq;
  int64_t rope_pairs;
} kvp_compress_params;

KVP_API kvp_compress_params kvp_compress_default_params(void);

/* ---- Plug-in scorers --------------------------------------------------------------------- */

/* What a plug-in reads, besides the keys it always gets (bit flags). */
#define KVP_NEEDS_VALUES 2u
#define KVP_NEEDS_QUERIES 4u
/* kvp_policy_info only (a plug-in cannot ask for it): context-reconstruction scores, which only a
 * session holds (kvp_session_reconstruct; the kvzip scorer). */
#define KVP_NEEDS_RECONSTRUCTION 16u

typedef struct kvp_score_args {
  kvp_tensor keys;    /* [L][Hkv][T][d], the caller's dtype */
  kvp_tensor values;  /* data == NULL unless the plug-in needs values */
  kvp_tensor queries; /* [L][Hq][n][d], the last n <= query_window queries; data may be NULL */
  float* scores;      /* output, fp32 [L][Hkv][T] contiguous: higher = keep; fill every entry */
} kvp_score_args;

/* A scorer written outside the library. It takes the place of a built-in scorer: its name is
 * the first stage of a spec ("mine | adakv"); allocators, selection and compaction are the
 * library's. Required: name, score. Optional (NULL): reset, clone, free. */
typedef struct kvp_scorer_plugin {
  uint32_t struct_size; /* kvp_scorer_plugin_default() sets it */
  void* state;          /* passed to every callback */
  /* The spec name: [a-z0-9_]+, not a built-in stage's name. Copied at policy creation. */
  const char* (*name)(const void* state);
  /* Fill args->scores; return 0 on success, anything else fails the call with
   * KVP_ERROR_PLUGIN (kvp_plugin_set_error() adds a message). Called on the thread that called
   * kvp_compress / kvp_session_* (never on a library worker thread); calls overlap only when
   * threads share the plug-in's state (see Conventions: Threads). */
  int (*score)(void* state, const kvp_score_args* args);
  /* A new sequence starts (kvp_policy_reset, kvp_session_create). */
  void (*reset)(void* state);
  /* A deep copy of the state, for kvp_policy_clone; NULL: clones share the state. Returns NULL
   * on failure. */
  void* (*clone)(const void* state);
  /* Releases the state when the last policy holding it is destroyed. */
  void (*free)(void* state);
  uint32_t needs;       /* KVP_NEEDS_* bits */
  int64_t query_window; /* queries it reads: 0 none (default), n the last n, -1 every one given */
  int64_t sinks;        /* first tokens always kept (count toward the budget); default 0 */
  int64_t recent;       /* last tokens always kept; default 0 */
} kvp_scorer_plugin;

KVP_API kvp_scorer_plugin kvp_scorer_plugin_default(void);
/* From inside a score callback: the message kvp_last_error() will carry with KVP_ERROR_PLUGIN. */
KVP_API void kvp_plugin_set_error(const char* message);

/* ---- Policies ---------------------------------------------------------------------------- */

typedef struct kvp_policy kvp_policy;

KVP_API kvp_status kvp_policy_create(const char* spec, kvp_policy** out);
/* Like kvp_policy_create, with plug-in scorers the spec may name. On success the policy owns the
 * state of the plug-in its spec uses (its free callback runs when the last policy holding it is
 * destroyed); the others stay the caller's. On failure nothing is owned. */
KVP_API kvp_status kvp_policy_create_with_plugins(const char* spec,
                                                  const kvp_scorer_plugin* plugins,
                                                  size_t num_plugins, kvp_policy** out);
/* An independent copy (a plug-in state is cloned when the plug-in has a clone callback). */
KVP_API kvp_status kvp_policy_clone(const kvp_policy* policy, kvp_policy** out);
KVP_API void kvp_policy_destroy(kvp_policy* policy);
/* Calls the plug-in's reset, if any (no-op for built-in scorers). */
KVP_API kvp_status kvp_policy_reset(kvp_policy* policy);

typedef struct kvp_policy_info {
  const char* spec;        /* canonical spec, owned by the policy */
  const char* scorer;      /* scorer name, owned by the policy */
  uint32_t needs;          /* KVP_NEEDS_* bits of the scorer and allocators */
  int64_t query_window;    /* queries read: 0 none, -1 every query given, n the last n */
  int decode_time;         /* 1: evicts at every decode step (h2o) */
  int has_merger;          /* 1: a merger stage (needs a session) */
  int has_quantizer;       /* 1: a quantizer stage (needs a session) */
  int spans_heads;         /* 1: a stage combines KV heads (kvp_head_shard needs all_gather) */
} kvp_policy_info;

KVP_API kvp_status kvp_policy_get_info(const kvp_policy* policy, kvp_policy_info* out);

/* ---- Dense compression ------------------------------------------------------------------- */

/* Output of a selection, caller-owned: per (layer, KV head) row r = layer * heads + head,
 * counts[r] kept tokens whose indices (ascending) are indices[r * capacity ...]. indices may be
 * NULL (counts only); otherwise capacity must be >= the number of tokens. */
typedef struct kvp_selection {
  int64_t layers, heads, capacity;
  int64_t* counts;  /* [layers * heads] */
  int32_t* indices; /* [layers * heads * capacity] or NULL */
} kvp_selection;

/* 0 on the CPU path (see Conventions). */
KVP_API kvp_status kvp_compress_workspace_size(const kvp_policy* policy, const kvp_tensor* keys,
                                               const kvp_compress_params* params,
                                               size_t* bytes);

/* One compression event over a whole cache: select per (layer, KV head) with the policy, then
 * (params->compact) move the kept rows of keys and values to the front of each row, in place.
 * keys, values: [L][Hkv][T][d], same dtype; values may be NULL for a selection-only call whose
 * policy does not read them. queries: [L][Hq][n][d], the last n queries (NULL if the policy reads
 * none). Everything is checked before the first write. Policies with a merger or quantizer
 * stage need a session (KVP_ERROR_UNSUPPORTED). */
KVP_API kvp_status kvp_compress(const kvp_policy* policy, const kvp_compress_params* params,
                                const kvp_tensor* keys, const kvp_tensor* values,
                                const kvp_tensor* queries, void* workspace,
                                size_t workspace_bytes, kvp_selection* out);

/* A sequence of a dense batch. Layers, heads and head_dim must agree across the batch; token
 * counts may differ. budget: NULL for params->budget. */
typedef struct kvp_sequence {
  kvp_tensor keys, values, queries; /* values/queries: data NULL when absent */
  const kvp_budget* budget;
} kvp_sequence;

/* Compresses every sequence (same result as one kvp_compress per sequence). All sequences are
 * checked before any is written: on error none is modified. out: one selection per sequence
 * (may be NULL when params->compact is set and the selections are not wanted). */
KVP_API kvp_status kvp_compress_batch(const kvp_policy* policy, const kvp_compress_params* params,
                                      const kvp_sequence* seqs, size_t num_seqs,
                                      kvp_selection* out);

/* ---- Paged KV ---------------------------------------------------------------------------- */

typedef enum kvp_layout { KVP_LAYOUT_NHD = 0, KVP_LAYOUT_HND = 1 } kvp_layout;

/* A pool of fixed-size pages (blocks) of page_size tokens; strides in elements. */
typedef struct kvp_paged_tensor {
  void* data;
  kvp_dtype dtype;
  int64_t num_blocks, layers, heads, page_size, dim;
  int64_t stride_layer, stride_block, stride_head, stride_token, stride_dim;
} kvp_paged_tensor;

/* Contiguous pools: NHD pages [layer][block][token][head][dim] (vLLM), HND pages
 * [layer][block][head][token][dim] (FlashInfer's HND). */
KVP_API kvp_paged_tensor kvp_paged_tensor_make(kvp_layout layout, void* data, kvp_dtype dtype,
                                               int64_t num_blocks, int64_t layers,
                                               int64_t heads, int64_t page_size, int64_t dim);

/* One request: its block table (logical page i -> block id, distinct ids), its length in
 * tokens, its last queries (data NULL if none) and budget (NULL: params->budget). */
typedef struct kvp_paged_sequence {
  const int32_t* block_table;
  int64_t num_pages; /* entries in block_table, >= ceil(length / page_size) */
  int64_t length;
  kvp_tensor queries;
  const kvp_budget* budget;
} kvp_paged_sequence;

/* Per request, caller-owned. The kept tokens of each (layer, head) move to the front of the
 * request's own blocks (ids never change): the table keeps its first pages_used entries and the
 * blocks of the emptied entries are listed in freed_blocks. With per-head budgets (adakv) heads
 * keep different counts: new_length is the largest, and head r's rows past lengths[r] are stale
 * (mask them). compacted == 0 means a shared block would have been written: nothing was written
 * for this request, and the call returns KVP_ERROR_SHARED_BLOCK after the other requests. */
typedef struct kvp_paged_result {
  int64_t new_length;
  int64_t pages_used;
  int32_t* freed_blocks;   /* caller buffer of freed_capacity entries (>= num_pages is enough) */
  int64_t freed_capacity;
  int64_t num_freed;
  int64_t* lengths;        /* [layers * heads] or NULL */
  int compacted;
} kvp_paged_result;

/* Compresses requests of one pool. shared: NULL, or one flag per block id (nonzero: read-only,
 * e.g. a prefix-cache block; it is never written). Every request is checked before any write
 * (including that no block id appears in two tables). */
KVP_API kvp_status kvp_compress_paged(const kvp_policy* policy, const kvp_compress_params* params,
                                      const kvp_paged_tensor* keys,
                                      const kvp_paged_tensor* values, const uint8_t* shared,
                                      const kvp_paged_sequence* seqs, size_t num_seqs,
                                      kvp_paged_result* results);

/* ---- Sessions (decode loops) ------------------------------------------------------------- */

typedef struct kvp_session kvp_session;

typedef struct kvp_session_config {
  uint32_t struct_size;
  int64_t layers, kv_heads, q_heads, head_dim; /* required */
  kvp_budget budget;                           /* after prefill; default ratio 1 (keep all) */
  int64_t initial_capacity;                    /* tokens per head; default 256 */
  int64_t decode_interval;                     /* 0: the policy's default (see README) */
  int has_decode_target;                       /* 1: use decode_target */
  kvp_budget decode_target;
  int threads;                                 /* <= 0: OpenMP's default */
} kvp_session_config;

KVP_API kvp_session_config kvp_session_default_config(void);

/* A float32 KV cache of one sequence that compresses itself with the policy (prefill budget,
 * then decode-time targets), merges and quantizes when the policy says so. The session keeps a
 * copy of the policy. */
KVP_API kvp_status kvp_session_create(const kvp_policy* policy, const kvp_session_config* config,
                                      kvp_session** out);
KVP_API void kvp_session_destroy(kvp_session* session);
/* n new tokens of `layer`: k, v [1][Hkv][n][d], q [1][Hq][n][d] (NULL if the policy reads no
 * queries), all float32. */
KVP_API kvp_status kvp_session_append(kvp_session* session, int64_t layer, const kvp_tensor* k,
                                      const kvp_tensor* v, const kvp_tensor* q);
/* Causal attention of q [1][Hq][n][d] (the last n appended tokens) over the layer's cache:
 * out float32 [Hq][n][d], out_len = Hq * n * d. */
KVP_API kvp_status kvp_session_attend(kvp_session* session, int64_t layer, const kvp_tensor* q,
                                      float* out, size_t out_len);
/* Context reconstruction, for the kvzip scorer. After the prefill and before the first
 * compression, an engine runs a teacher-forced pass that repeats the context in chunks ("Repeat
 * the previous context exactly." then the context's tokens; see the README). For each chunk and
 * layer it passes the chunk's q [1][Hq][n][d] and k, v [1][Hkv][n][d] (float32, post-RoPE,
 * positions after the cache) here instead of append + attend. The call writes their causal
 * attention over the cache and the chunk's earlier tokens to out [Hq][n][d]
 * (out_len >= Hq * n * d), and raises each cached token's score to the largest attention
 * probability it receives. The chunk is not kept. */
KVP_API kvp_status kvp_session_reconstruct(kvp_session* session, int64_t layer,
                                           const kvp_tensor* k, const kvp_tensor* v,
                                           const kvp_tensor* q, float* out, size_t out_len);
/* Zeroes every layer's reconstruction scores, so that a new pass starts from zero. */
KVP_API kvp_status kvp_session_clear_reconstruction(kvp_session* session);
/* Compresses `layer` if due (prefill, then every decode interval); *compressed (may be NULL) is
 * set to 1 if it did. */
KVP_API kvp_status kvp_session_compress_if_due(kvp_session* session, int64_t layer,
                                               int* compressed);
/* Tokens held by each KV head of `layer`: out [kv_heads]. */
KVP_API kvp_status kvp_session_lengths(const kvp_session* session, int64_t layer, int64_t* out,
                                       size_t n);
/* Copies the kept rows of (layer, head): keys/values [length][d] float32 and their original
 * positions [length]; any output may be NULL; capacity_tokens is the room in each. A quantized
 * layer has no float rows (KVP_ERROR_UNSUPPORTED; positions still work). */
KVP_API kvp_status kvp_session_read(const kvp_session* session, int64_t layer, int64_t head,
                                    float* keys, float* values, int32_t* positions,
                                    int64_t capacity_tokens);
/* Bytes of K/V the valid tokens hold (packed bytes for quantized layers). */
KVP_API kvp_status kvp_session_kv_bytes(const kvp_session* session, size_t* out);

/* ---- CUDA (device pointers; KVP_ERROR_UNSUPPORTED in a build without CUDA) --------------- */

/* Visible CUDA devices; 0 without CUDA, a driver or a device. */
KVP_API int kvp_cuda_device_count(void);

/* Device CSR selection: row r's ascending indices are indices[offsets[r] .. offsets[r+1]). */
typedef struct kvp_csr {
  int64_t layers, heads;
  int64_t* offsets; /* [layers * heads + 1] */
  int32_t* indices; /* [capacity] */
  int64_t capacity;
} kvp_csr;

KVP_API kvp_status kvp_cuda_select_workspace_size(int64_t rows, int64_t tokens, size_t* bytes);
/* Batched top-k of fp32 scores [layers][heads][tokens] (row r at scores + r * row_stride) with
 * protected sinks/recent tokens; budgets on the host, one per row. Asynchronous on `stream`. */
KVP_API kvp_status kvp_cuda_select(const float* scores, int64_t layers, int64_t heads,
                                   int64_t tokens, int64_t row_stride, const int64_t* budgets,
                                   int64_t sinks, int64_t recent, void* workspace,
                                   size_t workspace_bytes, void* stream, kvp_csr* out);
KVP_API kvp_status kvp_cuda_compact_workspace_size(const kvp_tensor* kv, size_t* bytes);
/* In-place gather-compact of a device tensor with a device CSR selection. */
KVP_API kvp_status kvp_cuda_compact(const kvp_tensor* kv, const kvp_csr* selection,
                                    void* workspace, size_t workspace_bytes, void* stream);

/* A whole policy on device tensors: the policy's scorer and allocators select on the GPU, then
 * (params->compact) keys and values are compacted in place, every kernel on `stream`. Device
 * stages: scorers snapkv, h2o, tova, knorm, keydiff, streaming, expected (its RoPE base from
 * the spec, "expected(theta=...)", or params->rope_inv_freq), kvzip (params->reconstruction, in
 * device memory); allocators uniform, pyramid, depthkv, adakv, ams (its credit in
 * params->alloc_state, device memory; NULL: a first event). A plug-in scorer, or a policy with
 * a merger or quantizer gives KVP_ERROR_UNSUPPORTED (use kvp_compress). The kept sets equal
 * kvp_compress's on the same data (expected attention's up to near-ties: its device scores
 * equal the host's to fp32 rounding).
 * params->shard (tensor parallelism over KV heads, as for kvp_compress): each rank passes its own
 * heads' device tensors and keeps what one call over every head keeps for them. adakv exchanges
 * through all_gather on the host (two more host synchronisations: this rank's scores are
 * downloaded, the budgets uploaded); tova and expected, which combine heads inside the scorer,
 * give KVP_ERROR_INVALID_ARGUMENT under a shard of more than one rank. With adakv, every rank
 * calls kvp_cuda_compress_plan and kvp_cuda_compress alike (each takes part in the ranks'
 * agreement on their arguments; a NULL policy, keys or params, or a bad struct_size, fails
 * only the rank that passed it, as for kvp_compress), and kept_capacity is every token of the
 * rank's rows.
 * keys, values, queries: device memory, as kvp_compress takes them (values may be NULL when
 * params->compact is 0). params->threads is ignored. NaN/Inf in the inputs are not checked.
 * One host synchronisation per call: the per-row budgets are computed on the host and uploaded
 * before the first kernel (it waits for the work already on `stream`); the rest is asynchronous,
 * and `out` is ready when `stream` is. kvp_last_warning() as for kvp_compress. */
typedef struct kvp_cuda_plan {
  size_t workspace_bytes; /* the call's workspace (256-byte aligned, e.g. from cudaMalloc) */
  int64_t rows;           /* layers * KV heads: out->offsets holds rows + 1 entries */
  int64_t kept_capacity;  /* out->capacity the call needs */
} kvp_cuda_plan;

/* Sizes for kvp_cuda_compress with these arguments (shapes only; the data is not read). */
KVP_API kvp_status kvp_cuda_compress_plan(const kvp_policy* policy,
                                          const kvp_compress_params* params,
                                          const kvp_tensor* keys, const kvp_tensor* values,
                                          const kvp_tensor* queries, kvp_cuda_plan* out);
KVP_API kvp_status kvp_cuda_compress(const kvp_policy* policy, const kvp_compress_params* params,
                                     const kvp_tensor* keys, const kvp_tensor* values,
                                     const kvp_tensor* queries, void* workspace,
                                     size_t workspace_bytes, void* stream, kvp_csr* out);

/* ---- CUDA sessions (ABI 6) ---------------------------------------------------------------- */

/* kvp_session's decode loop on a GPU (C++: kvpolicy::cuda::Session; see the README): the KV
 * cache of one sequence, its per-token state and the policy's query window in device memory of
 * the CUDA device current at creation (every later call must be made with it current), every
 * kernel on `stream` (a cudaStream_t; NULL: the legacy default stream). Same configuration and
 * compression schedule as kvp_session (config.threads is unused); `dtype` is the cache's element
 * type, which every tensor passed later must have. KVP_ERROR_UNSUPPORTED, naming the stage: a
 * quantizer, the nearest merger, semantic(chunk=0), kvzip, a plug-in scorer or another stage
 * without a device path. KVP_ERROR_INVALID_ARGUMENT: head_dim other than 64, 128 or 256, or more
 * query heads per KV head than the device attention holds (86, 58, 32 at those head_dims). A
 * failed CUDA call (device memory included) gives KVP_ERROR_CUDA. Without CUDA in the build,
 * kvp_cuda_session_create checks its arguments and the policy as above, then gives
 * KVP_ERROR_UNSUPPORTED, as every other kvp_cuda_session_* call does. Host synchronisation: at
 * creation, at each compression (budgets up, row offsets down, lengths up), when device memory
 * grows (by doubling; the C ABI has no reserve), in an attend of more query rows than one launch
 * holds (a prefill: chunk lengths up) and in kvp_cuda_session_positions; a decode step's append
 * and attend are asynchronous, so their inputs must stay valid until the stream has run them. */
typedef struct kvp_cuda_session kvp_cuda_session;
KVP_API kvp_status kvp_cuda_session_create(const kvp_policy* policy,
                                           const kvp_session_config* config, kvp_dtype dtype,
                                           void* stream, kvp_cuda_session** out);
KVP_API void kvp_cuda_session_destroy(kvp_cuda_session* session);
/* n new tokens of `layer`: k, v [1][Hkv][n][d], q [1][Hq][n][d] (NULL if the policy reads no
 * queries): device tensors of the session's dtype, any strides. Not checked for NaN. */
KVP_API kvp_status kvp_cuda_session_append(kvp_cuda_session* session, int64_t layer,
                                           const kvp_tensor* k, const kvp_tensor* v,
                                           const kvp_tensor* q);
/* Causal attention of q [1][Hq][n][d] (device; the last n appended tokens) over the layer's
 * cache into out (device float32 [Hq][n][d], out_len >= Hq * n * d); accumulates the H2O
 * statistics the policy reads. */
KVP_API kvp_status kvp_cuda_session_attend(kvp_cuda_session* session, int64_t layer,
                                           const kvp_tensor* q, float* out, size_t out_len);
/* As kvp_session_compress_if_due. */
KVP_API kvp_status kvp_cuda_session_compress_if_due(kvp_cuda_session* session, int64_t layer,
                                                    int* compressed);
/* Tokens held by each KV head of `layer` (host memory, no synchronisation): out [kv_heads]. */
KVP_API kvp_status kvp_cuda_session_lengths(const kvp_cuda_session* session, int64_t layer,
                                            int64_t* out, size_t n);
/* The layer's cache as device tensors [1][Hkv][capacity][d] of the session's dtype (head h's
 * valid rows: its length), for an engine's own attention kernels, ordered on the session's
 * stream; valid until the next append or compression. Only for policies whose attention is the
 * plain one: with a merger, rows carry log(count) on their logits, and h2o reads statistics that
 * only kvp_cuda_session_attend accumulates. Either output may be NULL. */
KVP_API kvp_status kvp_cuda_session_cache(const kvp_cuda_session* session, int64_t layer,
                                          kvp_tensor* keys, kvp_tensor* values);
/* Original positions of (layer, head)'s kept tokens into host memory out [capacity_tokens >=
 * length]; waits for the stream. */
KVP_API kvp_status kvp_cuda_session_positions(const kvp_cuda_session* session, int64_t layer,
                                              int64_t head, int32_t* out,
                                              int64_t capacity_tokens);
/* Bytes of K/V the valid tokens hold. */
KVP_API kvp_status kvp_cuda_session_kv_bytes(const kvp_cuda_session* session, size_t* out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVPOLICY_C_KVPOLICY_H */
