/* The kvpolicy C ABI from C11: a built-in policy, a plug-in scorer chained with a built-in
 * allocator, error handling, and a session. Built and run by the tests (examples.c_api).
 *
 *   cc -std=c11 c_api.c -lkvpolicy_c -lm
 */
#include <kvpolicy/c/kvpolicy.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { L = 2, H = 4, HQ = 8, T = 256, D = 64, NQ = 16 };

#define CHECK(call)                                                                       \
  do {                                                                                    \
    kvp_status s_ = (call);                                                               \
    if (s_ != KVP_OK) {                                                                   \
      fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call,            \
              kvp_status_string(s_), kvp_last_error());                                   \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

static float frand(unsigned* state) {
  *state = *state * 1664525u + 1013904223u;
  return (float)((*state >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* A plug-in scorer: keep the keys most similar to the newest key of their head (a toy
 * "recency of topic" heuristic). State: how many times it ran. */
typedef struct {
  int calls;
} similar_state;

static const char* similar_name(const void* state) {
  (void)state;
  return "similar";
}

static int similar_score(void* state, const kvp_score_args* a) {
  const kvp_tensor* k = &a->keys;
  const float* base = (const float*)k->data;
  int64_t l, h, t, i;
  if (k->dtype != KVP_F32) {
    kvp_plugin_set_error("similar: only float32 keys");
    return 1;
  }
  ((similar_state*)state)->calls++;
  for (l = 0; l < k->layers; ++l)
    for (h = 0; h < k->heads; ++h) {
      const float* row = base + l * k->stride_layer + h * k->stride_head;
      const float* last = row + (k->tokens - 1) * k->stride_token;
      for (t = 0; t < k->tokens; ++t) {
        float dot = 0.0f;
        for (i = 0; i < k->dim; ++i)
          dot += row[t * k->stride_token + i * k->stride_dim] * last[i * k->stride_dim];
        a->scores[(l * k->heads + h) * k->tokens + t] = dot;
      }
    }
  return 0;
}

static void similar_free(void* state) { free(state); }

int main(void) {
  size_t n = (size_t)L * H * T * D;
  float* keys = malloc(n * sizeof(float));
  float* values = malloc(n * sizeof(float));
  float* queries = malloc((size_t)L * HQ * NQ * D * sizeof(float));
  int64_t counts[L * H];
  int32_t indices[L * H * T];
  unsigned seed = 7;
  size_t i;
  int r;
  kvp_policy *snapkv = NULL, *mine = NULL, *bad = NULL;
  kvp_compress_params params = kvp_compress_default_params();
  kvp_tensor k = kvp_tensor_hnd(keys, KVP_F32, L, H, T, D);
  kvp_tensor v = kvp_tensor_hnd(values, KVP_F32, L, H, T, D);
  kvp_tensor q = kvp_tensor_hnd(queries, KVP_F32, L, HQ, NQ, D);
  kvp_selection sel;
  kvp_scorer_plugin plugin = kvp_scorer_plugin_default();
  similar_state* st = calloc(1, sizeof(similar_state));
  kvp_status status;

  if (!keys || !values || !queries || !st) return 1;
  for (i = 0; i < n; ++i) keys[i] = frand(&seed), values[i] = frand(&seed);
  for (i = 0; i < (size_t)L * HQ * NQ * D; ++i) queries[i] = frand(&seed);
  sel.layers = L, sel.heads = H, sel.capacity = T, sel.counts = counts, sel.indices = indices;

  printf("kvpolicy %s (C ABI %d)\n", kvp_version(), kvp_abi_version());

  /* 1. A built-in policy: SnapKV with Ada-KV head budgets, 25% of the cache. */
  CHECK(kvp_policy_create("snapkv(window=16) | adakv", &snapkv));
  params.budget.kind = KVP_BUDGET_RATIO;
  params.budget.value = 0.25;
  params.compact = 0; /* select only: the cache is reused below */
  CHECK(kvp_compress(snapkv, &params, &k, &v, &q, NULL, 0, &sel));
  printf("snapkv | adakv kept per (layer, head):");
  for (r = 0; r < L * H; ++r) printf(" %lld", (long long)counts[r]);
  printf("\n");

  /* 2. A plug-in scorer in the same chain, compacting in place. */
  plugin.state = st;
  plugin.name = similar_name;
  plugin.score = similar_score;
  plugin.free = similar_free; /* the policy owns st from here on */
  CHECK(kvp_policy_create_with_plugins("similar | adakv", &plugin, 1, &mine));
  params.compact = 1;
  CHECK(kvp_compress(mine, &params, &k, &v, NULL, NULL, 0, &sel));
  printf("similar | adakv kept per (layer, head):");
  for (r = 0; r < L * H; ++r) {
    int64_t j;
    printf(" %lld", (long long)counts[r]);
    for (j = 1; j < counts[r]; ++j)
      if (indices[r * T + j] <= indices[r * T + j - 1]) {
        fprintf(stderr, "indices of row %d are not ascending\n", r);
        return 1;
      }
    if (counts[r] == 0 || indices[r * T + counts[r] - 1] != T - 1) {
      fprintf(stderr, "row %d lost the newest token (it scores highest)\n", r);
      return 1;
    }
  }
  printf("  (plug-in calls: %d)\n", st->calls);

  /* 3. Errors are statuses with a message, never crashes. */
  status = kvp_policy_create("snapkv | adakv(alfa=2)", &bad);
  printf("bad spec -> %s: %s\n", kvp_status_string(status), kvp_last_error());
  if (status != KVP_ERROR_BAD_SPEC || bad != NULL) return 1;
  status = kvp_compress(snapkv, &params, &k, &v, NULL, NULL, 0, &sel);
  printf("missing queries -> %s: %s\n", kvp_status_string(status), kvp_last_error());
  if (status != KVP_ERROR_INVALID_ARGUMENT) return 1;

  /* 3b. The same policy on device tensors: kvp_cuda_compress_plan sizes the workspace and the
   * CSR output of kvp_cuda_compress (device pointers, a cudaStream_t). A stage without a device
   * path (here a merger, a Session stage) is refused by name; without a GPU the plan itself
   * fails. */
  {
    kvp_cuda_plan plan;
    kvp_policy* merging = NULL;
    CHECK(kvp_policy_create("snapkv | semantic", &merging));
    status = kvp_cuda_compress_plan(merging, &params, &k, &v, &q, &plan);
    printf("snapkv | semantic on the GPU -> %s: %s\n", kvp_status_string(status),
           kvp_last_error());
    kvp_policy_destroy(merging);
    if (status != KVP_ERROR_UNSUPPORTED) return 1;
    status = kvp_cuda_compress_plan(snapkv, &params, &k, &v, &q, &plan);
    if (status == KVP_OK)
      printf("snapkv | adakv on the GPU: %zu workspace bytes, %lld CSR indices\n",
             plan.workspace_bytes, (long long)plan.kept_capacity);
    else
      printf("snapkv | adakv on the GPU -> %s (%d devices)\n", kvp_status_string(status),
             kvp_cuda_device_count());
  }

  /* 4. A session: prefill 128 tokens, compress to 50%, decode 4 tokens. */
  {
    kvp_session_config cfg = kvp_session_default_config();
    kvp_session* s = NULL;
    int64_t lengths[H];
    float* out = malloc((size_t)HQ * 128 * D * sizeof(float));
    int step, layer, done = 0;
    cfg.layers = L, cfg.kv_heads = H, cfg.q_heads = HQ, cfg.head_dim = D;
    cfg.budget.kind = KVP_BUDGET_RATIO;
    cfg.budget.value = 0.5;
    if (!out) return 1;
    CHECK(kvp_session_create(snapkv, &cfg, &s));
    for (step = 0; step < 5; ++step) {
      int64_t tok = step == 0 ? 128 : 1;
      for (layer = 0; layer < L; ++layer) {
        /* Any [1][H][tok][D] slice of the random data serves as new K/V/Q here. */
        kvp_tensor nk = kvp_tensor_hnd(keys, KVP_F32, 1, H, tok, D);
        kvp_tensor nv = kvp_tensor_hnd(values, KVP_F32, 1, H, tok, D);
        kvp_tensor nq = kvp_tensor_hnd(keys, KVP_F32, 1, HQ, tok, D);
        CHECK(kvp_session_append(s, layer, &nk, &nv, &nq));
        CHECK(kvp_session_attend(s, layer, &nq, out, (size_t)HQ * 128 * D));
        CHECK(kvp_session_compress_if_due(s, layer, &done));
      }
    }
    CHECK(kvp_session_lengths(s, 0, lengths, H));
    printf("session layer 0 lengths after 128 + 4 tokens at 50%%:");
    for (r = 0; r < H; ++r) printf(" %lld", (long long)lengths[r]);
    printf("\n");
    {
      int64_t total = 0; /* adakv splits the 4 x 64 prefill budget unevenly over heads */
      for (r = 0; r < H; ++r) total += lengths[r];
      if (total != H * 64 + H * 4) return 1;
    }
    kvp_session_destroy(s);
    free(out);
  }

  kvp_policy_destroy(mine); /* frees st */
  kvp_policy_destroy(snapkv);
  free(keys);
  free(values);
  free(queries);
  printf("ok\n");
  return 0;
}
