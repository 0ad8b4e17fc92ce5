/* XXH3_64bits' long loop in portable C, one lane at a time (xxh3_kernel.h): the plain statement
 * of the stripe arithmetic, which the tests hold the vector kernels to (and a start for a CPU
 * with neither SSE2 nor AVX2). */
#define XXH3_KERNEL scalar
#include "xxh3_kernel.h"
