/* What xxh3.c and the long loop's kernels (xxh3_kernel.h) share: the algorithm's published
 * constants and the small mixing steps both ends use. Internal to xxh3. */
#ifndef KVSTORE_NATIVE_XXH3_PARTS_H
#define KVSTORE_NATIVE_XXH3_PARTS_H
#include <stdint.h>
#include <string.h>

#define XXH3_PRIME32_1 0x9E3779B1u
#define XXH3_PRIME32_2 0x85EBCA77u
#define XXH3_PRIME32_3 0xC2B2AE3Du
#define XXH3_PRIME64_1 0x9E3779B185EBCA87ull
#define XXH3_PRIME64_2 0xC2B2AE3D27D4EB4Full
#define XXH3_PRIME64_3 0x165667B19E3779F9ull
#define XXH3_PRIME64_4 0x85EBCA77C2B2AE63ull
#define XXH3_PRIME64_5 0x27D4EB2F165667C5ull
#define XXH3_PRIME_MX1 0x165667919E3779F9ull
#define XXH3_PRIME_MX2 0x9FB21C651E98DF25ull

enum {
    XXH3_SECRET_BYTES = 192,
    XXH3_SHORT_MAX = 240,            /* longer inputs take the stripe loop */
    XXH3_BLOCK_STRIPES = 16,         /* (192 - 64) / 8: stripes between two scrambles */
    XXH3_SCRAMBLE_KEY = 192 - 64,    /* the scramble's key: the secret's last 64 bytes */
    XXH3_LAST_STRIPE_KEY = 192 - 64 - 7,
    XXH3_MERGE_KEY = 11,
};

/* The default secret: 192 bytes from the algorithm's specification. */
extern const uint8_t xxh3_secret[XXH3_SECRET_BYTES];

/* The accumulators before the first stripe. */
extern const uint64_t xxh3_acc_init[8];

static inline uint64_t xxh3_read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);   /* little-endian: setup.py builds on such machines only */
    return v;
}

static inline uint32_t xxh3_read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 128-bit product of a and b, its halves xor'ed. */
static inline uint64_t xxh3_fold(uint64_t a, uint64_t b) {
    unsigned __int128 product = (unsigned __int128)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= XXH3_PRIME_MX1;
    return h ^ (h >> 32);
}

/* Inputs of at most 240 bytes (xxh3.c). */
uint64_t xxh3_short(const uint8_t *data, size_t nbytes);

/* The long hash's result from its accumulators, all stripes folded. */
uint64_t xxh3_merge(const uint64_t acc[8], uint64_t total);
#endif
