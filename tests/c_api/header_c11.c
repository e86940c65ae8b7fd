/* The C ABI header must compile as strict C11 with every warning an error (tests/CMakeLists.txt
 * builds this file with -std=c11 -Wall -Wextra -pedantic -Werror). Referencing each type and a
 * few entry points makes the compiler check their declarations, not just the preprocessor. */
#include <kvpolicy/c/kvpolicy.h>

_Static_assert(KVP_ABI_VERSION >= 1, "ABI version");
_Static_assert(KVP_OK == 0, "KVP_OK is zero");

int kvp_header_c11_check(void);
int kvp_header_c11_check(void) {
  kvp_tensor t = kvp_tensor_hnd(0, KVP_F32, 1, 1, 1, 1);
  kvp_paged_tensor p = kvp_paged_tensor_make(KVP_LAYOUT_NHD, 0, KVP_F16, 1, 1, 1, 16, 64);
  kvp_compress_params params = kvp_compress_default_params();
  kvp_session_config cfg = kvp_session_default_config();
  kvp_scorer_plugin plugin = kvp_scorer_plugin_default();
  kvp_selection sel = {1, 1, 1, 0, 0};
  kvp_paged_result res = {0, 0, 0, 0, 0, 0, 0};
  kvp_csr csr = {0, 0, 0, 0, 0};
  kvp_policy_info info;
  (void)info;
  return (int)(t.dim + p.page_size + params.compact + cfg.layers + (int64_t)plugin.needs +
               sel.capacity + res.num_freed + csr.capacity);
}
