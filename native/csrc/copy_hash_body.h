/* The bodies of copy_hash and copy_out_hash, compiled once per instruction set (copy_hash.c,
 * copy_hash_avx2.c, copy_hash_avx512.c): the including file names the functions (COPY_HASH_NAME,
 * COPY_OUT_HASH_NAME) and the xxh3 kernel they stream through (HASH_UPDATE, HASH_DIGEST: xxh3.h;
 * COPY_AND_HASH, where the kernel copies as it hashes, with the alignment its stores need,
 * COPY_AND_HASH_ALIGN); COPY_STREAM_AVX512 streams a copy out in whole cache lines. */
#include <immintrin.h>
#include <string.h>

#include "copy_hash.h"
#include "xxh3.h"

#if !defined(COPY_HASH_NAME) || !defined(COPY_HASH_UPDATE_NAME) || !defined(COPY_OUT_HASH_NAME) || \
    !defined(HASH_UPDATE) || !defined(HASH_DIGEST)
#error "define COPY_HASH_NAME, COPY_HASH_UPDATE_NAME, COPY_OUT_HASH_NAME, HASH_UPDATE and HASH_DIGEST before including copy_hash_body.h"
#endif

/* Pieces this small stay in L1 between the copy and the hash, and are short enough for the
 * out-of-order core to overlap one piece's hashing with the next one's loads from DRAM. A whole
 * number of stripes, so the stream folds each piece from where it lies (xxh3.h). */
enum { PIECE_BYTES = 4 << 10 };

/* Streamed stores fill whole cache lines, so the stream starts at a line: from a destination aligned
 * only to 16 or 32 bytes (as numpy's own allocations are), lines went out part-filled, and a get
 * into such a buffer ran at a quarter of memmove. */
#ifdef COPY_STREAM_AVX512
__attribute__((target("avx512f")))
#else
__attribute__((target("avx2")))
#endif
static void copy_stream(uint8_t *dst, const uint8_t *src, size_t nbytes) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > nbytes)
        head = nbytes;
    memcpy(dst, src, head);
    size_t i = head;
#ifdef COPY_STREAM_AVX512
    for (; i + 128 <= nbytes; i += 128) {   /* a line a store: the write-combining buffer fills in one go */
        __m512i a = _mm512_loadu_si512(src + i);
        __m512i b = _mm512_loadu_si512(src + i + 64);
        _mm512_stream_si512((__m512i *)(dst + i), a);
        _mm512_stream_si512((__m512i *)(dst + i + 64), b);
    }
#endif
    for (; i + 128 <= nbytes; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + i, src + i, nbytes - i);
}

/* Each piece's copy stalls while the piece before it is hashed and written out, and the hardware
 * prefetcher does not run far enough ahead to cover that gap (it stops at each 4 KiB boundary):
 * asking for the next piece's lines first keeps the reads flowing. Gets (pages of 4 MiB, 1 GiB
 * working set): about 0.85 -> 0.97 of memmove. Never past the page or segment being read: what
 * follows it may not be the next thing copied. */
static inline void prefetch_next_piece(const uint8_t *next, const uint8_t *end) {
    const uint8_t *stop = next + PIECE_BYTES < end ? next + PIECE_BYTES : end;
    for (const uint8_t *line = next; line < stop; line += 64)
        __builtin_prefetch(line, 0, 3);
}

/* Whether a piece goes to `dst` through the registers it is hashed from (COPY_AND_HASH, where the
 * kernel has one: xxh3_update_copy), which streamed stores need aligned (COPY_AND_HASH_ALIGN), and
 * the stream at a stripe's end (a page's segments of whole stripes, as KV layouts cut them): the
 * copy and the hash then overlap, where a copy and then a hash of the piece take turns, and a get
 * needs no bounce. Gets of 1 MiB pages into a page-aligned buffer: 6.2 -> 8.5 GB/s (native/README.md). */
#ifdef COPY_AND_HASH
enum { COPY_AND_HASH_KERNEL = 1 };
#else
enum { COPY_AND_HASH_KERNEL = 0 };
#define COPY_AND_HASH(state, dst, src, n) ((void)0)
#define COPY_AND_HASH_ALIGN 1
#endif
static inline int fused(int streaming, const uint8_t *dst, const xxh3_state_t *state) {
    return COPY_AND_HASH_KERNEL && streaming && !((uintptr_t)dst & (COPY_AND_HASH_ALIGN - 1)) &&
           xxh3_at_stripe(state);
}

/* Copy nbytes from src to dst, feeding them to the stream, piece by piece. Returns dst past them. */
static uint8_t *copy_hash_run(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes, int streaming) {
    for (size_t done = 0; done < nbytes; done += PIECE_BYTES) {
        size_t n = nbytes - done < PIECE_BYTES ? nbytes - done : PIECE_BYTES;
        prefetch_next_piece(src + done + n, src + nbytes);
        if (fused(streaming, dst, state)) {
            COPY_AND_HASH(state, dst, src + done, n);
        } else {
            if (streaming)
                copy_stream(dst, src + done, n);
            else
                memcpy(dst, src + done, n);
            HASH_UPDATE(state, src + done, n);
        }
        dst += n;
    }
    return dst;
}

uint64_t COPY_HASH_NAME(uint8_t *dst, const segment_t *segments, size_t count, int streaming) {
    xxh3_state_t state;
    xxh3_reset(&state);
    for (size_t s = 0; s < count; s++)
        dst = copy_hash_run(&state, dst, segments[s].src, segments[s].nbytes, streaming);
    return HASH_DIGEST(&state);   /* unfenced: the caller fences once after its pages (copy_fence) */
}

void COPY_HASH_UPDATE_NAME(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes, int streaming) {
    copy_hash_run(state, dst, src, nbytes, streaming);
    if (streaming)
        _mm_sfence();   /* visible before the caller reads dst or tells anyone it is there */
}

/* A reader hashes its copy, not the slot: the slot is shared memory that another client of the
 * same tenant may change during the copy, and the checksum must vouch for what the caller got.
 * Each piece goes through registers (fused) or else a private bounce buffer in L1: it is hashed there
 * and written out from there (with non-temporal stores when streaming, as memcpy does for large copies), so the bytes
 * hashed are the bytes written, and DRAM still sees one read and one write. */
uint64_t COPY_OUT_HASH_NAME(const uint8_t *src, const segment_t *segments, size_t count, int streaming) {
    _Alignas(64) uint8_t bounce[PIECE_BYTES];
    xxh3_state_t state;
    xxh3_reset(&state);
    const uint8_t *end = src;
    for (size_t s = 0; s < count; s++)
        end += segments[s].nbytes;
    for (size_t s = 0; s < count; s++) {
        uint8_t *dst = (uint8_t *)(uintptr_t)segments[s].src;
        size_t nbytes = segments[s].nbytes;
        for (size_t done = 0; done < nbytes; done += PIECE_BYTES) {
            size_t n = nbytes - done < PIECE_BYTES ? nbytes - done : PIECE_BYTES;
            prefetch_next_piece(src + n, end);
            if (fused(streaming, dst + done, &state)) {
                COPY_AND_HASH(&state, dst + done, src, n);
            } else {
                memcpy(bounce, src, n);
                __asm__ volatile("" : : "r"(bounce) : "memory");   /* read the bounce, never the slot again */
                HASH_UPDATE(&state, bounce, n);
                if (streaming)
                    copy_stream(dst + done, bounce, n);
                else
                    memcpy(dst + done, bounce, n);
            }
            src += n;
        }
    }
    return HASH_DIGEST(&state);   /* unfenced: the caller fences once after its pages (copy_fence) */
}
