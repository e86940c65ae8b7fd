/* A C engine linking the installed kvpolicy::c: create a policy, compress a small cache. */
#include <kvpolicy/c/kvpolicy.h>
#include <stdio.h>

int main(void) {
  enum { L = 1, H = 2, T = 64, D = 8 };
  static float k[L * H * T * D], v[L * H * T * D];
  int64_t counts[L * H];
  kvp_selection sel = {L, H, 0, counts, NULL};
  kvp_tensor kt = kvp_tensor_hnd(k, KVP_F32, L, H, T, D);
  kvp_tensor vt = kvp_tensor_hnd(v, KVP_F32, L, H, T, D);
  kvp_compress_params params = kvp_compress_default_params();
  kvp_policy* policy = NULL;
  int i;
  for (i = 0; i < L * H * T * D; ++i) k[i] = (float)(i % 17) - 8.0f, v[i] = (float)(i % 5);
  if (kvp_policy_create("knorm", &policy) != KVP_OK ||
      kvp_compress(policy, &params, &kt, &vt, NULL, NULL, 0, &sel) != KVP_OK) {
    fprintf(stderr, "kvpolicy C ABI call failed: %s\n", kvp_last_error());
    return 1;
  }
  kvp_policy_destroy(policy);
  printf("kvpolicy %s via the C ABI: kept %lld and %lld of %d tokens\n", kvp_version(),
         (long long)counts[0], (long long)counts[1], T);
  return counts[0] == T / 2 && counts[1] == T / 2 ? 0 : 1;
}
