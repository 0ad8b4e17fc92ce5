/* copy_hash and copy_out_hash with xxh3's AVX-512 kernel, chosen at run time where the CPU has
 * AVX-512F: a stripe is one register, and the slot is written a whole cache line a store. */
#pragma GCC target("avx512f")
#define COPY_HASH_NAME copy_hash_avx512
#define COPY_HASH_UPDATE_NAME copy_hash_update_avx512
#define COPY_OUT_HASH_NAME copy_out_hash_avx512
#define HASH_UPDATE xxh3_update_avx512
#define HASH_DIGEST xxh3_digest_avx512
#define COPY_AND_HASH xxh3_update_copy_avx512
#define COPY_AND_HASH_ALIGN 4   /* a line a store from any 4-byte boundary (xxh3_kernel.h: fold_to_shifted) */
#define COPY_STREAM_AVX512
#include "copy_hash_body.h"

/* copy_streamed where the CPU has AVX-512F. */
void copy_streamed_avx512(uint8_t *dst, const uint8_t *src, size_t nbytes) {
    copy_stream(dst, src, nbytes);
    _mm_sfence();
}
