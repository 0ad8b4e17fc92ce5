/* copy_hash and copy_out_hash with xxhash's AVX2 kernel, chosen at run time where the CPU has AVX2. */
#pragma GCC target("avx2")
#define XXH_VECTOR XXH_AVX2
#define COPY_HASH_NAME copy_hash_avx2
#define COPY_OUT_HASH_NAME copy_out_hash_avx2
#include "copy_hash_body.h"
