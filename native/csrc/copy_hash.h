#ifndef KVSTORE_NATIVE_COPY_HASH_H
#define KVSTORE_NATIVE_COPY_HASH_H
#include <stddef.h>
#include <stdint.h>

#include "xxh3.h"

typedef struct { const uint8_t *src; size_t nbytes; } segment_t;

/* Copy segments back to back into dst and return XXH3_64bits of the bytes copied, reading
 * each byte from memory once. Fenced: what it wrote is visible to other cores when it returns. */
uint64_t copy_hash(uint8_t *dst, const segment_t *segments, size_t count);

/* copy_hash without its closing store fence, for a loop over many pages, which then calls copy_fence()
 * once before anyone else may read what it wrote (it returns, answers, or commits). Streamed stores are
 * weakly ordered, and a fence waits until every one is in memory. A fence after each page of 4 KiB, against
 * one a batch (bench/hot_path.py, alternated, three runs each): gets 586-609k pages/s against 642-706k,
 * puts 406-445k against 423-457k; 64 KiB pages and up moved the same either way. */
uint64_t copy_hash_unfenced(uint8_t *dst, const segment_t *segments, size_t count);

/* Copy src out into the segments (their addresses are the destinations) and return XXH3_64bits
 * of the bytes that landed there, hashed from the destination. Unfenced, as copy_hash_unfenced: every
 * caller copies a batch of pages and then calls copy_fence(). */
uint64_t copy_out_hash_unfenced(const uint8_t *src, const segment_t *segments, size_t count);

void copy_fence(void);

/* Copy nbytes from src to dst and feed them to an xxh3 stream (xxh3_reset), in the same pass: a page
 * that arrives a piece at a time (a socket read into a private buffer) is copied into place and hashed
 * as each piece comes. copy_hash_digest(state) is then XXH3_64bits of every byte fed. */
void copy_hash_update(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes);
uint64_t copy_hash_digest(const xxh3_state_t *state);

/* Copy nbytes from src to dst with copy_hash_update's streamed stores (memcpy without AVX2), and no hash. */
void copy_streamed(uint8_t *dst, const uint8_t *src, size_t nbytes);

/* XXH3_64bits of [data, data + nbytes). */
uint64_t hash_bytes(const uint8_t *data, size_t nbytes);

/* Whether this CPU has AVX2, AVX-512F: the copies and xxh3 run the widest kernel it has. */
int cpu_avx2(void);
int cpu_avx512(void);

/* The copies' kernels, narrowest first. copy_kernel_cap keeps them to one no wider than `widest_allowed`
 * (an enum copy_kernel; -1: the default choice) and returns the one they run now: tests reach each kernel
 * the CPU runs this way. */
enum copy_kernel { COPY_SSE2, COPY_AVX2, COPY_AVX512 };
enum copy_kernel copy_kernel_cap(int widest_allowed);
#endif
