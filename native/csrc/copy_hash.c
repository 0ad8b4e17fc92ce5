/* Copy a page into its slot and hash it in the same pass.
 *
 * The page is taken in small pieces: each piece is copied, then hashed (XXH3_64bits, streaming:
 * xxh3.h) from the source while it is still in L1, so DRAM sees one read of the source and one
 * write of the slot, where memcpy + a separate hash reads the page twice (the hash's read is what
 * the node's commit used to cost). Where the CPU has AVX2 the slot is written with non-temporal
 * stores: nothing on this core reads it back soon, and they skip the read-for-ownership a cached
 * store costs; where it has AVX-512F, a whole cache line a store, hashed a stripe a register. The
 * result equals the one-shot XXH3_64bits of the page (the stream is defined so), whatever the
 * instruction set.
 */
#define COPY_HASH_NAME copy_hash_sse2
#define COPY_HASH_UPDATE_NAME copy_hash_update_sse2
#define COPY_OUT_HASH_NAME copy_out_hash_sse2
#define HASH_UPDATE xxh3_update_sse2
#define HASH_DIGEST xxh3_digest_sse2
#include "copy_hash_body.h"

uint64_t copy_hash_avx2(uint8_t *dst, const segment_t *segments, size_t count, int streaming);
uint64_t copy_out_hash_avx2(const uint8_t *src, const segment_t *segments, size_t count, int streaming);
void copy_hash_update_avx2(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes, int streaming);
void copy_streamed_avx2(uint8_t *dst, const uint8_t *src, size_t nbytes);
uint64_t copy_hash_avx512(uint8_t *dst, const segment_t *segments, size_t count, int streaming);
uint64_t copy_out_hash_avx512(const uint8_t *src, const segment_t *segments, size_t count, int streaming);
void copy_hash_update_avx512(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes, int streaming);
void copy_streamed_avx512(uint8_t *dst, const uint8_t *src, size_t nbytes);

int cpu_avx2(void) {
    __builtin_cpu_init();   /* at once after the first call; needed where a copy runs before libgcc's own */
    return __builtin_cpu_supports("avx2");
}

int cpu_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* Skylake-SP and its successors up to Cooper Lake lower a core's clock for a while after 512-bit multiplies,
 * which would slow the Python beside the copies on that core: there, as glibc's memcpy does, the copies keep
 * to AVX2 unless told otherwise. */
static int avx512_lowers_clock(void) {
    __builtin_cpu_init();
    return __builtin_cpu_is("skylake-avx512") || __builtin_cpu_is("cascadelake") || __builtin_cpu_is("cooperlake");
}

static void copy_plain(uint8_t *dst, const uint8_t *src, size_t nbytes) {
    memcpy(dst, src, nbytes);
}

/* One kernel's entry points; `streaming`: whether it writes with non-temporal stores. */
static const struct {
    uint64_t (*copy_hash)(uint8_t *dst, const segment_t *segments, size_t count, int streaming);
    uint64_t (*copy_out_hash)(const uint8_t *src, const segment_t *segments, size_t count, int streaming);
    void (*copy_hash_update)(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes, int streaming);
    void (*copy_streamed)(uint8_t *dst, const uint8_t *src, size_t nbytes);
    uint64_t (*digest)(const xxh3_state_t *state);
    uint64_t (*hash)(const uint8_t *data, size_t nbytes);
    int streaming;
} KERNELS[] = {
    [COPY_SSE2] = {copy_hash_sse2, copy_out_hash_sse2, copy_hash_update_sse2, copy_plain,
                   xxh3_digest_sse2, xxh3_64_sse2, 0},
    [COPY_AVX2] = {copy_hash_avx2, copy_out_hash_avx2, copy_hash_update_avx2, copy_streamed_avx2,
                   xxh3_digest_avx2, xxh3_64_avx2, 1},
    [COPY_AVX512] = {copy_hash_avx512, copy_out_hash_avx512, copy_hash_update_avx512, copy_streamed_avx512,
                     xxh3_digest_avx512, xxh3_64_avx512, 1},
};

static int cap = -1;   /* an enum copy_kernel once copy_kernel_cap was called, else the default choice */

static enum copy_kernel widest_run(void) {
    return cpu_avx512() ? COPY_AVX512 : cpu_avx2() ? COPY_AVX2 : COPY_SSE2;
}

/* The default choice: the widest kernel this CPU runs and prefers. Found once, not on every page's copy; two
 * threads that race to find it find the same. */
static enum copy_kernel preferred(void) {
    static int known = -1;
    if (known < 0) {
        enum copy_kernel runs = widest_run();
        known = runs == COPY_AVX512 && avx512_lowers_clock() ? COPY_AVX2 : runs;
    }
    return (enum copy_kernel)known;
}

/* The kernel the copies run: the default choice, or the widest this CPU runs up to the cap. */
static enum copy_kernel widest(void) {
    if (cap < 0)
        return preferred();
    enum copy_kernel runs = widest_run();
    return (int)runs < cap ? runs : (enum copy_kernel)cap;
}

enum copy_kernel copy_kernel_cap(int widest_allowed) {
    cap = widest_allowed;
    return widest();
}

uint64_t copy_hash_unfenced(uint8_t *dst, const segment_t *segments, size_t count) {
    enum copy_kernel k = widest();
    return KERNELS[k].copy_hash(dst, segments, count, KERNELS[k].streaming);
}

uint64_t copy_out_hash_unfenced(const uint8_t *src, const segment_t *segments, size_t count) {
    enum copy_kernel k = widest();
    return KERNELS[k].copy_out_hash(src, segments, count, KERNELS[k].streaming);
}

void copy_fence(void) {
    if (KERNELS[widest()].streaming)
        _mm_sfence();
}

uint64_t copy_hash(uint8_t *dst, const segment_t *segments, size_t count) {
    uint64_t sum = copy_hash_unfenced(dst, segments, count);
    copy_fence();
    return sum;
}

void copy_hash_update(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes) {
    enum copy_kernel k = widest();
    KERNELS[k].copy_hash_update(state, dst, src, nbytes, KERNELS[k].streaming);
}

void copy_streamed(uint8_t *dst, const uint8_t *src, size_t nbytes) {
    KERNELS[widest()].copy_streamed(dst, src, nbytes);
}

uint64_t copy_hash_digest(const xxh3_state_t *state) {
    return KERNELS[widest()].digest(state);
}

uint64_t hash_bytes(const uint8_t *data, size_t nbytes) {
    return KERNELS[widest()].hash(data, nbytes);
}
