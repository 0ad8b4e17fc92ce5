/* BLAKE2b with an 8-byte digest (placement_hash.c). */
#ifndef KVSTORE_PLACEMENT_HASH_H
#define KVSTORE_PLACEMENT_HASH_H

#include <stddef.h>
#include <stdint.h>

uint64_t blake2b_64(const uint8_t *data, size_t nbytes);

#endif
