/* copy_hash and copy_out_hash with xxh3's AVX2 kernel, chosen at run time where the CPU has AVX2. */
#pragma GCC target("avx2")
#define COPY_HASH_NAME copy_hash_avx2
#define COPY_HASH_UPDATE_NAME copy_hash_update_avx2
#define COPY_OUT_HASH_NAME copy_out_hash_avx2
#define HASH_UPDATE xxh3_update_avx2
#define HASH_DIGEST xxh3_digest_avx2
#define COPY_AND_HASH xxh3_update_copy_avx2
/* Its stores need 32-byte alignment, but a stripe 32 bytes past a line fills halves of two lines, which go
 * out part-filled: gets of 1 MiB pages into such a buffer ran at 3.6 GB/s, through the bounce (whose stream
 * starts at a line) 4.6. */
#define COPY_AND_HASH_ALIGN 64
#include "copy_hash_body.h"

/* copy_streamed where the CPU has AVX2: copy_hash's streamed stores, fenced so they are visible on return. */
void copy_streamed_avx2(uint8_t *dst, const uint8_t *src, size_t nbytes) {
    copy_stream(dst, src, nbytes);
    _mm_sfence();
}
