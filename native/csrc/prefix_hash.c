/* The prefix-hash chain: key_i = SHA-256(key_{i-1} || page_i's tokens as uint32 LE), as hex.
 *
 * OpenSSL's low-level SHA256 (libcrypto, the one Python's hashlib loads; declared in
 * libcrypto_sha256.h) compresses with SHA-NI where the CPU has it; the one-shot EVP interface
 * would look its algorithm up again for every page, which costs more than hashing a 64-token
 * page. Tokens are packed into a small stack buffer per page, checked to fit uint32 on the way,
 * so the caller's array is never copied whole.
 */
#include <stdint.h>
#include <string.h>

#include "libcrypto_sha256.h"
#include "prefix_hash.h"

enum { PACK_TOKENS = 1024 };   /* tokens packed per SHA256_Update: 4 KiB of stack */

static const char HEX[] = "0123456789abcdef";

void to_hex(const uint8_t digest[32], char out[64]) {
    for (int i = 0; i < 32; i++) {
        out[2 * i] = HEX[digest[i] >> 4];
        out[2 * i + 1] = HEX[digest[i] & 15];
    }
}

/* Little-endian uint32 of token t of a buffer whose elements are `itemsize` bytes, signed or
 * not; -1 when it does not fit in uint32. */
static inline int64_t token_at(const uint8_t *tokens, size_t t, int itemsize, int is_signed) {
    if (itemsize == 4) {
        uint32_t v;
        memcpy(&v, tokens + 4 * t, 4);
        return is_signed && (int32_t)v < 0 ? -1 : (int64_t)v;
    }
    uint64_t v;
    memcpy(&v, tokens + 8 * t, 8);
    if (is_signed ? ((int64_t)v < 0 || (int64_t)v > 0xFFFFFFFFLL) : v > 0xFFFFFFFFULL)
        return -1;
    return (int64_t)v;
}

int prefix_hash_chain(const uint8_t *tokens, size_t count, int itemsize, int is_signed,
                      size_t page_tokens, const uint8_t *prior, size_t prior_bytes,
                      uint8_t (*digests)[32]) {
    size_t pages = count / page_tokens;
    /* A uint32 array in this machine's order is hashed straight from the caller's memory. */
    int direct = itemsize == 4 && !is_signed && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
    uint32_t packed[PACK_TOKENS];
    for (size_t p = 0; p < pages; p++) {
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        if (p > 0)
            SHA256_Update(&ctx, digests[p - 1], 32);
        else if (prior_bytes)
            SHA256_Update(&ctx, prior, prior_bytes);
        size_t first = p * page_tokens;
        if (direct) {
            SHA256_Update(&ctx, tokens + 4 * first, 4 * page_tokens);
        } else {
            for (size_t done = 0; done < page_tokens;) {
                size_t n = page_tokens - done < PACK_TOKENS ? page_tokens - done : PACK_TOKENS;
                for (size_t i = 0; i < n; i++) {
                    int64_t v = token_at(tokens, first + done + i, itemsize, is_signed);
                    if (v < 0)
                        return -1;
                    packed[i] = (uint32_t)v;   /* the machine is little-endian (setup.py checks) */
                }
                SHA256_Update(&ctx, packed, 4 * n);
                done += n;
            }
        }
        SHA256_Final(digests[p], &ctx);
    }
    return 0;
}
