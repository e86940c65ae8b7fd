// The Policy member templates that instantiate the whole registry (policy.hpp: merge, select,
// compress), compiled once per build for float, the element type nearly every unit uses (half
// and bfloat16 instances stay in the units that use them: the C ABI, the Python module, some
// tests; compiling all three here cost more than it saved). The project's tests, engine,
// command-line tool and benchmarks link this unit (CMake target kvpolicy_instances) and declare
// the float instances extern (KVPOLICY_EXTERN_TEMPLATES), which takes their code generation out
// of each of those units. The installed library stays header-only.
#include "kvpolicy/policy.hpp"

namespace kvpolicy {
KVPOLICY_POLICY_INSTANCES(, float)
}  // namespace kvpolicy
