/* The prefix-hash chain: key_i = SHA-256(key_{i-1} || page_i's tokens as uint32 LE), as hex; a page
 * with a token past uint32 is SHA-256(key_{i-1} || 0xff || its tokens as uint64 LE), as SGLang's
 * hash_binding.cpp hashes it. Tokens past INT64_MAX, or negative, are refused, as SGLang refuses them.
 *
 * Where the CPU has the SHA extensions, pages are hashed by sha256_ni.c (each page's first block
 * fed the digest before it from registers: a 128k-token chain of 16-token pages in 0.89 ms where
 * libcrypto took 1.03, one core, the two alternated in one run); elsewhere by
 * OpenSSL's low-level SHA256 (libcrypto, the one Python's hashlib loads; declared in
 * libcrypto_sha256.h), whose one-shot EVP interface would look its algorithm up again for every
 * page, which costs more than hashing a 64-token page. Tokens are packed into a small stack
 * buffer per page, checked for range first, so the caller's array is never copied whole.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "libcrypto_sha256.h"
#include "prefix_hash.h"
#include "sha256_ni.h"

enum { PACK_BYTES = 4096 };   /* tokens packed per SHA256_Update: 4 KiB of stack */

/* Each byte's two hex digits, byte b's at 2 * b, where the CPU lacks SSSE3: one 2-byte copy a byte
 * instead of two table reads and the shifts between them (encoding was a sixth of a long token
 * chain's hashing). */
static const char HEX_PAIRS[513] =
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"
    "404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f"
    "606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f"
    "808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f"
    "a0a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebf"
    "c0c1c2c3c4c5c6c7c8c9cacbcccdcecfd0d1d2d3d4d5d6d7d8d9dadbdcdddedf"
    "e0e1e2e3e4e5e6e7e8e9eaebecedeeeff0f1f2f3f4f5f6f7f8f9fafbfcfdfeff";

/* Sixteen bytes' digits at once: each nibble looks its digit up in one register. */
__attribute__((target("ssse3")))
static void to_hex_ssse3(const uint8_t digest[32], char out[64]) {
    const __m128i digits = _mm_setr_epi8('0', '1', '2', '3', '4', '5', '6', '7', '8', '9', 'a', 'b', 'c', 'd', 'e', 'f');
    const __m128i nibble = _mm_set1_epi8(0x0f);
    for (int half = 0; half < 2; half++) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(digest + 16 * half));
        __m128i high = _mm_shuffle_epi8(digits, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
        __m128i low = _mm_shuffle_epi8(digits, _mm_and_si128(bytes, nibble));
        _mm_storeu_si128((__m128i *)(out + 32 * half), _mm_unpacklo_epi8(high, low));
        _mm_storeu_si128((__m128i *)(out + 32 * half + 16), _mm_unpackhi_epi8(high, low));
    }
}

void to_hex(const uint8_t digest[32], char out[64]) {
    static int ssse3 = -1;
    if (ssse3 < 0) {
        __builtin_cpu_init();
        ssse3 = __builtin_cpu_supports("ssse3");
    }
    if (ssse3) {
        to_hex_ssse3(digest, out);
        return;
    }
    for (int i = 0; i < 32; i++)
        memcpy(out + 2 * i, HEX_PAIRS + 2 * digest[i], 2);
}

/* One page's SHA-256, by whichever kernel the chain was given. */
typedef struct {
    int sha_ni;
    union { Sha256Ni ni; SHA256_CTX libcrypto; } ctx;
} PageHash;

static inline void page_hash_init(PageHash *h) {
    if (h->sha_ni)
        sha256_ni_init(&h->ctx.ni);
    else
        SHA256_Init(&h->ctx.libcrypto);
}

static inline void page_hash_update(PageHash *h, const void *data, size_t nbytes) {
    if (h->sha_ni)
        sha256_ni_update(&h->ctx.ni, data, nbytes);
    else
        SHA256_Update(&h->ctx.libcrypto, data, nbytes);
}

static inline void page_hash_final(PageHash *h, uint8_t digest[32]) {
    if (h->sha_ni)
        sha256_ni_final(digest, &h->ctx.ni);
    else
        SHA256_Final(digest, &h->ctx.libcrypto);
}

