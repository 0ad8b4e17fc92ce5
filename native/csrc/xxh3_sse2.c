/* XXH3_64bits' long loop with SSE2 (xxh3_kernel.h), which every x86-64 CPU has: what runs where
 * the CPU has no AVX2. */
#define XXH3_KERNEL sse2
#define XXH3_KERNEL_SSE2
#include "xxh3_kernel.h"
