/* XXH3_64bits (seed 0, the default secret), written here from the algorithm's public description:
 * the checksum of a page, equal to the Python xxhash package's xxh3_64_intdigest (the tests compare
 * every length class and random splits of a stream).
 *
 * Inputs up to 240 bytes are hashed whole (xxh3.c). Longer ones are cut into 64-byte stripes, each
 * folded into eight 64-bit accumulators, which are scrambled after every 16 stripes (a 1024-byte
 * block); the stripe ending at the last byte is folded with its own key, and the accumulators are
 * merged into the result. That long loop is built once per instruction set (xxh3_kernel.h), and
 * the caller picks the one its CPU runs.
 *
 * The stream: an update never copies a long input through a buffer. It folds every stripe that has
 * at least one byte after it (the last stripe is folded differently, and only the digest knows
 * which one is last) straight from the caller's memory, and copies back only the stream's last 64
 * bytes: the 1 to 64 not folded yet, and before them those the last stripe reaches back into. Up
 * to 256 bytes in all it keeps everything, since up to 240 the hash is not the long one.
 */
#ifndef KVSTORE_NATIVE_XXH3_H
#define KVSTORE_NATIVE_XXH3_H
#include <stddef.h>
#include <stdint.h>

enum {
    XXH3_STRIPE_BYTES = 64,
    XXH3_HOLD_BYTES = 256,   /* kept before anything is folded: more than the 240 of a short hash */
};

typedef struct {
    /* [0, 64): the 64 stream bytes before the held ones, once anything is folded;
     * [64, 64 + held): the bytes not folded yet */
    _Alignas(64) uint8_t hold[XXH3_STRIPE_BYTES + XXH3_HOLD_BYTES];
    uint64_t acc[8];
    uint64_t total;      /* bytes given to update */
    uint32_t stripes;    /* stripes folded since the last scramble, 0 to 15 */
    uint32_t held;
} xxh3_state_t;

void xxh3_reset(xxh3_state_t *state);

/* One kernel per instruction set, all giving the same bits: SSE2 (every x86-64 CPU), AVX2 and
 * AVX-512F (only where the CPU has them), and portable C, the reference the tests hold the others to. */
uint64_t xxh3_64_scalar(const uint8_t *data, size_t nbytes);
void xxh3_update_scalar(xxh3_state_t *state, const uint8_t *data, size_t nbytes);
uint64_t xxh3_digest_scalar(const xxh3_state_t *state);

uint64_t xxh3_64_sse2(const uint8_t *data, size_t nbytes);
void xxh3_update_sse2(xxh3_state_t *state, const uint8_t *data, size_t nbytes);
uint64_t xxh3_digest_sse2(const xxh3_state_t *state);

uint64_t xxh3_64_avx2(const uint8_t *data, size_t nbytes);
void xxh3_update_avx2(xxh3_state_t *state, const uint8_t *data, size_t nbytes);
uint64_t xxh3_digest_avx2(const xxh3_state_t *state);
/* xxh3_update_avx2 of what it writes to dst (32-byte aligned, streamed) from src, the stream at a
 * stripe's end (xxh3_kernel.h). */
void xxh3_update_copy_avx2(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes);

uint64_t xxh3_64_avx512(const uint8_t *data, size_t nbytes);
void xxh3_update_avx512(xxh3_state_t *state, const uint8_t *data, size_t nbytes);
uint64_t xxh3_digest_avx512(const xxh3_state_t *state);
/* The same with AVX-512F (only where the CPU has it), dst 64-byte aligned. */
void xxh3_update_copy_avx512(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes);

/* Whether the stream so far is whole stripes. */
static inline int xxh3_at_stripe(const xxh3_state_t *state) {
    return state->held % XXH3_STRIPE_BYTES == 0;
}
#endif
