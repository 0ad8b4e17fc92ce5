#ifndef KVSTORE_NATIVE_PREFIX_HASH_H
#define KVSTORE_NATIVE_PREFIX_HASH_H
#include <stddef.h>
#include <stdint.h>

enum { PREFIX_HASH_LIBCRYPTO = 1, PREFIX_HASH_SHA_NI = 2 };

/* The SHA-256 kernel named "auto" (the fastest this CPU has), "libcrypto" or "sha_ni"; -1 for a
 * name unknown or a kernel this CPU lacks. */
int prefix_hash_kernel(const char *name);

/* Digests of every full page of `count` tokens (elements of `itemsize` 4 or 8 bytes, signed or
 * not), chained from `prior` (prior_bytes may be 0), by `kernel` (prefix_hash_kernel). Returns 0,
 * or -1 if a token id is outside 0..INT64_MAX (digests are then partly written). */
int prefix_hash_chain(const uint8_t *tokens, size_t count, int itemsize, int is_signed,
                      size_t page_tokens, const uint8_t *prior, size_t prior_bytes, int kernel,
                      uint8_t (*digests)[32]);

void to_hex(const uint8_t digest[32], char out[64]);
#endif
