/* XXH3_64bits' long loop with AVX2 (xxh3_kernel.h): each of the two 256-bit registers holds four
 * lanes. Called only where the CPU has AVX2 (copy_hash.c asks). */
#pragma GCC target("avx2")
#define XXH3_KERNEL avx2
#define XXH3_KERNEL_AVX2
#include "xxh3_kernel.h"
