/* SHA-256 with the x86 SHA extensions (SHA-NI), for the prefix chain's short messages.
 *
 * A chain page is the digest before it and a page of token ids: two or three 64-byte blocks, every
 * one of them waiting on the one before, so a chain runs at the rounds' latency, not their
 * throughput. sha256_ni_chain feeds each page's first block the previous digest straight from the
 * registers its rounds left it in (no byte swap, no store and reload) and keeps a page's padding
 * block ready; a streaming context (Sha256Ni) serves the first page, whose prior has any length.
 * prefix_hash.c takes this path only where the CPU has the extensions (cpu_sha_ni), else libcrypto.
 */
#include <immintrin.h>
#include <string.h>

#include "sha256_ni.h"

static const uint32_t ROUND_CONSTANTS[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t INITIAL_STATE[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

int cpu_sha_ni(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("sha") && __builtin_cpu_supports("sse4.1");
    }
    return known;
}

#define SHA_TARGET __attribute__((target("sha,sse4.1"), always_inline)) static inline

/* Each 32-bit word's bytes reversed: message words and digests are big-endian. */
SHA_TARGET __m128i big_endian(__m128i words) {
    return _mm_shuffle_epi8(words, _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL));
}

/* The state a..h (two registers, a and e in their low words) in the order sha256rnds2 keeps it,
 * ABEF and CDGH, and back. */
SHA_TARGET void to_rounds_order(__m128i abcd, __m128i efgh, __m128i *abef, __m128i *cdgh) {
    __m128i badc = _mm_shuffle_epi32(abcd, 0xB1), hgfe = _mm_shuffle_epi32(efgh, 0x1B);
    *abef = _mm_alignr_epi8(badc, hgfe, 8);
    *cdgh = _mm_blend_epi16(hgfe, badc, 0xF0);
}

SHA_TARGET void from_rounds_order(__m128i abef, __m128i cdgh, __m128i *abcd, __m128i *efgh) {
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B), dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    *abcd = _mm_blend_epi16(feba, dchg, 0xF0);
    *efgh = _mm_alignr_epi8(dchg, feba, 8);
}

/* One block's 64 rounds on ABEF/CDGH, its sixteen message words four a register (big-endian
 * already); the message schedule four words a register too. */
SHA_TARGET void block_rounds(__m128i *abef, __m128i *cdgh, __m128i w0, __m128i w1, __m128i w2, __m128i w3) {
    __m128i abef_in = *abef, cdgh_in = *cdgh, w[4] = {w0, w1, w2, w3};
    for (int quad = 0; quad < 16; quad++) {
        if (quad >= 4) {   /* W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16], four at a time */
            __m128i older = _mm_sha256msg1_epu32(w[quad & 3], w[(quad + 1) & 3]);
            older = _mm_add_epi32(older, _mm_alignr_epi8(w[(quad + 3) & 3], w[(quad + 2) & 3], 4));
            w[quad & 3] = _mm_sha256msg2_epu32(older, w[(quad + 3) & 3]);
        }
        __m128i with_k = _mm_add_epi32(w[quad & 3], _mm_loadu_si128((const __m128i *)(ROUND_CONSTANTS + 4 * quad)));
        *cdgh = _mm_sha256rnds2_epu32(*cdgh, *abef, with_k);
        *abef = _mm_sha256rnds2_epu32(*abef, *cdgh, _mm_shuffle_epi32(with_k, 0x0E));
    }
    *abef = _mm_add_epi32(*abef, abef_in);
    *cdgh = _mm_add_epi32(*cdgh, cdgh_in);
}

SHA_TARGET __m128i message_words(const uint8_t *at) {
    return big_endian(_mm_loadu_si128((const __m128i *)at));
}

SHA_TARGET void blocks_rounds(__m128i *abef, __m128i *cdgh, const uint8_t *blocks, size_t count) {
    for (; count; count--, blocks += 64)
        block_rounds(abef, cdgh, message_words(blocks), message_words(blocks + 16), message_words(blocks + 32),
                     message_words(blocks + 48));
}

/* Compresses `count` 64-byte blocks into state (a..h). */
__attribute__((target("sha,sse4.1")))
static void compress(uint32_t state[8], const uint8_t *blocks, size_t count) {
    __m128i abef, cdgh, abcd, efgh;
    to_rounds_order(_mm_loadu_si128((const __m128i *)state), _mm_loadu_si128((const __m128i *)(state + 4)),
                    &abef, &cdgh);
    blocks_rounds(&abef, &cdgh, blocks, count);
    from_rounds_order(abef, cdgh, &abcd, &efgh);
    _mm_storeu_si128((__m128i *)state, abcd);
    _mm_storeu_si128((__m128i *)(state + 4), efgh);
}

