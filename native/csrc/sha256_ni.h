#ifndef KVSTORE_NATIVE_SHA256_NI_H
#define KVSTORE_NATIVE_SHA256_NI_H
#include <stddef.h>
#include <stdint.h>

/* A streaming SHA-256 on the x86 SHA extensions; call only where cpu_sha_ni() is 1. */
typedef struct {
    uint32_t state[8];
    uint8_t block[64];
    size_t buffered;    /* bytes of `block` waiting for the rest of their block */
    uint64_t length;    /* bytes hashed so far */
} Sha256Ni;

int cpu_sha_ni(void);
void sha256_ni_init(Sha256Ni *ctx);
void sha256_ni_update(Sha256Ni *ctx, const void *data, size_t nbytes);
void sha256_ni_final(uint8_t digest[32], Sha256Ni *ctx);

/* digests[p] = SHA-256(digests[p - 1] || page p's page_bytes of data), digests[-1] being `first`,
 * for `pages` pages back to back; page_bytes at least 32. */
void sha256_ni_chain(const uint8_t *data, size_t pages, size_t page_bytes, const uint8_t first[32],
                     uint8_t (*digests)[32]);
#endif