int prefix_hash_kernel(const char *name) {
    if (!name || !strcmp(name, "auto"))
        return cpu_sha_ni() ? PREFIX_HASH_SHA_NI : PREFIX_HASH_LIBCRYPTO;
    if (!strcmp(name, "libcrypto"))
        return PREFIX_HASH_LIBCRYPTO;
    if (!strcmp(name, "sha_ni"))
        return cpu_sha_ni() ? PREFIX_HASH_SHA_NI : -1;
    return -1;
}

/* Token t of a buffer whose elements are `itemsize` bytes, signed or not; -1 when it is outside
 * 0..INT64_MAX, which SGLang refuses too (a negative int64 reads past INT64_MAX as uint64). */
static inline int64_t token_at(const uint8_t *tokens, size_t t, int itemsize, int is_signed) {
    if (itemsize == 4) {
        uint32_t v;
        memcpy(&v, tokens + 4 * t, 4);
        return is_signed && (int32_t)v < 0 ? -1 : (int64_t)v;
    }
    uint64_t v;
    memcpy(&v, tokens + 8 * t, 8);
    return v > (uint64_t)INT64_MAX ? -1 : (int64_t)v;
}

/* 1 if a token of the page is past uint32 (the page is hashed wide), 0 if none, -1 if one is out of range. */
static int page_is_wide(const uint8_t *tokens, size_t first, size_t n, int itemsize, int is_signed) {
    int wide = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t v = token_at(tokens, first + i, itemsize, is_signed);
        if (v < 0)
            return -1;
        wide |= v > 0xFFFFFFFFLL;
    }
    return wide;
}

/* Feeds tokens [first, first + n) as uint32 (wide = 0) or uint64 LE, packed a stack buffer at a time
 * (the machine is little-endian: setup.py checks). Every token is in range (page_is_wide said so). */
static void update_tokens(PageHash *hash, const uint8_t *tokens, size_t first, size_t n, int itemsize,
                          int is_signed, int wide) {
    union { uint32_t narrow[PACK_BYTES / 4]; uint64_t wide[PACK_BYTES / 8]; } packed;
    size_t per_pack = PACK_BYTES / (wide ? 8 : 4);
    for (size_t done = 0; done < n;) {
        size_t k = n - done < per_pack ? n - done : per_pack;
        for (size_t i = 0; i < k; i++) {
            int64_t v = token_at(tokens, first + done + i, itemsize, is_signed);
            if (wide)
                packed.wide[i] = (uint64_t)v;
            else
                packed.narrow[i] = (uint32_t)v;
        }
        page_hash_update(hash, &packed, k * (wide ? 8 : 4));
        done += k;
    }
}

int prefix_hash_chain(const uint8_t *tokens, size_t count, int itemsize, int is_signed,
                      size_t page_tokens, const uint8_t *prior, size_t prior_bytes, int kernel,
                      uint8_t (*digests)[32]) {
    size_t pages = count / page_tokens;
    /* A uint32 array in this machine's order is hashed straight from the caller's memory. */
    int direct = itemsize == 4 && !is_signed && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
    static const uint8_t wide_tag = 0xff;   /* SGLang's mark of a page hashed as uint64s */
    /* After the first page (whose prior may be any length), sha256_ni_chain takes the rest in one call. */
    int chained = direct && kernel == PREFIX_HASH_SHA_NI && 4 * page_tokens >= 32 && pages > 1;
    for (size_t p = 0; p < (chained ? 1 : pages); p++) {
        size_t first = p * page_tokens;
        int wide = direct ? 0 : page_is_wide(tokens, first, page_tokens, itemsize, is_signed);
        if (wide < 0)
            return -1;
        PageHash hash = {.sha_ni = kernel == PREFIX_HASH_SHA_NI};
        page_hash_init(&hash);
        if (p > 0)
            page_hash_update(&hash, digests[p - 1], 32);
        else if (prior_bytes)
            page_hash_update(&hash, prior, prior_bytes);
        if (direct) {
            page_hash_update(&hash, tokens + 4 * first, 4 * page_tokens);
        } else {
            if (wide)
                page_hash_update(&hash, &wide_tag, 1);
            update_tokens(&hash, tokens, first, page_tokens, itemsize, is_signed, wide);
        }
        page_hash_final(&hash, digests[p]);
    }
    if (chained)
        sha256_ni_chain(tokens + 4 * page_tokens, pages - 1, 4 * page_tokens, digests[0], digests + 1);
    return 0;
}