/* A page's message is the digest before it and its page_bytes: its first block takes that digest's
 * words from the registers the last page's rounds left them in (the digest's big-endian words are
 * the state itself), so no page waits for its predecessor's digest to go through memory. */
__attribute__((target("sha,sse4.1")))
void sha256_ni_chain(const uint8_t *data, size_t pages, size_t page_bytes, const uint8_t first[32],
                     uint8_t (*digests)[32]) {
    size_t rest = page_bytes - 32, whole = rest / 64, tail = rest % 64;
    uint8_t padding[128] = {0};   /* the tail of each page, 0x80, zeros, the message's length in bits */
    size_t padding_blocks = tail + 9 <= 64 ? 1 : 2;
    uint64_t bits = (uint64_t)(32 + page_bytes) * 8;
    padding[tail] = 0x80;
    for (int i = 0; i < 8; i++)
        padding[64 * padding_blocks - 1 - i] = (uint8_t)(bits >> (8 * i));
    __m128i initial_abef, initial_cdgh;
    to_rounds_order(_mm_loadu_si128((const __m128i *)INITIAL_STATE),
                    _mm_loadu_si128((const __m128i *)(INITIAL_STATE + 4)), &initial_abef, &initial_cdgh);
    __m128i abcd = message_words(first), efgh = message_words(first + 16);
    for (size_t p = 0; p < pages; p++, data += page_bytes) {
        __m128i abef = initial_abef, cdgh = initial_cdgh;
        block_rounds(&abef, &cdgh, abcd, efgh, message_words(data), message_words(data + 16));
        blocks_rounds(&abef, &cdgh, data + 32, whole);
        memcpy(padding, data + 32 + 64 * whole, tail);
        blocks_rounds(&abef, &cdgh, padding, padding_blocks);
        from_rounds_order(abef, cdgh, &abcd, &efgh);
        _mm_storeu_si128((__m128i *)digests[p], big_endian(abcd));
        _mm_storeu_si128((__m128i *)(digests[p] + 16), big_endian(efgh));
    }
}

void sha256_ni_init(Sha256Ni *ctx) {
    memcpy(ctx->state, INITIAL_STATE, sizeof INITIAL_STATE);
    ctx->buffered = 0;
    ctx->length = 0;
}

void sha256_ni_update(Sha256Ni *ctx, const void *data, size_t nbytes) {
    const uint8_t *in = data;
    ctx->length += nbytes;
    if (ctx->buffered) {
        size_t take = 64 - ctx->buffered < nbytes ? 64 - ctx->buffered : nbytes;
        memcpy(ctx->block + ctx->buffered, in, take);
        ctx->buffered += take, in += take, nbytes -= take;
        if (ctx->buffered < 64)
            return;
        compress(ctx->state, ctx->block, 1);
        ctx->buffered = 0;
    }
    if (nbytes >= 64) {   /* whole blocks straight from the caller's memory */
        compress(ctx->state, in, nbytes / 64);
        in += nbytes & ~(size_t)63, nbytes &= 63;
    }
    memcpy(ctx->block, in, nbytes);
    ctx->buffered = nbytes;
}

void sha256_ni_final(uint8_t digest[32], Sha256Ni *ctx) {
    uint64_t bits = ctx->length * 8;
    ctx->block[ctx->buffered++] = 0x80;
    if (ctx->buffered > 56) {
        memset(ctx->block + ctx->buffered, 0, 64 - ctx->buffered);
        compress(ctx->state, ctx->block, 1);
        ctx->buffered = 0;
    }
    memset(ctx->block + ctx->buffered, 0, 56 - ctx->buffered);
    for (int i = 0; i < 8; i++)
        ctx->block[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    compress(ctx->state, ctx->block, 1);
    for (int i = 0; i < 8; i++) {
        uint32_t word = ctx->state[i];
        digest[4 * i] = (uint8_t)(word >> 24), digest[4 * i + 1] = (uint8_t)(word >> 16);
        digest[4 * i + 2] = (uint8_t)(word >> 8), digest[4 * i + 3] = (uint8_t)word;
    }
}
