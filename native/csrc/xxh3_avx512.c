/* XXH3_64bits' long loop with AVX-512 (xxh3_kernel.h): the eight lanes in one 512-bit register, a
 * stripe one load, and the copying stream's stores whole cache lines. Called only where the CPU has
 * AVX-512F (copy_hash.c asks). */
#pragma GCC target("avx512f")
#define XXH3_KERNEL avx512
#define XXH3_KERNEL_AVX512
#include "xxh3_kernel.h"
