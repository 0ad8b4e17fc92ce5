/* XXH3_64bits' parts that do not depend on the instruction set: the hash of inputs of at most
 * 240 bytes, one length class at a time, the long hash's merge, and a stream's reset (see xxh3.h). */
#include "xxh3.h"
#include "xxh3_parts.h"

const uint8_t xxh3_secret[XXH3_SECRET_BYTES] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

const uint64_t xxh3_acc_init[8] = {
    XXH3_PRIME32_3, XXH3_PRIME64_1, XXH3_PRIME64_2, XXH3_PRIME64_3,
    XXH3_PRIME64_4, XXH3_PRIME32_2, XXH3_PRIME64_5, XXH3_PRIME32_1,
};

/* XXH64's final mix, which the shortest classes end with. */
static uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= XXH3_PRIME64_2;
    h ^= h >> 29;
    h *= XXH3_PRIME64_3;
    return h ^ (h >> 32);
}

static inline uint64_t rotl64(uint64_t v, int r) {
    return (v << r) | (v >> (64 - r));
}

/* 4 to 8 bytes' final mix, stronger than the avalanche: the input is one 64-bit word. */
static uint64_t rrmxmx(uint64_t h, uint64_t nbytes) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= XXH3_PRIME_MX2;
    h ^= (h >> 35) + nbytes;
    h *= XXH3_PRIME_MX2;
    return h ^ (h >> 28);
}

static uint64_t len_1to3(const uint8_t *p, size_t n) {
    uint32_t combined = (uint32_t)p[0] << 16 | (uint32_t)p[n >> 1] << 24 | (uint32_t)p[n - 1] | (uint32_t)n << 8;
    uint64_t key = xxh3_read32(xxh3_secret) ^ xxh3_read32(xxh3_secret + 4);
    return xxh64_avalanche(combined ^ key);
}

static uint64_t len_4to8(const uint8_t *p, size_t n) {
    uint64_t first = xxh3_read32(p), last = xxh3_read32(p + n - 4);
    uint64_t key = xxh3_read64(xxh3_secret + 8) ^ xxh3_read64(xxh3_secret + 16);
    return rrmxmx((last + (first << 32)) ^ key, n);
}

static uint64_t len_9to16(const uint8_t *p, size_t n) {
    uint64_t lo = xxh3_read64(p) ^ xxh3_read64(xxh3_secret + 24) ^ xxh3_read64(xxh3_secret + 32);
    uint64_t hi = xxh3_read64(p + n - 8) ^ xxh3_read64(xxh3_secret + 40) ^ xxh3_read64(xxh3_secret + 48);
    return xxh3_avalanche(n + __builtin_bswap64(lo) + hi + xxh3_fold(lo, hi));
}

/* 16 input bytes against 16 secret bytes: the step of every class from 17 to 240 bytes. */
static inline uint64_t mix16(const uint8_t *p, const uint8_t *key) {
    return xxh3_fold(xxh3_read64(p) ^ xxh3_read64(key), xxh3_read64(p + 8) ^ xxh3_read64(key + 8));
}

/* Pairs of 16 bytes from both ends, working inwards, each pair against the next 32 secret bytes. */
static uint64_t len_17to128(const uint8_t *p, size_t n) {
    uint64_t acc = n * XXH3_PRIME64_1;
    size_t pairs = (n - 1) / 32;   /* 0 to 3 pairs besides the outermost one */
    for (size_t i = pairs + 1; i-- > 0;)
        acc += mix16(p + 16 * i, xxh3_secret + 32 * i) + mix16(p + n - 16 * (i + 1), xxh3_secret + 32 * i + 16);
    return xxh3_avalanche(acc);
}

/* 16-byte rounds from the start: the first 8 against the secret's first 128 bytes, then an
 * avalanche, the rest against the secret from byte 3; last, the input's last 16 bytes. */
static uint64_t len_129to240(const uint8_t *p, size_t n) {
    uint64_t acc = n * XXH3_PRIME64_1;
    size_t rounds = n / 16;
    for (size_t i = 0; i < 8; i++)
        acc += mix16(p + 16 * i, xxh3_secret + 16 * i);
    acc = xxh3_avalanche(acc);
    for (size_t i = 8; i < rounds; i++)
        acc += mix16(p + 16 * i, xxh3_secret + 16 * (i - 8) + 3);
    acc += mix16(p + n - 16, xxh3_secret + 136 - 17);
    return xxh3_avalanche(acc);
}

uint64_t xxh3_short(const uint8_t *data, size_t nbytes) {
    if (nbytes > 128)
        return len_129to240(data, nbytes);
    if (nbytes > 16)
        return len_17to128(data, nbytes);
    if (nbytes > 8)
        return len_9to16(data, nbytes);
    if (nbytes >= 4)
        return len_4to8(data, nbytes);
    if (nbytes)
        return len_1to3(data, nbytes);
    return xxh64_avalanche(xxh3_read64(xxh3_secret + 56) ^ xxh3_read64(xxh3_secret + 64));
}

uint64_t xxh3_merge(const uint64_t acc[8], uint64_t total) {
    uint64_t h = total * XXH3_PRIME64_1;
    for (int i = 0; i < 4; i++) {
        const uint8_t *key = xxh3_secret + XXH3_MERGE_KEY + 16 * i;
        h += xxh3_fold(acc[2 * i] ^ xxh3_read64(key), acc[2 * i + 1] ^ xxh3_read64(key + 8));
    }
    return xxh3_avalanche(h);
}

void xxh3_reset(xxh3_state_t *state) {
    memcpy(state->acc, xxh3_acc_init, sizeof(state->acc));
    state->total = 0;
    state->stripes = 0;
    state->held = 0;
}
